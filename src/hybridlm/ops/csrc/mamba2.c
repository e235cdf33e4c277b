/* The Mamba-2 step recurrence (ops/mamba2.py), every token in order, per (row, head) in one loop:
   the torch step form runs ~8 small ATen ops a token and layer. Each (row, head) reads its token's x,
   B, C straight from the conv output [L, x ‖ B ‖ C] and keeps its [P, N] float32 state in place.
   A token's arithmetic never depends on how many tokens the call holds or on the rows beside it, so
   decode steps, verify passes, recorded prefills and replays all give the same bits.

   A state row's update and its dot product with C run in vectors of the ISA's width with four
   accumulators (vector j of the row into accumulator j % 4), then the accumulators and the lanes
   are summed in a fixed order. Tokens run in blocks: a state row stays in registers while the
   block's tokens pass over it, and the block's sums of that row are reduced side by side (`hsums`).
   Token by token the same numbers cost 2x (Nemotron-H-shaped layer, AVX-512): the state went
   through L1 every token and each (token, row)'s lanes were summed in scalar adds through memory.
   A one-token call (a decode step) keeps that simpler form, with the shuffles' sum.
   The first form, one scalar chain per row, was slower still: 0.37 ms a token for a
   Nemotron-H-8B-shaped layer on 2 AVX2 cores. */
#include "bf16.h"
#include <math.h>
#include <string.h>

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * sizeof(float))));
static inline vf ldv(const float* p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void stv(float* p, vf v) { memcpy(p, &v, sizeof v); }

/* torch's softplus (threshold 20: above it, x itself) */
static inline float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int vi __attribute__((vector_size(VW * sizeof(int))));
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

/* One round of `hsums`: from a and b, each holding segments of 2w lanes (one row's partial sums
   each), the vector of their segments halved, lane i of a segment plus lane i + w: a's rows, then
   b's. LO / HI list the lanes of a ‖ b without, and with, bit w set. */
#define HALVE(a, b, LO, HI) (SHUFFLE(a, b, LO) + SHUFFLE(a, b, HI))
#if VW == 16
#define LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define LO4 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define HI4 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define LO2 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define HI2 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define LO1 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define HI1 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
#else
#define LO4 0, 1, 2, 3, 8, 9, 10, 11
#define HI4 4, 5, 6, 7, 12, 13, 14, 15
#define LO2 0, 1, 4, 5, 8, 9, 12, 13
#define HI2 2, 3, 6, 7, 10, 11, 14, 15
#define LO1 0, 2, 4, 6, 8, 10, 12, 14
#define HI1 1, 3, 5, 7, 9, 11, 13, 15
#endif

/* hsum of VW vectors at once, lane j of the result hsum(v[j]) bit for bit: each round adds the same
   lanes as hsum's, for every row side by side. Summed one by one, a row's 15 scalar adds through
   memory cost more than its state update (N = 128). v is overwritten. */
static inline vf hsums(vf* v) {
#if VW == 16
    for (int k = 0; k < 8; k++) v[k] = HALVE(v[2 * k], v[2 * k + 1], LO8, HI8);
#endif
    for (int k = 0; k < 4; k++) v[k] = HALVE(v[2 * k], v[2 * k + 1], LO4, HI4);
    for (int k = 0; k < 2; k++) v[k] = HALVE(v[2 * k], v[2 * k + 1], LO2, HI2);
    return HALVE(v[0], v[1], LO1, HI1);
}

/* Tokens a block, a multiple of VW (`hsums` reduces VW of a state row's sums at once). 8-float vectors
   with blocks of 8 tokens ran 1.3x slower than with 16 (per-row costs over fewer tokens); 32 tokens'
   B and C rows (32 KB at N = 128) no longer fit L1 beside the state row. */
#define TOKENS 16
#define SEGMENT 8 /* state vectors held in registers while a block's tokens pass over them */

/* The lanes of v summed pairwise, halving the width each round: lane 0 of `hsums` with v in every
   row, so a token's sum has the same bits in a block or alone. */
static inline float hsum(vf v) {
#if VW == 16
    v = HALVE(v, v, LO8, HI8);
#endif
    v = HALVE(v, v, LO4, HI4);
    v = HALVE(v, v, LO2, HI2);
    return HALVE(v, v, LO1, HI1)[0];
}

/* One state row s [N] (in place) through a block's nt tokens: token j's B and C rows bt / ct + j·N,
   its decay and x·Δ. Per token s = decay·s + xd·b, and into sums[j] the products with c over the row's
   whole vectors: vector v into accumulator v % 4, then (a0 + a1) + (a2 + a3). The tail (N % VW) is
   `row_tail`'s. Held in registers SEGMENT vectors at a time, the state is read and written once a
   block rather than once a token (a head's state is 32 KB at P = 64, N = 128: the size of L1). */
static inline void row_tokens(float* s, const float* bt, const float* ct, const float* decay, const float* xd,
                              int64_t nt, int64_t N, vf* sums) {
    const int64_t whole = N / VW;
    vf acc[TOKENS][4];
    int64_t v = 0;
    for (; v + SEGMENT <= whole; v += SEGMENT) {
        float* sv = s + v * VW;
        vf s0 = ldv(sv), s1 = ldv(sv + VW), s2 = ldv(sv + 2 * VW), s3 = ldv(sv + 3 * VW);
        vf s4 = ldv(sv + 4 * VW), s5 = ldv(sv + 5 * VW), s6 = ldv(sv + 6 * VW), s7 = ldv(sv + 7 * VW);
        for (int64_t j = 0; j < nt; j++) {
            const float* b = bt + j * N + v * VW;
            const float* c = ct + j * N + v * VW;
            const float d = decay[j], x = xd[j];
            vf a0 = (vf){0}, a1 = (vf){0}, a2 = (vf){0}, a3 = (vf){0};
            if (v) a0 = acc[j][0], a1 = acc[j][1], a2 = acc[j][2], a3 = acc[j][3];
#define UPDATE(sk, k, a)                        \
    do {                                        \
        sk = sk * d + x * ldv(b + (k) * VW);    \
        a += sk * ldv(c + (k) * VW);            \
    } while (0)
            UPDATE(s0, 0, a0); UPDATE(s1, 1, a1); UPDATE(s2, 2, a2); UPDATE(s3, 3, a3);
            UPDATE(s4, 4, a0); UPDATE(s5, 5, a1); UPDATE(s6, 6, a2); UPDATE(s7, 7, a3);
            acc[j][0] = a0, acc[j][1] = a1, acc[j][2] = a2, acc[j][3] = a3;
        }
        stv(sv, s0), stv(sv + VW, s1), stv(sv + 2 * VW, s2), stv(sv + 3 * VW, s3);
        stv(sv + 4 * VW, s4), stv(sv + 5 * VW, s5), stv(sv + 6 * VW, s6), stv(sv + 7 * VW, s7);
    }
    if (whole < SEGMENT)
        for (int64_t j = 0; j < nt; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = (vf){0};
    for (; v < whole; v++) {
        vf sk = ldv(s + v * VW);
        for (int64_t j = 0; j < nt; j++) {
            const float* b = bt + j * N, *c = ct + j * N;
            const float d = decay[j], x = xd[j];
            UPDATE(sk, v, acc[j][v % 4]);
        }
        stv(s + v * VW, sk);
    }
#undef UPDATE
    for (int64_t j = 0; j < nt; j++) sums[j] = (acc[j][0] + acc[j][1]) + (acc[j][2] + acc[j][3]);
}

/* row_tokens for one token (a decode step): the same arithmetic with the accumulators in registers,
   returned rather than stored (through row_tokens' arrays a decode step took 15 % longer). */
static inline vf row_step(float* s, const float* b, const float* c, float d, float x, int64_t N) {
    vf a0 = (vf){0}, a1 = (vf){0}, a2 = (vf){0}, a3 = (vf){0};
#define UPDATE(a, at)                                   \
    do {                                                \
        const vf sv = ldv(s + (at)) * d + x * ldv(b + (at)); \
        stv(s + (at), sv);                              \
        a += sv * ldv(c + (at));                        \
    } while (0)
    int64_t n = 0;
    for (; n + 4 * VW <= N; n += 4 * VW) {
        UPDATE(a0, n);
        UPDATE(a1, n + VW);
        UPDATE(a2, n + 2 * VW);
        UPDATE(a3, n + 3 * VW);
    }
    if (n + VW <= N) { UPDATE(a0, n); n += VW; }
    if (n + VW <= N) { UPDATE(a1, n); n += VW; }
    if (n + VW <= N) { UPDATE(a2, n); n += VW; }
#undef UPDATE
    return (a0 + a1) + (a2 + a3);
}

/* The rest of the row after its whole vectors (from n = N - N % VW), one by one onto total. */
static inline float row_tail(float* s, const float* b, const float* c, float decay, float xd, int64_t N,
                             float total) {
    for (int64_t n = N - N % VW; n < N; n++) {
        s[n] = s[n] * decay + xd * b[n];
        total += s[n] * c[n];
    }
    return total;
}

/* One (row, head): tokens [0, L) of x (the conv output of this row, [L, conv_dim]) and dt ([L, H]),
   the first `real` of them real (later ones are identity steps with zero output). s [P, N] is the
   state, advanced in place; after token t, for every split == t + 1, s is copied to
   bounds[i] + offset. y [L, H, P] float32. Tokens run in blocks of up to TOKENS that end at every
   split; a token's arithmetic is the same in any block, so a call cut anywhere has the same bits. */
static void scan_head(const char* x, const char* dt, float A, float bias, float D, float lo, float hi,
                      float* s, float* y, float** bounds, int64_t offset, const int64_t* splits,
                      int64_t nsplit, int64_t L, int64_t real, int64_t h, int64_t H, int64_t P,
                      int64_t G, int64_t N, int is_bf16) {
    const int64_t inner = H * P, g = h / (H / G), conv_dim = inner + 2 * G * N;
    const int64_t b0 = inner + g * N, c0 = inner + G * N + g * N;
    const size_t es = is_bf16 ? 2 : 4;
    float bt[TOKENS * N], ct[TOKENS * N]; /* the block's B and C of this head's group, as float32 */
    float delta[TOKENS], decay[TOKENS], xd[TOKENS];
    vf sums[TOKENS];
    for (int64_t i = 0; i < nsplit; i++)
        if (splits[i] == 0) memcpy(bounds[i] + offset, s, sizeof(float) * P * N);
    for (int64_t t0 = 0, nt; t0 < L; t0 += nt) {
        nt = (t0 < real ? real : L) - t0;
        if (nt > TOKENS) nt = TOKENS;
        for (int64_t i = 0; i < nsplit; i++)
            if (splits[i] > t0 && splits[i] - t0 < nt) nt = splits[i] - t0;
        if (t0 >= real) {
            for (int64_t j = 0; j < nt; j++) memset(y + ((t0 + j) * H + h) * P, 0, sizeof(float) * P);
        } else {
            const char* rows = x + t0 * conv_dim * es; /* the block's conv output rows */
            for (int64_t j = 0; j < nt; j++) {
                const char* row = rows + j * conv_dim * es;
                float dl = softplus(load(dt, (t0 + j) * H + h, is_bf16) + bias);
                delta[j] = dl < lo ? lo : (dl > hi ? hi : dl);
                decay[j] = expf(delta[j] * A);
                for (int64_t n = 0; n < N; n++) {
                    bt[j * N + n] = load(row, b0 + n, is_bf16);
                    ct[j * N + n] = load(row, c0 + n, is_bf16);
                }
            }
            for (int64_t p = 0; p < P; p++) {
                float* sp = s + p * N;
                if (nt == 1) { /* a decode step: through arrays, as below, it took 15 % longer */
                    const float xp = load(rows, h * P + p, is_bf16), xdp = xp * delta[0];
                    const float total = hsum(row_step(sp, bt, ct, decay[0], xdp, N));
                    y[(t0 * H + h) * P + p] = row_tail(sp, bt, ct, decay[0], xdp, N, total) + D * xp;
                    continue;
                }
                /* one loop: x loaded and scaled apart, GCC vectorizes the scaling, and a vector load
                   after scalar stores stalls on store forwarding (a sixth of the time) */
                for (int64_t j = 0; j < nt; j++)
                    xd[j] = load(rows + j * conv_dim * es, h * P + p, is_bf16) * delta[j];
                float total[TOKENS];
                row_tokens(sp, bt, ct, decay, xd, nt, N, sums);
                for (int64_t g = 0; g < nt; g += VW) { /* VW tokens' sums at a time, a few one by one */
                    const int64_t in = nt - g < VW ? nt - g : VW;
                    if (in > 2) {
                        for (int64_t j = in; j < VW; j++) sums[g + j] = (vf){0};
                        const vf reduced = hsums(sums + g);
                        memcpy(total + g, &reduced, sizeof reduced);
                    } else {
                        for (int64_t j = 0; j < in; j++) total[g + j] = hsum(sums[g + j]);
                    }
                }
                for (int64_t j = 0; j < nt; j++) {
                    const float xp = load(rows + j * conv_dim * es, h * P + p, is_bf16);
                    total[j] = row_tail(sp, bt + j * N, ct + j * N, decay[j], xd[j], N, total[j]);
                    y[((t0 + j) * H + h) * P + p] = total[j] + D * xp;
                }
            }
        }
        for (int64_t i = 0; i < nsplit; i++)
            if (splits[i] == t0 + nt) memcpy(bounds[i] + offset, s, sizeof(float) * P * N);
    }
}

/* xbc [B, L, H*P + 2*G*N] the conv output (bf16 or float32), dt [B, L, H] raw time steps (same
   dtype), A / dt_bias / D [H] float32, state [B, H, P, N] float32 advanced in place, y [B, L, H, P]
   float32; bounds[i] [B, H, P, N] float32 receives the state after splits[i] tokens; lens[b] real
   tokens of row b (NULL: all L). Parallel over rows x heads. */
void hybridlm_mamba2_scan(const void* xbc, const void* dt, const float* A, const float* dt_bias,
                          const float* D, float* state, float* y, float** bounds, const int64_t* splits,
                          int64_t nsplit, const int64_t* lens, int64_t B, int64_t L, int64_t H, int64_t P,
                          int64_t G, int64_t N, float lo, float hi, int is_bf16, int nthreads) {
    const int64_t conv_dim = H * P + 2 * G * N;
    const size_t es = is_bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t bh = 0; bh < B * H; bh++) {
        const int64_t b = bh / H, h = bh % H;
        const int64_t real = lens ? (lens[b] < L ? lens[b] : L) : L;
        scan_head((const char*)xbc + b * L * conv_dim * es, (const char*)dt + b * L * H * es, A[h],
                  dt_bias[h], D ? D[h] : 0.f, lo, hi, state + bh * P * N, y + b * L * H * P, bounds,
                  bh * P * N, splits, nsplit, L, real, h, H, P, G, N, is_bf16);
    }
}

/* Several sequences packed end to end (the decode and verify rows of many sequences) in one call,
   parallel over sequences x heads: sequence i's rows [starts[i], starts[i] + lens[i]) of xbc, dt and
   y (layouts as in hybridlm_mamba2_scan with B = 1), its own state states[i] [H, P, N] advanced in
   place, and its splits splits[split_starts[i] .. split_starts[i + 1]), after which the state goes to
   the matching bounds entries ([H, P, N] each). Each (sequence, head) runs scan_head as
   hybridlm_mamba2_scan runs it on that sequence alone: the same bits. */
void hybridlm_mamba2_scan_packed(const void* xbc, const void* dt, const float* A, const float* dt_bias,
                                 const float* D, float** states, float* y, float** bounds,
                                 const int64_t* splits, const int64_t* split_starts, const int64_t* starts,
                                 const int64_t* lens, int64_t nseq, int64_t H, int64_t P, int64_t G,
                                 int64_t N, float lo, float hi, int is_bf16, int nthreads) {
    const int64_t conv_dim = H * P + 2 * G * N;
    const size_t es = is_bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t sh = 0; sh < nseq * H; sh++) {
        const int64_t i = sh / H, h = sh % H, row = starts[i], first = split_starts[i];
        scan_head((const char*)xbc + row * conv_dim * es, (const char*)dt + row * H * es, A[h], dt_bias[h],
                  D ? D[h] : 0.f, lo, hi, states[i] + h * P * N, y + row * H * P, bounds + first, h * P * N,
                  splits + first, split_starts[i + 1] - first, lens[i], lens[i], h, H, P, G, N, is_bf16);
    }
}

/* The gated RMSNorm per group after the scan (models/mamba2.py: GroupedGatedRMSNorm), in float32:
   gate = silu(z); x = y·gate (before: norm_before_gate 0), each of G groups of the C channels
   x · rsqrt(mean(x²) + eps), then ·gate (norm_before_gate 1); out = bf16(w · x). y [rows, C] float32,
   z bf16 with row stride z_stride elements, w [C] bf16, out [rows, C] bf16. A group's sum of squares
   is `sum_squares` (bf16.h), so a row's numbers depend on that row alone. */
void hybridlm_mamba2_gated_norm(const float* y, const uint16_t* z, int64_t z_stride, const uint16_t* w,
                                uint16_t* out, int64_t rows, int64_t C, int64_t G, float eps,
                                int norm_before_gate, int nthreads) {
    const int64_t width = C / G;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * C >= (1 << 15))
    for (int64_t rg = 0; rg < rows * G; rg++) {
        const int64_t r = rg / G, c0 = (rg % G) * width;
        const float* yr = y + r * C + c0;
        const uint16_t* zr = z + r * z_stride + c0;
        uint16_t* o = out + r * C + c0;
        float x[width], gate[width];
        for (int64_t i = 0; i < width; i++) {
            const float g = bf16_to_f32(zr[i]);
            gate[i] = g / (1.f + exp_fast(-g));
            x[i] = norm_before_gate ? yr[i] : yr[i] * gate[i];
        }
        const float ss = sum_squares(x, 0, width, 0);
        const float scale = 1.f / sqrtf(ss / (float)width + eps);
        for (int64_t j = 0; j < width; j++) {
            float v = x[j] * scale;
            if (norm_before_gate) v *= gate[j];
            o[j] = f32_to_bf16(bf16_to_f32(w[c0 + j]) * v);
        }
    }
}
