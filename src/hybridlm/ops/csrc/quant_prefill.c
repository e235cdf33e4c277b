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
/* Weight bytes below which a product runs on one thread (waking a second costs more than it saves). */
#define MIN_PARALLEL_BYTES 65536
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

/* One row x [K] bf16 -> xq [K] int8, xs [K / B] float32: per block of B inputs xs = max|x| / 127 (the
   smallest normal float32 for an all-zero block), xq = round(x / xs) half to even, as
   quant_gemm.quantize_activations computes it in torch. hybridlm_quantize_rows: M rows [M, K]. */
static void quantize_row(const uint16_t* x, int64_t K, int64_t B, int8_t* xq, float* xs) {
        for (int64_t b0 = 0; b0 < K; b0 += B) {
            const uint16_t* src = x + b0;
            int8_t* dst = xq + b0;
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
            xs[b0 / B] = scale;
        }
}

void hybridlm_quantize_rows(const uint16_t* x, int64_t M, int64_t K, int64_t B, int8_t* xq, float* xs,
                            int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (M * K >= ROWS_PARALLEL)
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, B, xq + m * K, xs + m * (K / B));
}

/* For the int4 kernels: a row's activations xq [K] reordered per 8-block as inputs 0, 2, 4, 6, then 1, 3,
   5, 7 (the order of a word's low and high nibbles) into xr, and their sums per group of G into xsum
   [K / G] (the correction for the nibbles' + 8); reorder_activations: M rows. */
static __attribute__((unused)) void reorder_row(const int8_t* src, int64_t K, int64_t G, int8_t* dst,
                                                int32_t* xsum) {
    for (int64_t b = 0; b < K / 8; b++)
        for (int s = 0; s < 4; s++) {
            dst[8 * b + s] = src[8 * b + 2 * s];
            dst[8 * b + 4 + s] = src[8 * b + 2 * s + 1];
        }
    for (int64_t g = 0; g < K / G; g++) {
        int32_t t = 0;
        for (int64_t k = g * G; k < (g + 1) * G; k++) t += src[k];
        xsum[g] = t;
    }
}

static __attribute__((unused)) void reorder_activations(const int8_t* xq, int64_t M, int64_t K, int64_t G,
                                                        int8_t* xr, int32_t* xsum, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (M * K >= ROWS_PARALLEL)
    for (int64_t m = 0; m < M; m++) reorder_row(xq + m * K, K, G, xr + m * K, xsum + m * (K / G));
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

/* Few input rows (decode): NP panels a tile, one input row at a time. One row against one panel leaves a
   single chain of vpdpbusd (5 cycles each) per block; NP panels with their even and odd products summed
   apart are 2·NP chains: 512 x 1024 at 32 GB/s in L2 on one core against the one-panel tile's 22. The
   int32 sums are exact, so adding the even and odd sums at the group's end changes no bit, and the float32
   steps after them are `tile`'s: the same bits as a prompt row. */
#define FEW_ROWS 4
#define NP 4
#define PREFETCH_BYTES 4096
static inline __attribute__((always_inline)) void tile_panels(const int8_t* xr, const int32_t* xsum,
                                                              const float* xs, int64_t K, int64_t G, int np,
                                                              const uint32_t* w, const uint16_t* scales, int fp16,
                                                              __m512 acc[NP]) {
    const __m512i low = _mm512_set1_epi32(0x0f0f0f0f);
    const int64_t groups = K / G, blocks = G / 8, words = 16 * (K / 8), sstride = 16 * groups;
    for (int p = 0; p < np; p++) acc[p] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i even[NP], odd[NP];
        for (int p = 0; p < np; p++) even[p] = odd[p] = _mm512_setzero_si512();
        for (int64_t b = g * blocks; b < (g + 1) * blocks; b++) {
            const int32_t* x4 = (const int32_t*)(xr + b * 8);
            const __m512i x0 = _mm512_set1_epi32(x4[0]), x1 = _mm512_set1_epi32(x4[1]);
            for (int p = 0; p < np; p++) {
                /* each panel's stream PREFETCH_BYTES ahead: past the unit's last panel that is the thread's
                   next unit (schedule(static)), whose first panel follows in memory */
                _mm_prefetch((const char*)(w + p * words + b * 16) + PREFETCH_BYTES, _MM_HINT_T0);
                const __m512i raw = _mm512_loadu_si512(w + p * words + b * 16);
                even[p] = _mm512_dpbusd_epi32(even[p], _mm512_and_si512(raw, low), x0);
                odd[p] = _mm512_dpbusd_epi32(odd[p], _mm512_and_si512(_mm512_srli_epi32(raw, 4), low), x1);
            }
        }
        const __m512 xsv = _mm512_set1_ps(xs[g]);
        const __m512i correction = _mm512_set1_epi32(8 * xsum[g]);
        for (int p = 0; p < np; p++) {
            const __m512 sv = group_scales(scales + p * sstride + g * 16, fp16, 0xffff);
            const __m512i exact = _mm512_sub_epi32(_mm512_add_epi32(even[p], odd[p]), correction);
            acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(sv, xsv), acc[p]);
        }
    }
}

/* The units of work of an int4 product of M input rows against N weight rows: a panel each, or for few
   rows NP full panels each, the short last panel (N % 16 rows) a unit of its own. */
static inline int64_t int4_units(int64_t M, int64_t N) {
    return M <= FEW_ROWS ? (N / 16 + NP - 1) / NP + (N % 16 != 0) : (N + 15) / 16;
}

/* Unit u of an int4 product (int4_units) against its M input rows (xr, xsum: reordered activations and
   group sums; xs their scales), bias added, rounded into y [M, N]. */
static void int4_unit(const int8_t* xr, const int32_t* xsum, const float* xs, int64_t M, const uint8_t* q,
                      const uint16_t* scales, int fp16, const uint16_t* bias, uint16_t* y, int64_t N, int64_t K,
                      int64_t G, int64_t u) {
    const int64_t groups = K / G, full = N / 16;
    const int few = M <= FEW_ROWS, short_unit = N % 16 != 0 && u == int4_units(M, N) - 1;
    const int64_t p0 = short_unit ? full : few ? u * NP : u;
    const int np = short_unit || !few ? 1 : (full - p0 < NP ? (int)(full - p0) : NP);
    const int64_t n0 = p0 * 16, width = N - n0 < 16 ? N - n0 : 16;
    const __mmask16 lanes = (__mmask16)((1u << width) - 1);
    const uint32_t* w = (const uint32_t*)(q + n0 * (K / 2));
    const uint16_t* s = scales + n0 * groups;
    if (few && !short_unit) {
        for (int64_t m = 0; m < M; m++) {
            __m512 acc[NP];
            /* a constant panel count per call site, so the tile's loops unroll into registers */
            switch (np) {
                case 1: tile_panels(xr + m * K, xsum + m * groups, xs + m * groups, K, G, 1, w, s, fp16, acc); break;
                case 2: tile_panels(xr + m * K, xsum + m * groups, xs + m * groups, K, G, 2, w, s, fp16, acc); break;
                case 3: tile_panels(xr + m * K, xsum + m * groups, xs + m * groups, K, G, 3, w, s, fp16, acc); break;
                default: tile_panels(xr + m * K, xsum + m * groups, xs + m * groups, K, G, NP, w, s, fp16, acc);
            }
            for (int p = 0; p < np; p++) {
                __m512 bv = _mm512_setzero_ps();
                if (bias) bv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                   _mm256_loadu_si256((const __m256i*)(bias + n0 + 16 * p))), 16));
                _mm256_storeu_si256((__m256i*)(y + m * N + n0 + 16 * p), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[p], bv)));
            }
        }
        return;
    }
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
            _mm256_mask_storeu_epi16(y + (m0 + c) * N + n0, lanes, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[c], bv)));
    }
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

int64_t hybridlm_prefill_available(void) { return 1; }
#define INTEGER_KERNELS 1
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

/* The units of work of an int4 product: half panels of 8 weight rows. */
static inline int64_t int4_units(int64_t M, int64_t N) {
    (void)M;
    return (N + 7) / 8;
}

/* Half panel hp (8 weight rows, int4_units) of one int4 product against its M input rows (xr, xsum: the
   rows' reordered activations and group sums). */
static void int4_unit(const int8_t* xr, const int32_t* xsum, const float* xs, int64_t M, const uint8_t* q,
                      const uint16_t* scales, int fp16, const uint16_t* bias, uint16_t* y, int64_t N, int64_t K,
                      int64_t G, int64_t hp) {
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
#define INTEGER_KERNELS 1
#else
/* Without AVX-512 VNNI or AVX2 the caller keeps its dequantized bf16 path. */
int hybridlm_prefill_int8(const int8_t* xq, const float* xs, int64_t M, const int8_t* q, const float* ws,
                          const uint16_t* bias, uint16_t* y, int64_t N, int64_t K, int64_t B, int nthreads) {
    (void)xq; (void)xs; (void)M; (void)q; (void)ws; (void)bias; (void)y; (void)N; (void)K; (void)B; (void)nthreads;
    return -1;
}

int64_t hybridlm_prefill_available(void) { return 0; }
#endif

#ifdef INTEGER_KERNELS
#include "combine.h"

/* The product whose units of work [start[p], start[p + 1]) hold unit i (the grouped calls). */
static inline int64_t product_of(const int64_t* start, int64_t i) {
    int64_t p = 0;
    while (start[p + 1] <= i) p++;
    return p;
}

/* xq [M, K] int8, xs [M, K / G] float32 (the activations' scales), q [N, K / 2] packed int4 in panels,
   scales [N, K / G] bf16 (fp16 != 0: fp16) in panel order, bias [N] bf16 or NULL, y [M, N] bf16;
   K % G == 0, G % 8 == 0: this ISA's units (int4_units / int4_unit). Returns 0, -1 (out of memory). */
int hybridlm_prefill_int4(const int8_t* xq, const float* xs, int64_t M, const uint8_t* q, const uint16_t* scales,
                          int fp16, const uint16_t* bias, uint16_t* y, int64_t N, int64_t K, int64_t G,
                          int nthreads) {
    const int64_t groups = K / G;
    int8_t* xr = malloc((size_t)(M * K));
    int32_t* xsum = malloc((size_t)(M * groups) * sizeof(int32_t));
    if (!xr || !xsum) { free(xr); free(xsum); return -1; }
    reorder_activations(xq, M, K, G, xr, xsum, nthreads);
    const int64_t units = int4_units(M, N);
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (N * K / 2 >= MIN_PARALLEL_BYTES)
    for (int64_t u = 0; u < units; u++) int4_unit(xr, xsum, xs, M, q, scales, fp16, bias, y, N, K, G, u);
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
    const int64_t groups = K / G;
    int64_t rows = 0;
    for (int64_t p = 0; p < P; p++) rows += ms[p];
    int8_t* xr = malloc((size_t)(rows * K));
    int32_t* xsum = malloc((size_t)(rows * groups) * sizeof(int32_t));
    int64_t* first = malloc((size_t)(2 * P + 1) * sizeof(int64_t));
    if (!xr || !xsum || !first) { free(xr); free(xsum); free(first); return -1; }
    int64_t* start = first + P;
    start[0] = 0;
    for (int64_t p = 0, at = 0; p < P; at += ms[p], p++) {
        first[p] = at;
        start[p + 1] = start[p] + int4_units(ms[p], N);
        reorder_activations(xqs[p], ms[p], K, G, xr + at * K, xsum + at * groups, nthreads);
    }
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (P * N * K / 2 >= MIN_PARALLEL_BYTES)
    for (int64_t i = 0; i < start[P]; i++) {
        const int64_t p = product_of(start, i);
        int4_unit(xr + first[p] * K, xsum + first[p] * groups, xss[p], ms[p], qs[p], scaless[p], fp16, NULL, ys[p],
                  N, K, G, i - start[p]);
    }
    free(xr);
    free(xsum);
    free(first);
    return 0;
}

/* hybridlm_prefill_int4 on x [M, K] bf16, its rows quantized here per group of G (hybridlm_quantize_rows):
   one call instead of two, which a decode row's few microseconds notice. Returns 0 or -1 (out of memory). */
int hybridlm_prefill_int4_bf16(const uint16_t* x, int64_t M, const uint8_t* q, const uint16_t* scales, int fp16,
                               const uint16_t* bias, uint16_t* y, int64_t N, int64_t K, int64_t G, int nthreads) {
    int8_t* xq = malloc((size_t)(M * K));
    float* xs = malloc((size_t)(M * (K / G)) * sizeof(float));
    int status = -1;
    if (xq && xs) {
        hybridlm_quantize_rows(x, M, K, G, xq, xs, nthreads);
        status = hybridlm_prefill_int4(xq, xs, M, q, scales, fp16, bias, y, N, K, G, nthreads);
    }
    free(xq);
    free(xs);
    return status;
}
/* The routed int4 experts of a few tokens in one parallel region, on the integer tiles (quant.c's
   hybridlm_moe_experts is the float tiles' version): expert p's rows xs[p] [ms[p], D] bf16 quantized per
   group of G1 as a prompt row is, its first product (q1[p] [N1, D] packed int4, scales s1[p]: gate rows
   then up rows when gated, N1 = 2·I, else up rows, N1 = I), the activation expert_hidden (bf16.h), the
   hidden row quantized per group of G2, its down product (q2[p] [D, I], scales s2[p]), then the pairs'
   outputs (expert p's rows after expert p - 1's) added into their tokens' rows of out [n, D] bf16 with
   their routing weights (combine.h: w, w_bf16, w_at, tokens, late). Each product is computed by the units
   of hybridlm_prefill_int4, so a row has the bits of its own calls whatever else the call holds. Returns 0
   or -1 (out of memory). */
int hybridlm_moe_experts_int4(const uint16_t* const* xs, const int64_t* ms, int64_t P, const uint8_t* const* q1,
                              const uint16_t* const* s1, int64_t G1, const uint8_t* const* q2,
                              const uint16_t* const* s2, int64_t G2, int fp16, int gated, const void* w,
                              int w_bf16, const int64_t* w_at, const int64_t* tokens, int64_t late,
                              uint16_t* out, int64_t n, int64_t D, int64_t I, int nthreads) {
    const int64_t N1 = gated ? 2 * I : I, g1 = D / G1, g2 = I / G2;
    int64_t rows = 0;
    for (int64_t p = 0; p < P; p++) rows += ms[p];
    int64_t* first = malloc((size_t)(3 * P + 2) * sizeof(int64_t));
    int8_t *xq = malloc((size_t)(rows * D)), *xr = malloc((size_t)(rows * D));
    int8_t *hq = malloc((size_t)(rows * I)), *hr = malloc((size_t)(rows * I));
    float *xsc = malloc((size_t)(rows * g1) * sizeof(float)), *hsc = malloc((size_t)(rows * g2) * sizeof(float));
    int32_t *xsum = malloc((size_t)(rows * g1) * sizeof(int32_t)), *hsum = malloc((size_t)(rows * g2) * sizeof(int32_t));
    uint16_t *y1 = malloc((size_t)(rows * N1) * 2), *h = malloc((size_t)(rows * I) * 2), *ys = malloc((size_t)(rows * D) * 2);
    float* acc = calloc((size_t)(n * D), sizeof(float));
    int status = -1;
    if (!first || !xq || !xr || !hq || !hr || !xsc || !hsc || !xsum || !hsum || !y1 || !h || !ys || !acc) goto done;
    int64_t *start1 = first + P, *start2 = start1 + P + 1;
    start1[0] = start2[0] = 0;
    for (int64_t p = 0, at = 0; p < P; at += ms[p], p++) {
        first[p] = at;
        start1[p + 1] = start1[p] + int4_units(ms[p], N1);
        start2[p + 1] = start2[p] + int4_units(ms[p], D);
        for (int64_t m = 0; m < ms[p]; m++) {
            const int64_t r = at + m;
            if (p > 0 && xs[p] == xs[p - 1] && ms[p] == ms[p - 1]) {  /* one token's experts share its row */
                memcpy(xr + r * D, xr + (r - ms[p]) * D, (size_t)D);
                memcpy(xsc + r * g1, xsc + (r - ms[p]) * g1, (size_t)g1 * sizeof(float));
                memcpy(xsum + r * g1, xsum + (r - ms[p]) * g1, (size_t)g1 * sizeof(int32_t));
                continue;
            }
            quantize_row(xs[p] + m * D, D, G1, xq + r * D, xsc + r * g1);
            reorder_row(xq + r * D, D, G1, xr + r * D, xsum + r * g1);
        }
    }
    const int64_t bytes = P * D * (N1 + I) / 2;
    #pragma omp parallel num_threads(nthreads) if (bytes >= MIN_PARALLEL_BYTES)
    {
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < start1[P]; i++) {
            const int64_t p = product_of(start1, i);
            int4_unit(xr + first[p] * D, xsum + first[p] * g1, xsc + first[p] * g1, ms[p], q1[p], s1[p], fp16, NULL,
                      y1 + first[p] * N1, N1, D, G1, i - start1[p]);
        }
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t j = 0; j < I; j++) h[r * I + j] = f32_to_bf16(expert_hidden(y1 + r * N1, I, j, gated));
            quantize_row(h + r * I, I, G2, hq + r * I, hsc + r * g2);
            reorder_row(hq + r * I, I, G2, hr + r * I, hsum + r * g2);
        }
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < start2[P]; i++) {
            const int64_t p = product_of(start2, i);
            int4_unit(hr + first[p] * I, hsum + first[p] * g2, hsc + first[p] * g2, ms[p], q2[p], s2[p], fp16, NULL,
                      ys + first[p] * D, D, I, G2, i - start2[p]);
        }
        #pragma omp for schedule(static)
        for (int64_t c0 = 0; c0 < D; c0 += COMBINE_COLUMNS)
            combine_columns(ys, w, w_bf16, w_at, tokens, rows, late, acc, out, n, D, c0,
                            c0 + COMBINE_COLUMNS < D ? c0 + COMBINE_COLUMNS : D);
    }
    status = 0;
done:
    free(first), free(xq), free(xr), free(hq), free(hr), free(xsc), free(hsc), free(xsum), free(hsum);
    free(y1), free(h), free(ys), free(acc);
    return status;
}
#else
/* Without the integer kernels the caller keeps its dequantized bf16 path. */
int hybridlm_prefill_int4(const int8_t* xq, const float* xs, int64_t M, const uint8_t* q, const uint16_t* scales,
                          int fp16, const uint16_t* bias, uint16_t* y, int64_t N, int64_t K, int64_t G,
                          int nthreads) {
    (void)xq; (void)xs; (void)M; (void)q; (void)scales; (void)fp16; (void)bias; (void)y; (void)N; (void)K;
    (void)G; (void)nthreads;
    return -1;
}

int hybridlm_prefill_int4_grouped(const int8_t* const* xqs, const float* const* xss, const int64_t* ms,
                                  const uint8_t* const* qs, const uint16_t* const* scaless, int fp16,
                                  uint16_t* const* ys, int64_t P, int64_t N, int64_t K, int64_t G, int nthreads) {
    (void)xqs; (void)xss; (void)ms; (void)qs; (void)scaless; (void)fp16; (void)ys; (void)P; (void)N; (void)K;
    (void)G; (void)nthreads;
    return -1;
}

int hybridlm_prefill_int4_bf16(const uint16_t* x, int64_t M, const uint8_t* q, const uint16_t* scales, int fp16,
                               const uint16_t* bias, uint16_t* y, int64_t N, int64_t K, int64_t G, int nthreads) {
    (void)x; (void)M; (void)q; (void)scales; (void)fp16; (void)bias; (void)y; (void)N; (void)K; (void)G;
    (void)nthreads;
    return -1;
}

/* Without the integer kernels the caller keeps the float experts kernel or the grouped path. */
int hybridlm_moe_experts_int4(const uint16_t* const* xs, const int64_t* ms, int64_t P, const uint8_t* const* q1,
                              const uint16_t* const* s1, int64_t G1, const uint8_t* const* q2,
                              const uint16_t* const* s2, int64_t G2, int fp16, int gated, const void* w,
                              int w_bf16, const int64_t* w_at, const int64_t* tokens, int64_t late,
                              uint16_t* out, int64_t n, int64_t D, int64_t I, int nthreads) {
    (void)xs; (void)ms; (void)P; (void)q1; (void)s1; (void)G1; (void)q2; (void)s2; (void)G2; (void)fp16;
    (void)gated; (void)w; (void)w_bf16; (void)w_at; (void)tokens; (void)late; (void)out; (void)n; (void)D; (void)I;
    (void)nthreads;
    return -1;
}
#endif
