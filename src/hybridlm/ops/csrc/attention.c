#include "bf16.h"
#include <math.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>

#define KB 64  /* keys per block, aligned to absolute positions */

/* One vector of VL floats: an AVX-512 register, else 8 (one AVX2 register, two of SSE or NEON), so a
   tile's accumulators fit the ISA's register file. */
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
typedef float f32xv __attribute__((vector_size(VL * 4)));
typedef uint16_t u16xv __attribute__((vector_size(VL * 2)));
typedef uint32_t u32xv __attribute__((vector_size(VL * 4)));

static inline f32xv loadv(const void* p, int bf16) {
    f32xv v;
#if defined(__AVX512F__)
    /* one widening load (GCC splits the generic conversion below into 256-bit halves) */
    if (bf16) return (f32xv)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p)), 16);
#elif defined(__AVX2__)
    if (bf16) return (f32xv)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p)), 16);
#endif
    if (bf16) {
        u16xv h; memcpy(&h, p, sizeof h);
        u32xv u = __builtin_convertvector(h, u32xv) << 16;
        memcpy(&v, &u, sizeof v);
    } else memcpy(&v, p, sizeof v);
    return v;
}
static inline float hsum(f32xv v) {
    float s = 0.f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}
#define RG 4  /* query rows (heads of one key/value head at one token) that share each key read */
#define KG 4  /* keys per scores tile */
#define YB 4  /* vector-wide slices of each row's output sum carried across keys */

/* out[r][j] = a[r] . b[j] over D for nr rows, nk keys (a float32, b in the element type): per pair VL
   lanes of multiply-adds in order, their sum in lane order, then the tail. The pairs' dependent
   chains are interleaved so that they overlap, and each key row is widened once for all rows. */
static inline __attribute__((always_inline)) void score_tile(const float* const* a, int nr,
                                                              const char* const* b, int nk, int64_t D,
                                                              int bf16, float* const* out) {
    f32xv acc[RG][KG];
    for (int r = 0; r < nr; r++) for (int j = 0; j < nk; j++) acc[r][j] = (f32xv){0};
    int64_t i = 0;
    const size_t es = bf16 ? 2 : 4;
    for (; i + VL <= D; i += VL) {
        f32xv kv[KG];
        for (int j = 0; j < nk; j++) kv[j] = loadv(b[j] + i * es, bf16);
        for (int r = 0; r < nr; r++) {
            f32xv av; memcpy(&av, a[r] + i, sizeof av);
            for (int j = 0; j < nk; j++) acc[r][j] += av * kv[j];
        }
    }
    for (int r = 0; r < nr; r++) for (int j = 0; j < nk; j++) {
        float s = hsum(acc[r][j]);
        for (int64_t t = i; t < D; t++) s += a[r][t] * load(b[j], t, bf16);
        out[r][j] = s;
    }
}

/* scores[r][j] = a[r] . b[j] for keys j < n of nr (<= RG) rows, KG keys a tile. */
static void score_rows(const float* const* a, int nr, const char* const* b, int64_t n, int64_t D, int bf16,
                       float* const* scores) {
    int64_t j = 0;
    for (; j + KG <= n; j += KG) {
        float* out[RG];
        for (int r = 0; r < nr; r++) out[r] = scores[r] + j;
        switch (nr) {
            case 1: score_tile(a, 1, b + j, KG, D, bf16, out); break;
            case 2: score_tile(a, 2, b + j, KG, D, bf16, out); break;
            case 3: score_tile(a, 3, b + j, KG, D, bf16, out); break;
            default: score_tile(a, RG, b + j, KG, D, bf16, out);
        }
    }
    for (; j < n; j++) {
        float* out[RG];
        for (int r = 0; r < nr; r++) out[r] = scores[r] + j;
        score_tile(a, nr, b + j, 1, D, bf16, out);
    }
}

/* y[r] += e[r][j] * x[j] for j = 0..n-1 in order, nr (<= RG) rows (x[j]: rows in the element type):
   per element of y one multiply-add per key, in key order. Each element's sum is one dependent chain
   over the keys, so YB vector-wide slices of every row are carried at once (one slice alone waited out
   the multiply-add latency at every key), each value slice widened once for all rows. */
static inline __attribute__((always_inline)) void pv_tile(float* const* y, int nr, const float* const* e,
                                                           const char* const* x, int64_t n, int64_t i,
                                                           int bf16) {
    const size_t es = bf16 ? 2 : 4;
    f32xv yv[RG][YB];
    for (int r = 0; r < nr; r++) memcpy(yv[r], y[r] + i, sizeof yv[r]);
    for (int64_t j = 0; j < n; j++) {
        f32xv xv[YB];
        for (int c = 0; c < YB; c++) xv[c] = loadv(x[j] + (i + VL * c) * es, bf16);
        for (int r = 0; r < nr; r++) {
            const float w = e[r][j];
            for (int c = 0; c < YB; c++) yv[r][c] += w * xv[c];
        }
    }
    for (int r = 0; r < nr; r++) memcpy(y[r] + i, yv[r], sizeof yv[r]);
}

static void pv_rows(float* const* y, int nr, const float* const* e, const char* const* x, int64_t n,
                    int64_t D, int bf16) {
    int64_t i = 0;
    for (; i + VL * YB <= D; i += VL * YB) {
        switch (nr) {
            case 1: pv_tile(y, 1, e, x, n, i, bf16); break;
            case 2: pv_tile(y, 2, e, x, n, i, bf16); break;
            case 3: pv_tile(y, 3, e, x, n, i, bf16); break;
            default: pv_tile(y, RG, e, x, n, i, bf16);
        }
    }
    for (int r = 0; r < nr; r++) {
        for (int64_t c = i; c + VL <= D; c += VL) {
            f32xv yv; memcpy(&yv, y[r] + c, sizeof yv);
            for (int64_t j = 0; j < n; j++) yv += e[r][j] * loadv(x[j] + c * (bf16 ? 2 : 4), bf16);
            memcpy(y[r] + c, &yv, sizeof yv);
        }
        for (int64_t c = i + (D - i) / VL * VL; c < D; c++)
            for (int64_t j = 0; j < n; j++) y[r][c] += e[r][j] * load(x[j], c, bf16);
    }
}

/* A segment table: per segment SEG_FIELDS int64 fields, the k and v addresses, the end of its key
   rows (counted across the segments), then the strides (batch, head, row) of k and of v in elements.
   The segments are read as one buffer: read-only shared ones (copy-on-write), then the own rows. */
enum { SEG_K, SEG_V, SEG_END, SEG_KST, SEG_VST = SEG_KST + 3, SEG_FIELDS = SEG_VST + 3 };

/* One sequence's keys / values: `nseg` segments of table `seg`, at batch row b; key row j
   (0 <= j < T, counted across the segments) holds position key_start + j. */
typedef struct {
    const int64_t* seg;
    int64_t nseg, b, T, key_start;
} kv_view;

/* The run of key (which = SEG_K) or value (SEG_V) rows of kv head g from row jj (0 <= jj < T) on that
   one segment holds, at most n rows: sets *row to its first row's address and *step to the bytes
   from one row to the next; returns its length. */
static inline int64_t seg_run(const kv_view* kv, int which, int64_t g, int64_t jj, int64_t n, size_t es,
                              const char** row, int64_t* step) {
    int64_t s = 0;
    while (s < kv->nseg - 1 && jj >= kv->seg[s * SEG_FIELDS + SEG_END]) s++;
    const int64_t* t = kv->seg + s * SEG_FIELDS;
    const int64_t first = s > 0 ? t[SEG_END - SEG_FIELDS] : 0, left = t[SEG_END] - jj;
    const int64_t* st = t + (which == SEG_K ? SEG_KST : SEG_VST);
    *row = (const char*)(intptr_t)t[which] + (kv->b * st[0] + g * st[1] + (jj - first) * st[2]) * es;
    *step = st[2] * (int64_t)es;
    return left < n ? left : n;
}

/* The L queries of one sequence on key/value head g: q rows (head h, token t) at q + h*q_sh + t*q_sl,
   positions qpos [L], outputs at out + h*out_sh + t*out_sl (elements). buf holds
   R*(D + Dv + 2) + RG*KB floats, R = (Hq/Hkv)*L. Both entry points run exactly this, so a sequence's
   numbers never depend on what else was in the call. */
static void attend_group(const char* q, int64_t q_sh, int64_t q_sl, const kv_view* kv, int64_t g,
                         char* out, int64_t out_sh, int64_t out_sl, const int64_t* qpos, int64_t Hq,
                         int64_t Hkv, int64_t L, int64_t D, int64_t Dv, int64_t window, float scale,
                         float softcap, int is_bf16, float* buf) {
    const int64_t rep = Hq / Hkv, R = rep * L, T = kv->T, key_start = kv->key_start;
    const size_t es = is_bf16 ? 2 : 4;
    float *qf = buf, *acc = qf + R * D, *m = acc + R * Dv, *l = m + R, *sc = l + R;
    int64_t lo = INT64_MAX, hi = -1;
    for (int64_t r = 0; r < R; r++) {
        const int64_t h = g * rep + r / L, t = r % L;
        const char* qrow = q + (h * q_sh + t * q_sl) * es;
        for (int64_t i = 0; i < D; i++) qf[r * D + i] = load(qrow, i, is_bf16);
        for (int64_t i = 0; i < Dv; i++) acc[r * Dv + i] = 0.f;
        m[r] = -INFINITY;
        l[r] = 0.f;
        const int64_t p = qpos[t], first = window > 0 ? p - window + 1 : 0;
        if (first < lo) lo = first;
        if (p > hi) hi = p;
    }
    if (lo < key_start) lo = key_start;
    if (hi > key_start + T - 1) hi = key_start + T - 1;
    const int64_t b0 = lo >= 0 ? lo / KB * KB : 0;
    const char* kp[KB];  /* the block's key / value rows, from its first visible key jlo on */
    const char* vp[KB];
    for (int64_t p0 = b0; p0 <= hi; p0 += KB) {
        int64_t jlo = p0 > key_start ? p0 : key_start, jhi = p0 + KB - 1;
        if (jhi > hi) jhi = hi;
        if (jlo > jhi) continue;
        for (int64_t j = jlo; j <= jhi;) {  /* one segment's run at a time */
            const char *kj, *vj;
            int64_t kstep, vstep;
            const int64_t n = seg_run(kv, SEG_K, g, j - key_start, jhi - j + 1, es, &kj, &kstep);
            seg_run(kv, SEG_V, g, j - key_start, n, es, &vj, &vstep);
            for (int64_t i = 0; i < n; i++, j++, kj += kstep, vj += vstep) {
                kp[j - jlo] = kj;
                vp[j - jlo] = vj;
            }
        }
        /* The rows of one query token (the heads sharing this key/value head) see the same keys:
           up to RG of them read each key and value row once. Every row's numbers are those of its
           own loop over the keys, whatever rows share the tile. */
        for (int64_t t = 0; t < L; t++) {
            const int64_t p = qpos[t];
            int64_t a = jlo, z = jhi;
            if (window > 0 && a < p - window + 1) a = p - window + 1;
            if (z > p) z = p;
            if (a > z) continue;
            for (int64_t h0 = 0; h0 < rep; h0 += RG) {
                const int nr = rep - h0 < RG ? (int)(rep - h0) : RG;
                const float* qs[RG];
                float* scs[RG];
                float* ys[RG];
                for (int i = 0; i < nr; i++) {
                    const int64_t r = (h0 + i) * L + t;
                    qs[i] = qf + r * D;
                    scs[i] = sc + i * KB;
                    ys[i] = acc + r * Dv;
                }
                score_rows(qs, nr, kp + (a - jlo), z - a + 1, D, is_bf16, scs);
                for (int i = 0; i < nr; i++) {
                    const int64_t r = (h0 + i) * L + t;
                    float* si = scs[i];
                    float bm = -INFINITY;
                    for (int64_t j = 0; j <= z - a; j++) {
                        float s = si[j] * scale;
                        if (softcap > 0.f) s = tanhf(s / softcap) * softcap;
                        si[j] = s;
                        if (s > bm) bm = s;
                    }
                    const float mn = bm > m[r] ? bm : m[r];
                    const float alpha = expf(m[r] - mn);
                    for (int64_t c = 0; c < Dv; c++) ys[i][c] *= alpha;
                    l[r] *= alpha;
                    for (int64_t j = 0; j <= z - a; j++) {
                        const float e = expf(si[j] - mn);
                        l[r] += e;
                        si[j] = e;
                    }
                    m[r] = mn;
                }
                pv_rows(ys, nr, (const float* const*)scs, vp + (a - jlo), z - a + 1, Dv, is_bf16);
            }
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t h = g * rep + r / L, t = r % L;
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        for (int64_t i = 0; i < Dv; i++) store(out, h * out_sh + t * out_sl + i, acc[r * Dv + i] * inv, is_bf16);
    }
}

/* q [B, Hq, L, D]; the keys / values are the nseg segments of table `seg` (above: segment i holds
   key rows [end_{i-1}, end_i), end_{-1} = 0, end_{nseg-1} = T; k [B, Hkv, n_i, D], v [B, Hkv, n_i, Dv],
   last dim contiguous) read as one buffer; out [B, Hq, L, Dv] contiguous; qpos [B, L] absolute query
   positions; key row j holds position key_start + j. A query at p sees keys at positions in
   [p - window + 1, p] (window 0: [0, p]). Only a key's address depends on which segment holds it,
   never the arithmetic or its order: the result is the same bits however the rows are split into
   segments. Returns 0, or -1 when out of memory. */
int hybridlm_attention(const void* q, const int64_t* seg, int64_t nseg, void* out, const int64_t* qpos,
                       int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t T, int64_t D, int64_t Dv,
                       int64_t q_sb, int64_t q_sh, int64_t q_sl, int64_t key_start, int64_t window,
                       float scale, float softcap, int is_bf16, int nthreads) {
    const int64_t R = Hq / Hkv * L;
    const size_t es = is_bf16 ? 2 : 4;
    int failed = 0;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t bg = 0; bg < B * Hkv; bg++) {
        const int64_t b = bg / Hkv, g = bg % Hkv;
        float* buf = malloc(sizeof(float) * (R * (D + Dv + 2) + RG * KB));
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
            continue;
        }
        const kv_view kv = {seg, nseg, b, T, key_start};
        attend_group((const char*)q + b * q_sb * es, q_sh, q_sl, &kv, g, (char*)out + b * Hq * L * Dv * es,
                     L * Dv, Dv, qpos + b * L, Hq, Hkv, L, D, Dv, window, scale, softcap, is_bf16, buf);
        free(buf);
    }
    return failed ? -1 : 0;
}

/* Several sequences' queries packed end to end in one call (decode and verify rows of many
   sequences), each over its own keys / values: q [Hq, N, D] (strides q_sh, q_sl) and out [Hq, N, Dv]
   (contiguous) hold sequence i's rows at [starts[i], starts[i] + lens[i]), at positions qpos [N];
   views[i] = (first segment, segments, T, key_start, window): its keys / values are segments
   [first, first + segments) of table `seg` (as in hybridlm_attention, batch row 0). Rows outside
   every sequence are not touched. Parallel over sequences x key/value heads; each runs attend_group
   as hybridlm_attention would on that sequence alone, so the bits are the same. Returns 0, or -1
   when out of memory. */
int hybridlm_attention_packed(const void* q, int64_t q_sh, int64_t q_sl, void* out, int64_t N,
                              const int64_t* qpos, const int64_t* starts, const int64_t* lens,
                              const int64_t* seg, const int64_t* views, int64_t nseq, int64_t Hq,
                              int64_t Hkv, int64_t D, int64_t Dv, float scale,
                              float softcap, int is_bf16, int nthreads) {
    const size_t es = is_bf16 ? 2 : 4;
    int failed = 0;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t ig = 0; ig < nseq * Hkv; ig++) {
        const int64_t i = ig / Hkv, g = ig % Hkv, L = lens[i], R = Hq / Hkv * L;
        float* buf = malloc(sizeof(float) * (R * (D + Dv + 2) + RG * KB));
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
            continue;
        }
        const int64_t* w = views + 5 * i;
        const kv_view kv = {seg + w[0] * SEG_FIELDS, w[1], 0, w[2], w[3]};
        attend_group((const char*)q + starts[i] * q_sl * es, q_sh, q_sl, &kv, g,
                     (char*)out + starts[i] * Dv * es, N * Dv, Dv, qpos + starts[i], Hq, Hkv, L, D, Dv,
                     w[4], scale, softcap, is_bf16, buf);
        free(buf);
    }
    return failed ? -1 : 0;
}
