/* A Gated DeltaNet layer from its conv output to the scan output, fused in C on the CPU. Per (row,
   value head) it reads q / k / v and the gate inputs straight from the projections, normalises and
   computes the gates for a block of tokens, then runs the recurrence one block of state columns at
   a time: column j of S only ever meets column j of kᵀS, delta and o, so a [Dk, 32] slice (16 KiB)
   stays in L1 across the whole token block, and the state crosses the cache hierarchy once per
   block instead of three times per token. This replaces the ~40 small ATen ops of the composed path
   (which cost more than the scan itself in decode) and beats the chunked form's matrix products. */
#include "bf16.h"
#include <math.h>
#include <stdlib.h>

#define TB 64  /* tokens per block */
#define JB 32  /* state columns per block */


/* Vectors of the ISA's width: 16 floats with AVX-512, 8 elsewhere. 16-float vectors on AVX2 ran a
   decode token's state pass at ~190 cycles a row of a column block (measured: 18 layers' decode scan
   9.6 ms with the state hot in cache); each lane's arithmetic is the same at any width. */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
#define NV (JB / VW)
typedef float vf __attribute__((vector_size(VW * sizeof(float))));
static inline vf ldv(const float* p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void stv(float* p, vf v) { memcpy(p, &v, sizeof v); }

/* kv = kᵀS on a [Dk, JB] column block of the state (row stride ld). */
static inline void kv_block(const float* S, int64_t ld, int64_t Dk, const float* k, vf kv[NV]) {
    vf acc[NV];
    for (int v = 0; v < NV; v++) acc[v] = (vf){0};
    for (int64_t i = 0; i < Dk; i++)
        for (int v = 0; v < NV; v++) acc[v] += k[i] * ldv(S + i * ld + v * VW);
    for (int v = 0; v < NV; v++) kv[v] = acc[v];
}

/* One token on a column block, given kv = kᵀS: delta = vb - db·kv; S = d·S + k deltaᵀ; o = qᵀS.
   With `knext` (the next token's k) the same pass leaves knextᵀS (new S) in kv, summed in the
   order kv_block sums it, so the state is read once per token. */
static inline void step_block(float* S, int64_t ld, int64_t Dk, const float* k, const float* q,
                              const float* vb, float d, float db, const float* knext, vf kv[NV], float* o) {
    vf delta[NV], out[NV], next[NV];
    for (int v = 0; v < NV; v++) {
        delta[v] = ldv(vb + v * VW) - db * kv[v];
        out[v] = (vf){0};
        next[v] = (vf){0};
    }
    for (int64_t i = 0; i < Dk; i++)
        for (int v = 0; v < NV; v++) {
            const vf sv = ldv(S + i * ld + v * VW) * d + k[i] * delta[v];
            stv(S + i * ld + v * VW, sv);
            out[v] += q[i] * sv;
            if (knext) next[v] += knext[i] * sv;
        }
    for (int v = 0; v < NV; v++) {
        stv(o + v * VW, out[v]);
        kv[v] = next[v];
    }
}

/* The same on the last jb < JB columns. */
static void step_cols(float* S, int64_t ld, int64_t Dk, int64_t jb, const float* k, const float* q,
                      const float* vb, float d, float db, float* o) {
    float kv[JB], delta[JB];
    for (int64_t j = 0; j < jb; j++) { kv[j] = 0.f; o[j] = 0.f; }
    for (int64_t i = 0; i < Dk; i++)
        for (int64_t j = 0; j < jb; j++) kv[j] += k[i] * S[i * ld + j];
    for (int64_t j = 0; j < jb; j++) delta[j] = vb[j] - db * kv[j];
    for (int64_t i = 0; i < Dk; i++)
        for (int64_t j = 0; j < jb; j++) {
            const float s = S[i * ld + j] * d + k[i] * delta[j];
            S[i * ld + j] = s;
            o[j] += q[i] * s;
        }
}

static void copy_cols(float* dst, const float* S, int64_t j0, int64_t jb, int64_t Dk, int64_t Dv) {
    if (jb == JB)  /* a constant size: two vector moves per row instead of a memcpy call */
        for (int64_t i = 0; i < Dk; i++) memcpy(dst + i * Dv + j0, S + i * Dv + j0, JB * sizeof(float));
    else
        for (int64_t i = 0; i < Dk; i++) memcpy(dst + i * Dv + j0, S + i * Dv + j0, jb * sizeof(float));
}

/* One (sequence, value head h) of a scan: x [L, 2*Hk*Dk + Hv*Dv] and ab [L, 2*Hv] are the sequence's
   rows, S its head's [Dk, Dv] state (advanced in place), out [L, Hv, Dv] its output rows; real of
   the L tokens are real (later ones are identity steps with zero output); bounds[si] + boff (a
   [Hv, Dk, Dv] block) receives the state after min(splits[si], real) tokens. buf holds
   TB * (2*Dk + Dv + 2) floats. Both entry points run exactly this, so a sequence's numbers never
   depend on how it was batched. */
static void scan_head(const void* x, const void* ab, const void* A_log, const void* dt_bias, float* restrict S,
                      void* out, float** bounds, int64_t boff, const int64_t* splits, int64_t nsplit,
                      int64_t L, int64_t real, int64_t h, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv,
                      float scale, int is_bf16, int params_bf16, float* buf) {
    const int64_t conv_dim = 2 * Hk * Dk + Hv * Dv, rep = Hv / Hk, hs = Dk * Dv, hk = h / rep;
    float *qn = buf, *kn = qn + TB * Dk, *vb = kn + TB * Dk, *dec = vb + TB * Dv, *db = dec + TB;
    for (int64_t si = 0; si < nsplit; si++)
        if ((splits[si] < real ? splits[si] : real) == 0) memcpy(bounds[si] + boff + h * hs, S, hs * 4);
    for (int64_t t0 = 0; t0 < L; t0 += TB) {
        const int64_t nt = L - t0 < TB ? L - t0 : TB;
        const int64_t nreal = real - t0 < 0 ? 0 : (real - t0 < nt ? real - t0 : nt);
        for (int64_t t = 0; t < nreal; t++) {
            const int64_t row = t0 + t, xbase = row * conv_dim;
            float* q = qn + t * Dk; float* k = kn + t * Dk;
            float qq = 0.f, kk = 0.f;
            for (int64_t i = 0; i < Dk; i++) {
                q[i] = load(x, xbase + hk * Dk + i, is_bf16);
                k[i] = load(x, xbase + Hk * Dk + hk * Dk + i, is_bf16);
                qq += q[i] * q[i];
                kk += k[i] * k[i];
            }
            const float qs = scale / sqrtf(qq + 1e-6f), ks = 1.f / sqrtf(kk + 1e-6f);
            for (int64_t i = 0; i < Dk; i++) { q[i] *= qs; k[i] *= ks; }
            const float a = load(ab, row * 2 * Hv + h, is_bf16) + load(dt_bias, h, params_bf16);
            const float softplus = a > 20.f ? a : log1pf(expf(a));
            const float bin = load(ab, row * 2 * Hv + Hv + h, is_bf16);
            /* torch's sigmoid on a bf16 tensor rounds its result to bf16 */
            const float beta = round_to(1.f / (1.f + expf(-bin)), is_bf16);
            dec[t] = expf(-expf(load(A_log, h, params_bf16)) * softplus);
            db[t] = beta * dec[t];
            const int64_t vbase = xbase + 2 * Hk * Dk + h * Dv;
            for (int64_t j = 0; j < Dv; j++) vb[t * Dv + j] = beta * load(x, vbase + j, is_bf16);
        }
        for (int64_t j0 = 0; j0 < Dv; j0 += JB) {
            const int64_t jb = Dv - j0 < JB ? Dv - j0 : JB;
            vf kv[NV];  /* set by kv_block before use; initialised for -Werror */
            for (int v = 0; v < NV; v++) kv[v] = (vf){0};
            if (jb == JB && nreal > 0) kv_block(S + j0, Dv, Dk, kn, kv);
            for (int64_t t = 0; t < nreal; t++) {
                float o[JB];
                const float* knext = t + 1 < nreal ? kn + (t + 1) * Dk : NULL;
                if (jb == JB) step_block(S + j0, Dv, Dk, kn + t * Dk, qn + t * Dk, vb + t * Dv + j0,
                                         dec[t], db[t], knext, kv, o);
                else step_cols(S + j0, Dv, Dk, jb, kn + t * Dk, qn + t * Dk, vb + t * Dv + j0,
                               dec[t], db[t], o);
                const int64_t obase = ((t0 + t) * Hv + h) * Dv + j0;
                for (int64_t j = 0; j < jb; j++) store(out, obase + j, o[j], is_bf16);
                for (int64_t si = 0; si < nsplit; si++)
                    if ((splits[si] < real ? splits[si] : real) == t0 + t + 1)
                        copy_cols(bounds[si] + boff + h * hs, S, j0, jb, Dk, Dv);
            }
        }
        for (int64_t t = nreal; t < nt; t++) {
            const int64_t obase = ((t0 + t) * Hv + h) * Dv;
            for (int64_t j = 0; j < Dv; j++) store(out, obase + j, 0.f, is_bf16);
        }
    }
}

/* x [B, L, 2*Hk*Dk + Hv*Dv] conv output (q | k | v), ab [B, L, 2*Hv] raw gate inputs (a | b),
   A_log, dt_bias [Hv] (bf16 when params_bf16, else float32); state [B, Hv, Dk, Dv] float32 advanced in place;
   out [B, L, Hv, Dv]; bounds[i] [B, Hv, Dk, Dv] float32 receives the state after splits[i]
   tokens; lens [B] real tokens per row (later tokens are identity steps with zero output) or NULL.
   x, ab and out hold bf16 when is_bf16, else float32. Returns 0, or -1 when out of memory. */
int hybridlm_gdn_scan(const void* x, const void* ab, const void* A_log, const void* dt_bias,
                      float* state, void* out, float** bounds, const int64_t* splits, int64_t nsplit,
                      const int64_t* lens, int64_t B, int64_t L, int64_t Hk, int64_t Hv, int64_t Dk,
                      int64_t Dv, float scale, int is_bf16, int params_bf16, int nthreads) {
    const int64_t conv_dim = 2 * Hk * Dk + Hv * Dv, hs = Dk * Dv;
    const size_t es = is_bf16 ? 2 : 4;
    int failed = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        /* per token of a block: q (scaled), k, beta*v, decay, beta*decay */
        float* buf = malloc(sizeof(float) * TB * (2 * Dk + Dv + 2));
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * Hv; bh++) {
            if (!buf) continue;
            const int64_t b = bh / Hv, h = bh % Hv;
            const int64_t real = lens ? (lens[b] < L ? lens[b] : L) : L;
            scan_head((const char*)x + b * L * conv_dim * es, (const char*)ab + b * L * 2 * Hv * es,
                      A_log, dt_bias, state + bh * hs, (char*)out + b * L * Hv * Dv * es, bounds,
                      b * Hv * hs, splits, nsplit, L, real, h, Hk, Hv, Dk, Dv, scale, is_bf16, params_bf16,
                      buf);
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

/* The scan of several sequences packed end to end in one call (decode and verify rows of many
   sequences): x [T, 2*Hk*Dk + Hv*Dv], ab [T, 2*Hv] and out [T, Hv, Dv] hold sequence i's rows at
   [starts[i], starts[i] + lens[i]); states[i] is its own [Hv, Dk, Dv] float32 state, advanced in
   place; its splits are splits[split_starts[i] .. split_starts[i+1]), the state after each going to
   the matching bounds entry ([Hv, Dk, Dv] float32). Rows outside every sequence are not touched.
   Parallel over sequences x heads; each (sequence, head) runs scan_head as hybridlm_gdn_scan would
   on that sequence alone, so the bits are the same. Returns 0, or -1 when out of memory. */
int hybridlm_gdn_scan_packed(const void* x, const void* ab, const void* A_log, const void* dt_bias,
                             float** states, void* out, float** bounds, const int64_t* splits,
                             const int64_t* split_starts, const int64_t* starts, const int64_t* lens,
                             int64_t nseq, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv, float scale,
                             int is_bf16, int params_bf16, int nthreads) {
    const int64_t conv_dim = 2 * Hk * Dk + Hv * Dv, hs = Dk * Dv;
    const size_t es = is_bf16 ? 2 : 4;
    int failed = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        float* buf = malloc(sizeof(float) * TB * (2 * Dk + Dv + 2));
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t sh = 0; sh < nseq * Hv; sh++) {
            if (!buf) continue;
            const int64_t i = sh / Hv, h = sh % Hv, row = starts[i], first = split_starts[i];
            scan_head((const char*)x + row * conv_dim * es, (const char*)ab + row * 2 * Hv * es, A_log,
                      dt_bias, states[i] + h * hs, (char*)out + row * Hv * Dv * es, bounds + first, 0,
                      splits + first, split_starts[i + 1] - first, lens[i], lens[i], h, Hk, Hv, Dk, Dv,
                      scale, is_bf16, params_bf16, buf);
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
