/* y[m, n] = bf16(sum_k x[m, k] * w[n, k] + bias[n]) with x, w, bias, y bf16 and fp32 accumulation.
   Weight rows are processed in blocks of RB rows against up to MC input rows at a time, so each
   weight byte is loaded from memory once and reused from registers for every input row. bf16 is
   the upper half of fp32: a 32-bit load of two packed bf16 gives the even element as `u << 16`
   and the odd one as `u & 0xffff0000`. With AVX512-BF16, vdpbf16ps multiplies the pairs directly;
   elsewhere (AVX2, SSE, NEON: portable GCC vector code) x is pre-converted to fp32 with each block
   split into its even then odd elements, so the inner loop needs no shuffles. */
#include "bf16.h"
#include "combine.h"
#include <math.h>
#include <stdlib.h>
#define PREFETCH_BYTES 16384
/* 64-byte vectors passed between static functions without AVX-512 (two 32-byte halves): GCC warns
   that such a return changes the ABI, which matters only across a library's boundary. */
#pragma GCC diagnostic ignored "-Wpsabi"

#if defined(__AVX512BF16__)
/* 3 weight rows x 8 input rows: 24 independent vdpbf16ps chains, which the instruction needs to
   issue near its peak (measured 1.19 G/s a core with 12 chains, 1.39 G/s with 24), in 28 of the 32
   vector registers; 8 decode rows take one pass. Against 4 x 4 (two passes of 16 chains): the 8-row
   linears of a Qwen3.5-0.8B-shaped decode step 96 -> 82 ms, one row unchanged (29 GB/s); 6 x 4
   spilled (101 ms). The tile shape never changes a row's arithmetic. */
#define RB 3
#define BLK 32 /* unused here: x stays bf16 */
#define MC 8  /* input rows per pass; more rows take several passes over a block held in L1 */
#include <immintrin.h>
/* The same tile with vdpbf16ps: x stays bf16, each instruction multiplies 32 bf16 pairs and adds
   them (exactly: products of bf16 fit an fp32) into 16 fp32 sums, odd element then even. */
static inline __attribute__((always_inline)) void tile_dp(const uint16_t* x, int64_t K, int mc,
                                                          const uint16_t* w, int rb, float out[RB][MC]) {
    __m512 acc[RB][MC];
    for (int r = 0; r < rb; r++) for (int c = 0; c < mc; c++) acc[r][c] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh wv[RB];
        for (int r = 0; r < rb; r++) {
            __builtin_prefetch((const char*)(w + r * K + k) + PREFETCH_BYTES, 0, 1);
            wv[r] = (__m512bh)_mm512_loadu_si512(w + r * K + k);
        }
        for (int c = 0; c < mc; c++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + c * K + k);
            for (int r = 0; r < rb; r++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[r], xv);
        }
    }
    for (int r = 0; r < rb; r++) for (int c = 0; c < mc; c++) {
        float s = _mm512_reduce_add_ps(acc[r][c]);
        for (int64_t t = k; t < K; t++) s += bf16_to_f32(w[r * K + t]) * bf16_to_f32(x[c * K + t]);
        out[r][c] = s;
    }
}
#define TILE_DP(rows, cols) tile_dp(x, K, cols, w, rows, out)
static void tile_dp_any(const uint16_t* x, int64_t K, int mc, const uint16_t* w, int rb, float out[RB][MC]) {
    if (rb == RB) {
        switch (mc) { case 1: TILE_DP(RB, 1); break; case 2: TILE_DP(RB, 2); break;
                      case 3: TILE_DP(RB, 3); break; case 4: TILE_DP(RB, 4); break;
                      case 5: TILE_DP(RB, 5); break; case 6: TILE_DP(RB, 6); break;
                      case 7: TILE_DP(RB, 7); break; default: TILE_DP(RB, MC); }
        return;
    }
    for (int r = 0; r < rb; r++) {
        float row[RB][MC];
        const uint16_t* wr = w + r * K;
        switch (mc) { case 1: tile_dp(x, K, 1, wr, 1, row); break;
                      case 2: tile_dp(x, K, 2, wr, 1, row); break;
                      case 3: tile_dp(x, K, 3, wr, 1, row); break;
                      case 4: tile_dp(x, K, 4, wr, 1, row); break;
                      case 5: tile_dp(x, K, 5, wr, 1, row); break;
                      case 6: tile_dp(x, K, 6, wr, 1, row); break;
                      case 7: tile_dp(x, K, 7, wr, 1, row); break;
                      default: tile_dp(x, K, MC, wr, 1, row); }
        for (int c = 0; c < mc; c++) out[r][c] = row[0][c];
    }
}
#define TILE_ANY(x, xf, K, mc, w, rb, out) tile_dp_any(x, K, mc, w, rb, out)
#define X_AS_F32 0
#else
/* Without bf16 dot products: GCC vector extensions of 8 floats, one AVX2 register (two SSE or NEON
   registers). Each weight pair costs two fp32 FMAs per input row, so rows come in passes of MC over
   a block of RB weight rows that stays in L1, and the conversion of the weights is shared by a
   pass's rows. RB x MC = 12 accumulators leave 4 of AVX2's 16 registers for the weights' even / odd
   halves (x is read straight from L1 by the FMAs). x is pre-converted to fp32 with each 16-block
   split into its 8 even then 8 odd elements, so the inner loop needs no shuffles. A row's sums are
   the same instructions in the same order in every tile shape, so they never depend on the rows
   beside it. */
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
#define RB 4
#define MC 3  /* input rows per pass; more rows take several passes over a block held in L1 */
#define BLK 16 /* bf16 weights per step of a row: 8 u32 words */

static inline u32x8 load_u32x8(const void* p) { u32x8 v; memcpy(&v, p, sizeof v); return v; }
static inline f32x8 load_f32x8(const float* p) { f32x8 v; memcpy(&v, p, sizeof v); return v; }
static inline float hsum(f32x8 v) {
    f32x4 a, b; memcpy(&a, &v, 16); memcpy(&b, (char*)&v + 16, 16); a += b;
    return (a[0] + a[2]) + (a[1] + a[3]);
}

/* out[r][c] = dot(w row r, x row c) for r < rb, c < mc; inlined with constant rb, mc so the
   accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(const float* xf, int64_t K, int mc,
                                                       const uint16_t* w, int rb, float out[RB][MC]) {
    f32x8 acc[RB][MC];
    for (int r = 0; r < rb; r++) for (int c = 0; c < mc; c++) acc[r][c] = (f32x8){0};
    const u32x8 hi = (u32x8){0} + 0xffff0000u;
    int64_t k = 0;
    for (; k + BLK <= K; k += BLK) {
        for (int r = 0; r < rb; r++) {
            /* RB interleaved rows are RB short streams that the hardware prefetcher ramps up too
               late; fetching 16 KiB ahead lifts DRAM reads from ~22 to ~29 GB/s on 2 cores. */
            __builtin_prefetch((const char*)(w + r * K + k) + PREFETCH_BYTES, 0, 1);
            const u32x8 u = load_u32x8(w + r * K + k);
            const f32x8 even = (f32x8)(u << 16), odd = (f32x8)(u & hi);
            for (int c = 0; c < mc; c++) {
                acc[r][c] += even * load_f32x8(xf + c * K + k);
                acc[r][c] += odd * load_f32x8(xf + c * K + k + 8);
            }
        }
    }
    for (int r = 0; r < rb; r++) for (int c = 0; c < mc; c++) {
        float s = hsum(acc[r][c]);
        for (int64_t t = k; t < K; t++) s += bf16_to_f32(w[r * K + t]) * xf[c * K + t];
        out[r][c] = s;
    }
}

#define TILE(rows, cols) tile(xf, K, cols, w, rows, out)
static void tile_any(const float* xf, int64_t K, int mc, const uint16_t* w, int rb, float out[RB][MC]) {
    if (rb == RB) {
        switch (mc) { case 1: TILE(RB, 1); break; case 2: TILE(RB, 2); break; default: TILE(RB, MC); }
        return;
    }
    for (int r = 0; r < rb; r++) {  /* the last N % RB rows, one at a time */
        float row[RB][MC];
        const uint16_t* wr = w + r * K;
        switch (mc) { case 1: tile(xf, K, 1, wr, 1, row); break; case 2: tile(xf, K, 2, wr, 1, row); break;
                      default: tile(xf, K, MC, wr, 1, row); }
        for (int c = 0; c < mc; c++) out[r][c] = row[0][c];
    }
}
#define TILE_ANY(x, xf, K, mc, w, rb, out) tile_any(xf, K, mc, w, rb, out)
#define X_AS_F32 1
#endif

/* x [M, K] bf16 -> xf [M, K] float32, each BLK-block's even then odd elements (the tiles' order). */
static void to_f32(const uint16_t* x, int64_t M, int64_t K, float* xf) {
    const int64_t KB = K / BLK * BLK, half = BLK / 2;
    for (int64_t m = 0; m < M; m++) {
        const uint16_t* src = x + m * K;
        float* dst = xf + m * K;
        for (int64_t k = 0; k < KB; k += BLK)
            for (int i = 0; i < half; i++) {
                dst[k + i] = bf16_to_f32(src[k + 2 * i]);
                dst[k + half + i] = bf16_to_f32(src[k + 2 * i + 1]);
            }
        for (int64_t k = KB; k < K; k++) dst[k] = bf16_to_f32(src[k]);
    }
}

/* Weight rows [n0, n0 + RB) of one product: every input row against them, then bias and rounding. */
static void row_block(const uint16_t* x, const float* xf, int64_t M, const uint16_t* w, const uint16_t* bias,
                      uint16_t* y, int64_t N, int64_t K, int64_t n0) {
    (void)x; (void)xf;  /* each tile reads one of them: bf16 x (vdpbf16ps) or its float32 copy */
    const int rb = N - n0 < RB ? (int)(N - n0) : RB;
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const int mc = M - m0 < MC ? (int)(M - m0) : MC;
        float out[RB][MC];
        TILE_ANY(x + m0 * K, xf ? xf + m0 * K : NULL, K, mc, w + n0 * K, rb, out);
        for (int r = 0; r < rb; r++) {
            const float bv = bias ? bf16_to_f32(bias[n0 + r]) : 0.f;
            for (int c = 0; c < mc; c++) y[(m0 + c) * N + n0 + r] = f32_to_bf16(out[r][c] + bv);
        }
    }
}

/* x [M, K], w [N, K], bias [N] or NULL, y [M, N]; all bf16 and contiguous; M up to FEW_TOKENS (17)
   rows, more are accepted but the tiles are sized for decode and verify. Returns 0 or -1
   (out of memory). */
int hybridlm_linear_bf16(const uint16_t* x, int64_t M, const uint16_t* w, const uint16_t* bias,
                         uint16_t* y, int64_t N, int64_t K, int nthreads) {
    float* xf = NULL;
    if (X_AS_F32) {
        xf = malloc((size_t)(M * K) * sizeof(float));
        if (!xf) return -1;
        to_f32(x, M, K, xf);
    }
    const int64_t nblocks = (N + RB - 1) / RB;
    /* Below ~128 KiB of weights a second thread costs more to wake than it saves. */
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (N * K >= 65536)
    for (int64_t b = 0; b < nblocks; b++) row_block(x, xf, M, w, bias, y, N, K, b * RB);
    free(xf);
    return 0;
}

/* G independent products of one shape in one parallel region (a token's routed experts: their
   small matrices each cost a region's wake-up and barrier more than their reads): for g < G,
   y_g [M_g, N] = x_g [M_g, K] · w_gᵀ, no bias, every row block computed as hybridlm_linear_bf16
   computes it, so each y_g has its bits. xs, ws, ys: G pointers each; ms: G row counts.
   Returns 0 or -1 (out of memory). */
int hybridlm_linear_bf16_grouped(const uint16_t* const* xs, const int64_t* ms, const uint16_t* const* ws,
                                 uint16_t* const* ys, int64_t G, int64_t N, int64_t K, int nthreads) {
    int64_t rows = 0, first[G];  /* first[g]: product g's first element in xf */
    for (int64_t g = 0; g < G; g++) {
        first[g] = rows * K;
        rows += ms[g];
    }
    float* xf = NULL;
    if (X_AS_F32) {
        xf = malloc((size_t)(rows * K) * sizeof(float));
        if (!xf) return -1;
        for (int64_t g = 0; g < G; g++) to_f32(xs[g], ms[g], K, xf + first[g]);
    }
    const int64_t nblocks = (N + RB - 1) / RB;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (G * N * K >= 65536)
    for (int64_t i = 0; i < G * nblocks; i++) {
        const int64_t g = i / nblocks;
        row_block(xs[g], xf ? xf + first[g] : NULL, ms[g], ws[g], NULL, ys[g], N, K, i % nblocks * RB);
    }
    free(xf);
    return 0;
}

/* The routed experts of a few tokens in one parallel region, as hybridlm_moe_experts (quant.c) with bf16
   weights: expert p's first product over its rows xs[p] [ms[p], D] (w1[p] [N1, D]: gate rows then up
   rows when gated, N1 = 2·I, else N1 = I), the activation expert_hidden (bf16.h), the down product
   (w2[p] [D, I]), then the pairs' outputs added into their tokens' rows of out [n, D] (combine.h).
   Each product's row blocks are hybridlm_linear_bf16's, so a row has the bits of its own calls
   whatever else the call holds. Returns 0 or -1 (out of memory). */
int hybridlm_moe_experts_bf16(const uint16_t* const* xs, const int64_t* ms, int64_t P, const uint16_t* const* w1,
                              const uint16_t* const* w2, int gated, const void* w, int w_bf16,
                              const int64_t* w_at, const int64_t* tokens, int64_t late, uint16_t* out, int64_t n,
                              int64_t D, int64_t I, int nthreads) {
    const int64_t N1 = gated ? 2 * I : I, blocks1 = (N1 + RB - 1) / RB, blocks2 = (D + RB - 1) / RB;
    int64_t before[P + 1]; /* expert p's first row */
    before[0] = 0;
    for (int64_t p = 0; p < P; p++) before[p + 1] = before[p] + ms[p];
    const int64_t rows = before[P];
    uint16_t *y1 = malloc((size_t)(rows * N1) * 2), *h = malloc((size_t)(rows * I) * 2);
    uint16_t* ys = malloc((size_t)(rows * D) * 2);
    float *xf = X_AS_F32 ? malloc((size_t)(rows * D) * sizeof(float)) : NULL;
    float *hf = X_AS_F32 ? malloc((size_t)(rows * I) * sizeof(float)) : NULL;
    float* acc = calloc((size_t)(n * D), sizeof(float));
    if (!y1 || !h || !ys || !acc || (X_AS_F32 && (!xf || !hf))) {
        free(y1), free(h), free(ys), free(acc), free(xf), free(hf);
        return -1;
    }
    if (X_AS_F32)
        for (int64_t p = 0; p < P; p++) to_f32(xs[p], ms[p], D, xf + before[p] * D);
    #pragma omp parallel num_threads(nthreads) if (P * D * (N1 + I) >= 65536)
    {
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < P * blocks1; i++) {
            const int64_t p = i / blocks1;
            row_block(xs[p], xf ? xf + before[p] * D : NULL, ms[p], w1[p], NULL, y1 + before[p] * N1, N1, D,
                      i % blocks1 * RB);
        }
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t j = 0; j < I; j++) h[r * I + j] = f32_to_bf16(expert_hidden(y1 + r * N1, I, j, gated));
            if (X_AS_F32) to_f32(h + r * I, 1, I, hf + r * I);
        }
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < P * blocks2; i++) {
            const int64_t p = i / blocks2;
            row_block(h + before[p] * I, hf ? hf + before[p] * I : NULL, ms[p], w2[p], NULL, ys + before[p] * D, D,
                      I, i % blocks2 * RB);
        }
        #pragma omp for schedule(static)
        for (int64_t c0 = 0; c0 < D; c0 += COMBINE_COLUMNS)
            combine_columns(ys, w, w_bf16, w_at, tokens, rows, late, acc, out, n, D, c0,
                            c0 + COMBINE_COLUMNS < D ? c0 + COMBINE_COLUMNS : D);
    }
    free(y1), free(h), free(ys), free(acc), free(xf), free(hf);
    return 0;
}

/* The k largest of rank [E] (chosen [k], largest first, a tie to the lower index). */
static void top_k(const float* rank, int64_t E, int k, int64_t* chosen) {
    for (int j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= chosen[i] == e;
            if (!taken && (best < 0 || rank[e] > rank[best])) best = e;
        }
        chosen[j] = best;
    }
}

/* x · w over D bf16 values in float32: 16 lane sums added in a fixed tree, then the tail; the loop
   vectorizes and the sum depends only on the values (a float32-logit router's logits). */
static float dot_f32(const uint16_t* x, const uint16_t* w, int64_t D) {
    float part[16] = {0.f};
    int64_t i = 0;
    for (; i + 16 <= D; i += 16)
        for (int l = 0; l < 16; l++) part[l] += bf16_to_f32(x[i + l]) * bf16_to_f32(w[i + l]);
    for (int s = 8; s >= 1; s /= 2)
        for (int l = 0; l < s; l++) part[l] += part[l + s];
    float sum = part[0];
    for (; i < D; i++) sum += bf16_to_f32(x[i]) * bf16_to_f32(w[i]);
    return sum;
}

/* Group-limited selection: rank [E] in n_group consecutive groups, each rated by the sum of its two
   best ranks; the experts outside the topk_group best groups are ranked -inf. */
static void keep_groups(float* rank, int64_t E, int n_group, int topk_group) {
    const int64_t size = E / n_group;
    float rating[n_group];
    for (int g = 0; g < n_group; g++) {
        int64_t two[2];
        top_k(rank + g * size, size, 2, two);
        rating[g] = rank[g * size + two[0]] + rank[g * size + two[1]];
    }
    int64_t keep[topk_group];
    top_k(rating, n_group, topk_group, keep);
    for (int g = 0; g < n_group; g++) {
        int kept = 0;
        for (int i = 0; i < topk_group; i++) kept |= keep[i] == g;
        if (!kept)
            for (int64_t e = g * size; e < (g + 1) * size; e++) rank[e] = -INFINITY;
    }
}

/* A router's decode rows in one call (models.moe.Router on few rows): the logits x [M, D] · router [E, D]ᵀ,
   by hybridlm_linear_bf16's row blocks (its bits, rounded to bf16), or in float32 where `logits32` (the
   16-lane dot_f32); then per row either softmax in float32 and the top k probabilities, renormalised to
   sum to 1 when `normalize` (softmax_topk), or (`sigmoid`) sigmoid scores, the top k of scores + bias[E]
   (float32, or NULL) within the topk_group best of n_group groups (keep_groups; one group: all), their
   unbiased scores divided by their sum + eps when `normalize`, times `scaling` (sigmoid_topk). The exp
   is exp_fast. Writes index [M, width] int64 and weights [M, width] (bf16 when w_bf16, else float32),
   width = k, or k + 1 when shared_id >= 0: a shared expert as one more choice (id shared_id), weighted by
   its gate's scale, or 1 without a gate. gate [D] or NULL: the shared expert's gate row; scale [M] bf16
   then receives sigmoid(x · gate), the logit rounded to bf16 as the linear kernel rounds it and the
   sigmoid rounded to bf16 (torch's bf16 sigmoid, with exp_fast); without a gate row, scale is the
   caller's (a quantized gate's) or NULL (no gate). Each row is computed alone. Returns 0 or -1 (out of
   memory). */
int hybridlm_moe_route(const uint16_t* x, int64_t M, int64_t D, const uint16_t* router, int64_t E, int logits32,
                       const uint16_t* gate, int sigmoid, const float* bias, int n_group, int topk_group, int k,
                       int normalize, float scaling, float eps, int64_t shared_id, int w_bf16, void* weights,
                       int64_t* index, uint16_t* scale) {
    uint16_t* logits = malloc((size_t)(M * E + M) * 2);
    float* xf = X_AS_F32 ? malloc((size_t)(M * D) * sizeof(float)) : NULL;
    if (!logits || (X_AS_F32 && !xf)) {
        free(logits), free(xf);
        return -1;
    }
    if (X_AS_F32) to_f32(x, M, D, xf);
    if (!logits32)
        for (int64_t n0 = 0; n0 < E; n0 += RB) row_block(x, xf, M, router, NULL, logits, E, D, n0);
    uint16_t* gate_logits = logits + M * E;
    if (gate) row_block(x, xf, M, gate, NULL, gate_logits, 1, D, 0);
    const int64_t width = shared_id >= 0 ? k + 1 : k;
    for (int64_t m = 0; m < M; m++) {
        float l[E], score[E], rank[E];
        for (int64_t e = 0; e < E; e++)
            l[e] = logits32 ? dot_f32(x + m * D, router + e * D, D) : bf16_to_f32(logits[m * E + e]);
        if (sigmoid) {
            for (int64_t e = 0; e < E; e++) {
                score[e] = 1.f / (1.f + exp_fast(-l[e]));
                rank[e] = bias ? score[e] + bias[e] : score[e];
            }
            if (n_group > 1) keep_groups(rank, E, n_group, topk_group);
        } else {
            float top = l[0], sum = 0.f;
            for (int64_t e = 1; e < E; e++) top = l[e] > top ? l[e] : top;
            for (int64_t e = 0; e < E; e++) sum += score[e] = exp_fast(l[e] - top);
            for (int64_t e = 0; e < E; e++) rank[e] = score[e] = score[e] / sum;
        }
        int64_t* chosen = index + m * width;
        top_k(rank, E, k, chosen);
        float w[k + 1], total = 0.f;
        for (int j = 0; j < k; j++) total += w[j] = score[chosen[j]];
        for (int j = 0; j < k; j++) {
            if (normalize) w[j] = sigmoid ? w[j] / (total + eps) : w[j] / total;
            w[j] *= scaling;
        }
        if (gate) scale[m] = f32_to_bf16(1.f / (1.f + exp_fast(-bf16_to_f32(gate_logits[m]))));
        if (shared_id >= 0) {
            chosen[k] = shared_id;
            w[k] = scale ? bf16_to_f32(scale[m]) : 1.f;
        }
        for (int64_t j = 0; j < width; j++) store(weights, m * width + j, w[j], w_bf16);
    }
    free(logits), free(xf);
    return 0;
}
