/* Integer prefill GEMMs: int8 activations (quantized per row and block, hybridlm_quantize_rows) times
   int8 or int4 weights in their decode layouts, each block's sum exact in int32, the sum over blocks
   in float32 in block order. int4: y[m, n] = bf16(Σ_g s[n, g] · xs[m, g] · Σ_{k ∈ g} xq[m, k] q[n, k]
   + bias[n]); int8: see hybridlm_prefill_int8.

   The int4 weights are read in the decode kernels' layout (csrc/quant.c): panels of 16 rows, 32-bit words
   (b, n) holding q[n, 8b + s] + 8 in bits 4s .. 4s + 3. A word masked with 0x0f0f0f0f holds the
   unsigned nibbles of inputs 8b + 0, 2, 4, 6 in its four bytes, the word shifted right by 4 those of
   8b + 1, 3, 5, 7, so one vpdpbusd (unsigned bytes × signed bytes, four products summed into each
   int32 lane) multiplies 16 rows of the panel with four activations broadcast, once the activations
   of every 8-block are stored in that order (even inputs, then odd). The nibbles are q + 8, so each
   group's sum is corrected by 8 · Σ_{k ∈ g} xq[m, k].

   Integer sums do not depend on their order, and every output's float32 sum over groups runs in the
   same order whatever rows share a tile, so a row's result never depends on the rows beside it. */
#include "bf16.h"
#include <float.h>
/* Activation passes (quantizing, reordering, block sums) go parallel from this many elements: a decode
   row's pass takes a microsecond, less than waking the team (an int4 MoE decode step spent 13 % of its
   time in the one-row quantization's parallel region). */
#define ROWS_PARALLEL 65536
#include <math.h>
#include <stdlib.h>
#ifdef __AVX512F__
#include <immintrin.h>

/* 16 bf16 values as float32 (bf16 is the upper half of a float32). */
static inline __m512 widen(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#elif defined(__AVX2__)
#include <immintrin.h>
/* 8 bf16 values as float32. */
static inline __m256 widen8x(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#endif

/* x [M, K] bf16 -> xq [M, K] int8, xs [M, K / B] float32: per row and block of B inputs xs = max|x| / 127
   (the smallest normal float32 for an all-zero block), xq = round(x / xs) half to even, as
   quant_gemm.quantize_activations computes it in torch. */
void hybridlm_quantize_rows(const uint16_t* x, int64_t M, int64_t K, int64_t B, int8_t* xq, float* xs,
                            int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (M * K >= ROWS_PARALLEL)
    for (int64_t m = 0; m < M; m++)
        for (int64_t b0 = 0; b0 < K; b0 += B) {
            const uint16_t* src = x + m * K + b0;
            int8_t* dst = xq + m * K + b0;
            int64_t k = 0;
            float peak = 0.f;
#ifdef __AVX512F__
            __m512 vpeak = _mm512_setzero_ps();
            for (; k + 16 <= B; k += 16) vpeak = _mm512_max_ps(vpeak, _mm512_abs_ps(widen(src + k)));
            peak = _mm512_reduce_max_ps(vpeak);
#elif defined(__AVX2__)
            const __m256 sign = _mm256_set1_ps(-0.f);
            __m256 vpeak = _mm256_setzero_ps();
            for (; k + 8 <= B; k += 8) vpeak = _mm256_max_ps(vpeak, _mm256_andnot_ps(sign, widen8x(src + k)));
            __m128 half = _mm_max_ps(_mm256_castps256_ps128(vpeak), _mm256_extractf128_ps(vpeak, 1));
            half = _mm_max_ps(half, _mm_movehl_ps(half, half));
            peak = _mm_cvtss_f32(_mm_max_ss(half, _mm_shuffle_ps(half, half, 1)));
#endif
            /* a compare, not fmaxf: GCC 12's aarch64 vectorizer crashes on the fmaxf reduction */
            for (; k < B; k++) {
                const float v = fabsf(bf16_to_f32(src[k]));
                peak = v > peak ? v : peak;
            }
            const float scale = fmaxf(peak / 127.f, FLT_MIN);
            k = 0;
#ifdef __AVX512F__
            const __m512 vs = _mm512_set1_ps(scale);
            for (; k + 16 <= B; k += 16) {
                const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(widen(src + k), vs),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                _mm_storeu_si128((__m128i*)(dst + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(r)));
            }
#elif defined(__AVX2__)
            const __m256 vs = _mm256_set1_ps(scale), top = _mm256_set1_ps(127.f), bottom = _mm256_set1_ps(-127.f);
            for (; k + 8 <= B; k += 8) {
                const __m256 r = _mm256_round_ps(_mm256_div_ps(widen8x(src + k), vs),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                const __m256i q = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, bottom), top));
                const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
                _mm_storel_epi64((__m128i*)(dst + k), _mm_packs_epi16(w, w));
            }
#endif
            for (; k < B; k++) dst[k] = (int8_t)fminf(fmaxf(nearbyintf(bf16_to_f32(src[k]) / scale), -127.f), 127.f);
            xs[m * (K / B) + b0 / B] = scale;
        }
}

/* For the int4 kernels: each row's activations xq [M, K] reordered per 8-block as inputs 0, 2, 4, 6, then
   1, 3, 5, 7 (the order of a word's low and high nibbles) into xr, and their sums per group of G into
   xsum [M, K / G] (the correction for the nibbles' + 8). */
static __attribute__((unused)) void reorder_activations(const int8_t* xq, int64_t M, int64_t K, int64_t G,
                                                        int8_t* xr, int32_t* xsum, int nthreads) {
    const int64_t groups = K / G;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (M * K >= ROWS_PARALLEL)
    for (int64_t m = 0; m < M; m++) {
        const int8_t* src = xq + m * K;
        int8_t* dst = xr + m * K;
        for (int64_t b = 0; b < K / 8; b++)
            for (int s = 0; s < 4; s++) {
                dst[8 * b + s] = src[8 * b + 2 * s];
                dst[8 * b + 4 + s] = src[8 * b + 2 * s + 1];
            }
        for (int64_t g = 0; g < groups; g++) {
            int32_t t = 0;
            for (int64_t k = g * G; k < (g + 1) * G; k++) t += src[k];
            xsum[m * groups + g] = t;
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#include <omp.h>

#define MT 12 /* input rows a tile multiplies with one panel: 12 int32 + 12 float32 sums in registers */

/* The 16 scales of a panel's group as float32 (bf16 is the upper half of a float32; fp16 converts
   exactly); `lanes` masks the load for a short last panel. */
static inline __m512 group_scales(const uint16_t* s, int fp16, __mmask16 lanes) {
    const __m256i v = _mm256_maskz_loadu_epi16(lanes, s);
    return fp16 ? _mm512_cvtph_ps(v) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* acc[c] (16 outputs of one panel, float32) for input rows c < mt: xr the rows' reordered int8
   activations (K bytes each), xsum their per-group sums, xs their per-group scales. */
static inline __attribute__((always_inline)) void tile(const int8_t* xr, const int32_t* xsum, const float* xs,
                                                       int64_t K, int64_t G, int mt, const uint32_t* w,
                                                       const uint16_t* scales, int fp16, int64_t width,
                                                       __mmask16 lanes, __m512 acc[MT]) {
    const __m512i low = _mm512_set1_epi32(0x0f0f0f0f);
    const int64_t groups = K / G, blocks = G / 8;
    for (int c = 0; c < mt; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i sum[MT];
        for (int c = 0; c < mt; c++) sum[c] = _mm512_setzero_si512();
        for (int64_t b = g * blocks; b < (g + 1) * blocks; b++) {
            const __m512i raw = _mm512_maskz_loadu_epi32(lanes, w + b * width);
            const __m512i even = _mm512_and_si512(raw, low), odd = _mm512_and_si512(_mm512_srli_epi32(raw, 4), low);
            for (int c = 0; c < mt; c++) {
                const int32_t* x4 = (const int32_t*)(xr + c * K + b * 8);
                sum[c] = _mm512_dpbusd_epi32(sum[c], even, _mm512_set1_epi32(x4[0]));
                sum[c] = _mm512_dpbusd_epi32(sum[c], odd, _mm512_set1_epi32(x4[1]));
            }
        }
        const __m512 sv = group_scales(scales + g * width, fp16, lanes);
        for (int c = 0; c < mt; c++) {
            const __m512i exact = _mm512_sub_epi32(sum[c], _mm512_set1_epi32(8 * xsum[c * groups + g]));
            acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(sv, _mm512_set1_ps(xs[c * groups + g])),
                                     acc[c]);
        }
    }
}

/* xq [M, K] int8, xs [M, K / G] float32 (the activations' scales), q [N, K / 2] packed int4 in panels,
   scales [N, K / G] bf16 (fp16 != 0: fp16) in panel order, bias [N] bf16 or NULL, y [M, N] bf16;
   K % G == 0, G % 8 == 0. Returns 0, -1 (out of memory). */
int hybridlm_prefill_int4(const int8_t* xq, const float* xs, int64_t M, const uint8_t* q, const uint16_t* scales,
                          int fp16, const uint16_t* bias, uint16_t* y, int64_t N, int64_t K, int64_t G,
                          int nthreads) {
    const int64_t groups = K / G;
    int8_t* xr = malloc((size_t)(M * K));
    int32_t* xsum = malloc((size_t)(M * groups) * sizeof(int32_t));
    if (!xr || !xsum) { free(xr); free(xsum); return -1; }
    reorder_activations(xq, M, K, G, xr, xsum, nthreads);
    const int64_t panels = (N + 15) / 16;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t n0 = p * 16, width = N - n0 < 16 ? N - n0 : 16;
        const __mmask16 lanes = (__mmask16)((1u << width) - 1);
        const uint32_t* w = (const uint32_t*)(q + n0 * (K / 2));
        const uint16_t* s = scales + n0 * groups;
        __m512 bv = _mm512_setzero_ps();
        if (bias) bv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, bias + n0)), 16));
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            const int mt = M - m0 < MT ? (int)(M - m0) : MT;
            __m512 acc[MT];
            const int8_t* xm = xr + m0 * K;
            const int32_t* sm = xsum + m0 * groups;
            const float* fm = xs + m0 * groups;
            /* a constant row count per call site, so the tile's loops unroll into registers */
            if (mt == MT) tile(xm, sm, fm, K, G, MT, w, s, fp16, width, lanes, acc);
            else tile(xm, sm, fm, K, G, mt, w, s, fp16, width, lanes, acc);
            for (int c = 0; c < mt; c++)
                _mm256_mask_storeu_epi16(y + (m0 + c) * N + n0, lanes,
                                         (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[c], bv)));
        }
    }
    free(xr);
    free(xsum);
    return 0;
}

/* int8 weights: acc[c] (16 outputs of one panel, float32, before the weight scales) for input rows c <
   mt. wp holds the panel's weights as words (k / 4, n): bytes q[n, k .. k + 3] + 128 (unsigned), 16
   words a step; x the rows' int8 activations (K bytes each), xsum / xs their per-block sums and
   scales (blocks of B inputs). */
static inline __attribute__((always_inline)) void tile8(const int8_t* x, const int32_t* xsum, const float* xs,
                                                        int64_t K, int64_t B, int mt, const uint32_t* wp,
                                                        __m512 acc[MT]) {
    const int64_t blocks = K / B;
    for (int c = 0; c < mt; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < blocks; g++) {
        __m512i sum[MT];
        for (int c = 0; c < mt; c++) sum[c] = _mm512_setzero_si512();
        for (int64_t k4 = g * B / 4; k4 < (g + 1) * B / 4; k4++) {
            const __m512i wv = _mm512_load_si512(wp + k4 * 16);
            for (int c = 0; c < mt; c++)
                sum[c] = _mm512_dpbusd_epi32(sum[c], wv, _mm512_set1_epi32(((const int32_t*)(x + c * K))[k4]));
        }
        for (int c = 0; c < mt; c++) {
            const __m512i exact = _mm512_sub_epi32(sum[c], _mm512_set1_epi32(128 * xsum[c * blocks + g]));
            acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(xs[c * blocks + g]), acc[c]);
        }
    }
}

/* xq [M, K] int8, xs [M, K / B] float32 (the activations' scales per block of B inputs), q [N, K] int8
   (row-major, the decode layout), ws [N] float32, bias [N] bf16 or NULL, y [M, N] bf16:
   y[m, n] = bf16(ws[n] · Σ_b xs[m, b] · Σ_{k ∈ b} xq[m, k] q[n, k] + bias[n]); B % 4 == 0, K % B == 0.
   Each panel of 16 weight rows is first copied into words of four inputs (+128: vpdpbusd multiplies
   unsigned by signed bytes, so each block's sum is corrected by 128 · Σ xq). Returns 0, -1 (out of
   memory). */
int hybridlm_prefill_int8(const int8_t* xq, const float* xs, int64_t M, const int8_t* q, const float* ws,
                          const uint16_t* bias, uint16_t* y, int64_t N, int64_t K, int64_t B, int nthreads) {
    const int64_t blocks = K / B, panels = (N + 15) / 16;
    int32_t* xsum = malloc((size_t)(M * blocks) * sizeof(int32_t));
    uint32_t* packed = aligned_alloc(64, (size_t)(nthreads * K / 4 * 16) * sizeof(uint32_t));
    if (!xsum || !packed) { free(xsum); free(packed); return -1; }
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (M * K >= ROWS_PARALLEL)
    for (int64_t i = 0; i < M * blocks; i++) {
        int32_t t = 0;
        for (int64_t k = i * B; k < (i + 1) * B; k++) t += xq[k];  /* row i / blocks, block i % blocks */
        xsum[i] = t;
    }
    #pragma omp parallel num_threads(nthreads)
    {
        uint32_t* wp = packed + (int64_t)omp_get_thread_num() * (K / 4 * 16);
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int64_t n0 = p * 16, width = N - n0 < 16 ? N - n0 : 16;
            const __mmask16 lanes = (__mmask16)((1u << width) - 1);
            memset(wp, 0, (size_t)(K / 4 * 16) * sizeof(uint32_t));
            for (int64_t i = 0; i < width; i++) {
                const uint32_t* row = (const uint32_t*)(q + (n0 + i) * K);
                for (int64_t k4 = 0; k4 < K / 4; k4++) {
                    uint32_t v;
                    memcpy(&v, row + k4, 4);
                    wp[k4 * 16 + i] = v ^ 0x80808080u;  /* each signed byte + 128 */
                }
            }
            const __m512 wsv = _mm512_maskz_loadu_ps(lanes, ws + n0);
            __m512 bv = _mm512_setzero_ps();
            if (bias)
                bv = _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, bias + n0)), 16));
            for (int64_t m0 = 0; m0 < M; m0 += MT) {
                const int mt = M - m0 < MT ? (int)(M - m0) : MT;
                __m512 acc[MT];
                /* a constant row count per call site, so the tile's loops unroll into registers */
                if (mt == MT) tile8(xq + m0 * K, xsum + m0 * blocks, xs + m0 * blocks, K, B, MT, wp, acc);
                else tile8(xq + m0 * K, xsum + m0 * blocks, xs + m0 * blocks, K, B, mt, wp, acc);
                for (int c = 0; c < mt; c++)
                    _mm256_mask_storeu_epi16(y + (m0 + c) * N + n0, lanes,
                                             (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(acc[c], wsv, bv)));
            }
        }
    }
    free(xsum);
    free(packed);
    return 0;
}

/* See the AVX2 hybridlm_prefill_int4_grouped; here one product after another (int4 decode rows keep
   quant.c's float tiles on AVX-512, so only prompt chunks get here). */
int hybridlm_prefill_int4_grouped(const int8_t* const* xqs, const float* const* xss, const int64_t* ms,
                                  const uint8_t* const* qs, const uint16_t* const* scaless, int fp16,
                                  uint16_t* const* ys, int64_t P, int64_t N, int64_t K, int64_t G, int nthreads) {
    for (int64_t p = 0; p < P; p++)
        if (hybridlm_prefill_int4(xqs[p], xss[p], ms[p], qs[p], scaless[p], fp16, NULL, ys[p], N, K, G, nthreads))
            return -1;
    return 0;
}

int64_t hybridlm_prefill_available(void) { return 1; }
/* AVX-512: int4 decode rows keep quant.c's float tiles (16-wide, measured there). */
int64_t hybridlm_prefill_int4_decode(void) { return 0; }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* AVX2: the same sums with vpmaddubsw (unsigned bytes × signed bytes, adjacent pairs summed into int16,
   saturating) and vpmaddwd against ones (pairs of int16 into int32), a lane per output row, 8 rows (half
   a panel) a vector. int4: nibbles (q + 8 ≤ 15) times activations (|xq| ≤ 127) sum to at most 3810 a pair,
   so the even and odd products of a block add in int16 before widening. int8: a pair of full bytes could
   reach 2 · 255 · 127 and saturate, so each product is |q| · (xq with q's sign) (vpsignb), both ≤ 127.
   The float32 steps after the exact integer sums are the AVX-512 path's, so both give the same bits. */
#include <immintrin.h>
#include <omp.h>

#define MT 6 /* input rows a tile multiplies with half a panel: 6 int32 + 6 float32 sums in registers */

/* 8 bf16 / fp16 values (n < 8 of them, zeros beyond) as float32. */
static inline __m256 widen8(const uint16_t* p, int64_t n, int fp16) {
    uint16_t buf[8] = {0};
    if (n < 8) memcpy(buf, p, (size_t)n * sizeof(uint16_t));
    const __m128i v = _mm_loadu_si128((const __m128i*)(n < 8 ? buf : p));
    return fp16 ? _mm256_cvtph_ps(v) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

/* The first n (≤ 8) lanes of v rounded to bf16 (to nearest even, as f32_to_bf16) into y. */
static inline void store_bf16(uint16_t* y, __m256 v, int64_t n) {
    float f[8];
    _mm256_storeu_ps(f, v);
    for (int64_t i = 0; i < n; i++) y[i] = f32_to_bf16(f[i]);
}

/* Lanes below `width` of 8 words at w (the rest zero). */
static inline __m256i load_words(const uint32_t* w, int64_t width) {
    if (width >= 8) return _mm256_loadu_si256((const __m256i*)w);
    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)width), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_maskload_epi32((const int*)w, lanes);
}

/* int4, half a panel: acc[c] (8 outputs, float32) for input rows c < mt; w the panel's words (stride
   `stride` words a block), `width` lanes valid. */
static inline __attribute__((always_inline)) void tile(const int8_t* xr, const int32_t* xsum, const float* xs,
                                                       int64_t K, int64_t G, int mt, const uint32_t* w,
                                                       int64_t stride, const uint16_t* scales, int64_t sstride,
                                                       int fp16, int64_t width, __m256 acc[MT]) {
    const __m256i low = _mm256_set1_epi32(0x0f0f0f0f), ones = _mm256_set1_epi16(1);
    const int64_t groups = K / G, blocks = G / 8;
    for (int c = 0; c < mt; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i sum[MT];
        for (int c = 0; c < mt; c++) sum[c] = _mm256_setzero_si256();
        for (int64_t b = g * blocks; b < (g + 1) * blocks; b++) {
            const __m256i raw = load_words(w + b * stride, width);
            const __m256i even = _mm256_and_si256(raw, low), odd = _mm256_and_si256(_mm256_srli_epi32(raw, 4), low);
            for (int c = 0; c < mt; c++) {
                const int32_t* x4 = (const int32_t*)(xr + c * K + b * 8);
                const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(even, _mm256_set1_epi32(x4[0])),
                                                   _mm256_maddubs_epi16(odd, _mm256_set1_epi32(x4[1])));
                sum[c] = _mm256_add_epi32(sum[c], _mm256_madd_epi16(p, ones));
            }
        }
        const __m256 sv = widen8(scales + g * sstride, width, fp16);
        for (int c = 0; c < mt; c++) {
            const __m256i exact = _mm256_sub_epi32(sum[c], _mm256_set1_epi32(8 * xsum[c * groups + g]));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_mul_ps(sv, _mm256_set1_ps(xs[c * groups + g])),
                                     acc[c]);
        }
    }
}

/* Half panel hp (8 weight rows) of one int4 product against its M input rows (xr, xsum: the rows'
   reordered activations and group sums). */
static void int4_half_panel(const int8_t* xr, const int32_t* xsum, const float* xs, int64_t M, const uint8_t* q,
                            const uint16_t* scales, int fp16, const uint16_t* bias, uint16_t* y, int64_t N,
                            int64_t K, int64_t G, int64_t hp) {
    const int64_t groups = K / G;
    const int64_t n0 = hp / 2 * 16, pw = N - n0 < 16 ? N - n0 : 16, h = hp % 2;
    const int64_t width = pw - 8 * h;
    if (width <= 0) return;
    const uint32_t* w = (const uint32_t*)(q + n0 * (K / 2)) + 8 * h;
    const uint16_t* s = scales + n0 * groups + 8 * h;
    const __m256 bv = bias ? widen8(bias + n0 + 8 * h, width, 0) : _mm256_setzero_ps();
    for (int64_t m0 = 0; m0 < M; m0 += MT) {
        const int mt = M - m0 < MT ? (int)(M - m0) : MT;
        __m256 acc[MT];
        const int8_t* xm = xr + m0 * K;
        const int32_t* sm = xsum + m0 * groups;
        const float* fm = xs + m0 * groups;
        /* a constant row count per call site, so the tile's loops unroll into registers (with a
           variable count the sums live on the stack: decode's one row ran 4x slower) */
#define TILE(rows) tile(xm, sm, fm, K, G, rows, w, pw, s, pw, fp16, width, acc)
        switch (mt) { case 1: TILE(1); break; case 2: TILE(2); break; case 3: TILE(3); break;
                      case 4: TILE(4); break; case 5: TILE(5); break; default: TILE(MT); }
#undef TILE
        for (int c = 0; c < mt; c++)
            store_bf16(y + (m0 + c) * N + n0 + 8 * h, _mm256_add_ps(acc[c], bv), width < 8 ? width : 8);
    }
}

/* See the AVX-512 hybridlm_prefill_int4. */
int hybridlm_prefill_int4(const int8_t* xq, const float* xs, int64_t M, const uint8_t* q, const uint16_t* scales,
                          int fp16, const uint16_t* bias, uint16_t* y, int64_t N, int64_t K, int64_t G,
                          int nthreads) {
    int8_t* xr = malloc((size_t)(M * K));
    int32_t* xsum = malloc((size_t)(M * (K / G)) * sizeof(int32_t));
    if (!xr || !xsum) { free(xr); free(xsum); return -1; }
    reorder_activations(xq, M, K, G, xr, xsum, nthreads);
    const int64_t halves = (N + 7) / 8;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t hp = 0; hp < halves; hp++) int4_half_panel(xr, xsum, xs, M, q, scales, fp16, bias, y, N, K, G, hp);
    free(xr);
    free(xsum);
    return 0;
}

/* P int4 products of one shape in one parallel region (a token's routed experts: each small product's
   own region cost more than its reads): for p < P, ys[p] [ms[p], N] = what hybridlm_prefill_int4
   computes for xqs[p], xss[p], ms[p], qs[p], scaless[p], no bias; the same bits. */
int hybridlm_prefill_int4_grouped(const int8_t* const* xqs, const float* const* xss, const int64_t* ms,
                                  const uint8_t* const* qs, const uint16_t* const* scaless, int fp16,
                                  uint16_t* const* ys, int64_t P, int64_t N, int64_t K, int64_t G, int nthreads) {
    const int64_t groups = K / G, halves = (N + 7) / 8;
    int64_t rows = 0;
    for (int64_t p = 0; p < P; p++) rows += ms[p];
    int8_t* xr = malloc((size_t)(rows * K));
    int32_t* xsum = malloc((size_t)(rows * groups) * sizeof(int32_t));
    int64_t* first = malloc((size_t)P * sizeof(int64_t));
    if (!xr || !xsum || !first) { free(xr); free(xsum); free(first); return -1; }
    for (int64_t p = 0, at = 0; p < P; at += ms[p], p++) {
        first[p] = at;
        reorder_activations(xqs[p], ms[p], K, G, xr + at * K, xsum + at * groups, nthreads);
    }
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < P * halves; i++) {
        const int64_t p = i / halves;
        int4_half_panel(xr + first[p] * K, xsum + first[p] * groups, xss[p], ms[p], qs[p], scaless[p], fp16, NULL,
                        ys[p], N, K, G, i % halves);
    }
    free(xr);
    free(xsum);
    free(first);
    return 0;
}

/* int8, 8 weight rows: acc[c] (float32, before the weight scales) for input rows c < mt; wp the rows'
   weights as words (k / 4, n), 8 words a step, and aw their absolute values. */
static inline __attribute__((always_inline)) void tile8(const int8_t* x, const float* xs, int64_t K, int64_t B,
                                                        int mt, const uint32_t* wp, const uint32_t* aw,
                                                        __m256 acc[MT]) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t blocks = K / B;
    for (int c = 0; c < mt; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t g = 0; g < blocks; g++) {
        __m256i sum[MT];
        for (int c = 0; c < mt; c++) sum[c] = _mm256_setzero_si256();
        for (int64_t k4 = g * B / 4; k4 < (g + 1) * B / 4; k4++) {
            const __m256i wv = _mm256_load_si256((const __m256i*)(wp + k4 * 8));
            const __m256i av = _mm256_load_si256((const __m256i*)(aw + k4 * 8));
            for (int c = 0; c < mt; c++) {
                const __m256i xv = _mm256_sign_epi8(_mm256_set1_epi32(((const int32_t*)(x + c * K))[k4]), wv);
                sum[c] = _mm256_add_epi32(sum[c], _mm256_madd_epi16(_mm256_maddubs_epi16(av, xv), ones));
            }
        }
        for (int c = 0; c < mt; c++)
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[c]), _mm256_set1_ps(xs[c * blocks + g]), acc[c]);
    }
}

/* int8, few input rows (decode): NR weight rows read where they lie, row-major. tile8's per-call copy of a
   group's weights into words costs more than one or two rows' multiplications; here each row's 32-byte
   chunk meets the activations in place and a block's eight int32 lanes per row are added horizontally
   (still exact), so the float32 steps after them are tile8's, in the same order: the same bits. acc[c]
   holds outputs n0 .. n0 + NR of input row c in its low four lanes; rows ≥ nr repeat row 0, unstored. */
#define NR 4
static inline __attribute__((always_inline)) void rows8(const int8_t* x, const float* xs, int64_t K, int64_t B,
                                                        int mt, const int8_t* q, int64_t nr, __m256 acc[2]) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t blocks = K / B;
    const int8_t* w[NR];
    for (int r = 0; r < NR; r++) w[r] = q + (r < nr ? r : 0) * K;
    __m128 sums[2] = {_mm_setzero_ps(), _mm_setzero_ps()};
    for (int64_t g = 0; g < blocks; g++) {
        __m256i sum[2][NR];
        for (int c = 0; c < mt; c++)
            for (int r = 0; r < NR; r++) sum[c][r] = _mm256_setzero_si256();
        for (int64_t k = g * B; k < (g + 1) * B; k += 32) {
            __m256i xv[2];
            for (int c = 0; c < mt; c++) xv[c] = _mm256_loadu_si256((const __m256i*)(x + c * K + k));
            for (int r = 0; r < NR; r++) {
                const __m256i wv = _mm256_loadu_si256((const __m256i*)(w[r] + k)), av = _mm256_abs_epi8(wv);
                for (int c = 0; c < mt; c++)
                    sum[c][r] = _mm256_add_epi32(
                        sum[c][r], _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(xv[c], wv)), ones));
            }
        }
        for (int c = 0; c < mt; c++) {
            /* lanes (0..3 | 4..7) of rows 0..3 in each 128-bit half, then the halves added */
            const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(sum[c][0], sum[c][1]),
                                                _mm256_hadd_epi32(sum[c][2], sum[c][3]));
            const __m128i exact = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            sums[c] = _mm_fmadd_ps(_mm_cvtepi32_ps(exact), _mm_set1_ps(xs[c * blocks + g]), sums[c]);
        }
    }
    for (int c = 0; c < mt; c++) acc[c] = _mm256_zextps128_ps256(sums[c]);
}

/* hybridlm_prefill_int8 for M ≤ ROWS_MAX input rows and blocks of whole 32-byte chunks: rows8 over groups
   of NR weight rows, two input rows at a time (the group's weights stay in L1 between pairs). */
#define ROWS_MAX 8
static void int8_rows(const int8_t* xq, const float* xs, int64_t M, const int8_t* q, const float* ws,
                      const uint16_t* bias, uint16_t* y, int64_t N, int64_t K, int64_t B, int nthreads) {
    const int64_t blocks = K / B;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t p = 0; p < (N + NR - 1) / NR; p++) {
        const int64_t n0 = p * NR, nr = N - n0 < NR ? N - n0 : NR;
        float wsb[8] = {0};
        memcpy(wsb, ws + n0, (size_t)nr * sizeof(float));
        const __m256 wsv = _mm256_loadu_ps(wsb), bv = bias ? widen8(bias + n0, nr, 0) : _mm256_setzero_ps();
        for (int64_t m0 = 0; m0 < M; m0 += 2) {
            __m256 acc[2];
            if (M - m0 >= 2) rows8(xq + m0 * K, xs + m0 * blocks, K, B, 2, q + n0 * K, nr, acc);
            else rows8(xq + m0 * K, xs + m0 * blocks, K, B, 1, q + n0 * K, nr, acc);
            for (int c = 0; c < 2 && m0 + c < M; c++)
                store_bf16(y + (m0 + c) * N + n0, _mm256_fmadd_ps(acc[c], wsv, bv), nr);
        }
    }
}

/* See the AVX-512 hybridlm_prefill_int8. */
int hybridlm_prefill_int8(const int8_t* xq, const float* xs, int64_t M, const int8_t* q, const float* ws,
                          const uint16_t* bias, uint16_t* y, int64_t N, int64_t K, int64_t B, int nthreads) {
    if (M <= ROWS_MAX && B % 32 == 0) {
        int8_rows(xq, xs, M, q, ws, bias, y, N, K, B, nthreads);
        return 0;
    }
    const int64_t blocks = K / B, groups8 = (N + 7) / 8, words = K / 4 * 8;
    uint32_t* packed = aligned_alloc(32, (size_t)(2 * nthreads * words) * sizeof(uint32_t));
    if (!packed) return -1;
    #pragma omp parallel num_threads(nthreads)
    {
        uint32_t* wp = packed + (int64_t)omp_get_thread_num() * 2 * words;
        uint32_t* aw = wp + words;
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < groups8; p++) {
            const int64_t n0 = p * 8, width = N - n0 < 8 ? N - n0 : 8;
            memset(wp, 0, (size_t)(2 * words) * sizeof(uint32_t));
            for (int64_t i = 0; i < width; i++) {
                const uint32_t* row = (const uint32_t*)(q + (n0 + i) * K);
                for (int64_t k4 = 0; k4 < K / 4; k4++) memcpy(wp + k4 * 8 + i, row + k4, 4);
            }
            for (int64_t k4 = 0; k4 < K / 4; k4++) {
                const __m256i v = _mm256_load_si256((const __m256i*)(wp + k4 * 8));
                _mm256_store_si256((__m256i*)(aw + k4 * 8), _mm256_abs_epi8(v));
            }
            float wsb[8] = {0};
            memcpy(wsb, ws + n0, (size_t)width * sizeof(float));
            const __m256 wsv = _mm256_loadu_ps(wsb);
            const __m256 bv = bias ? widen8(bias + n0, width, 0) : _mm256_setzero_ps();
            for (int64_t m0 = 0; m0 < M; m0 += MT) {
                const int mt = M - m0 < MT ? (int)(M - m0) : MT;
                __m256 acc[MT];
                /* a constant row count per call site, so the tile's loops unroll into registers */
#define TILE8(rows) tile8(xq + m0 * K, xs + m0 * blocks, K, B, rows, wp, aw, acc)
                switch (mt) { case 1: TILE8(1); break; case 2: TILE8(2); break; case 3: TILE8(3); break;
                              case 4: TILE8(4); break; case 5: TILE8(5); break; default: TILE8(MT); }
#undef TILE8
                for (int c = 0; c < mt; c++)
                    store_bf16(y + (m0 + c) * N + n0, _mm256_fmadd_ps(acc[c], wsv, bv), width);
            }
        }
    }
    free(packed);
    return 0;
}

int64_t hybridlm_prefill_available(void) { return 1; }
/* AVX2: int4 decode rows take these kernels too. quant.c's 8-wide float tile spends ~6 instructions
   per 8 weights turning nibbles into floats (4-6 GB/s a core on Zen 3), one vpmaddubsw here multiplies
   32 (9-12 GB/s), and the activations' int8 rounding adds nothing to int4's own error (quant_gemm). */
int64_t hybridlm_prefill_int4_decode(void) { return 1; }
#else
/* Without AVX-512 VNNI or AVX2 the caller keeps its dequantized bf16 path. */
int hybridlm_prefill_int4(const int8_t* xq, const float* xs, int64_t M, const uint8_t* q, const uint16_t* scales,
                          int fp16, const uint16_t* bias, uint16_t* y, int64_t N, int64_t K, int64_t G,
                          int nthreads) {
    (void)xq; (void)xs; (void)M; (void)q; (void)scales; (void)fp16; (void)bias; (void)y; (void)N; (void)K;
    (void)G; (void)nthreads;
    return -1;
}

int hybridlm_prefill_int8(const int8_t* xq, const float* xs, int64_t M, const int8_t* q, const float* ws,
                          const uint16_t* bias, uint16_t* y, int64_t N, int64_t K, int64_t B, int nthreads) {
    (void)xq; (void)xs; (void)M; (void)q; (void)ws; (void)bias; (void)y; (void)N; (void)K; (void)B; (void)nthreads;
    return -1;
}

int hybridlm_prefill_int4_grouped(const int8_t* const* xqs, const float* const* xss, const int64_t* ms,
                                  const uint8_t* const* qs, const uint16_t* const* scaless, int fp16,
                                  uint16_t* const* ys, int64_t P, int64_t N, int64_t K, int64_t G, int nthreads) {
    (void)xqs; (void)xss; (void)ms; (void)qs; (void)scaless; (void)fp16; (void)ys; (void)P; (void)N; (void)K;
    (void)G; (void)nthreads;
    return -1;
}

int64_t hybridlm_prefill_available(void) { return 0; }
/* No integer kernels: nothing to decode with. */
int64_t hybridlm_prefill_int4_decode(void) { return 0; }
#endif
