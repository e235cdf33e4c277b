/* Weight-only quantized linear layers: y[m, n] = bf16(scale(n) · Σ_k x[m, k] q[n, k] + bias[n]), with
   x, bias, y bf16 and float32 accumulation.

   int8: q [N, K] int8, one float32 scale per output row (symmetric, q in [-127, 127]).
   int4: q packed two per byte, [N, K / 2] uint8, in blocks of 64 weights held in 32 bytes: byte i of
   a block holds weight i in its low nibble and weight i + 32 in its high nibble, each stored as
   q + 8 (q in [-8, 7]); one bf16 scale per group of G consecutive weights of a row (G a multiple of
   32 dividing K), [N, K / G]. Within a group the products are summed unscaled, then the group's
   sum is multiplied by its scale and added to the row's sum.

   Like linear.c, weight rows are processed in blocks of RB rows against up to MC input rows at a
   time (each weight byte is read from memory once for every input row), and the sum of one output
   is computed by the same instructions in the same order whatever rows share the call, so a row's
   result never depends on the rows beside it. Prefill-sized inputs instead dequantize the weight to
   bf16 (hybridlm_dequant_*) and use the bf16 GEMM. */
#include "bf16.h"
#include <stdlib.h>

#define RB 4
#define PREFETCH_BYTES 16384
#define MIN_PARALLEL_BYTES 65536 /* below this a second thread costs more to wake than it saves */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define QUANT_SIMD 1
#include <immintrin.h>
#define MC8 4 /* input rows per pass of the int8 tile */
#define MC4 2 /* of the int4 tile: it also holds a per-group sum per (row, input) */

/* int8: weights widened to float32 16 at a time and multiplied with x in float32. */
static inline __attribute__((always_inline)) void tile_i8(const float* xf, int64_t K, int mc, const int8_t* w,
                                                          int rb, float out[RB][MC8]) {
    __m512 acc[RB][MC8];
    for (int r = 0; r < rb; r++) for (int c = 0; c < mc; c++) acc[r][c] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512 w0[RB], w1[RB];
        for (int r = 0; r < rb; r++) {
            __builtin_prefetch((const char*)(w + r * K + k) + PREFETCH_BYTES, 0, 1);
            w0[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + r * K + k))));
            w1[r] = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + r * K + k + 16))));
        }
        for (int c = 0; c < mc; c++) {
            const __m512 x0 = _mm512_loadu_ps(xf + c * K + k), x1 = _mm512_loadu_ps(xf + c * K + k + 16);
            for (int r = 0; r < rb; r++) {
                acc[r][c] = _mm512_fmadd_ps(w0[r], x0, acc[r][c]);
                acc[r][c] = _mm512_fmadd_ps(w1[r], x1, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < rb; r++) for (int c = 0; c < mc; c++) {
        float s = _mm512_reduce_add_ps(acc[r][c]);
        for (int64_t t = k; t < K; t++) s += (float)w[r * K + t] * xf[c * K + t];
        out[r][c] = s;
    }
}

/* int4: a nibble indexes a 16-entry table of the bf16 values q = nibble - 8 (vpermw), and vdpbf16ps
   multiplies 32 of them with 32 bf16 inputs, exactly (products of bf16 fit a float32). K % 64 == 0. */
static inline __attribute__((always_inline)) void tile_i4(const uint16_t* x, int64_t K, int mc, const uint8_t* w,
                                                          const uint16_t* scales, int64_t G, int rb,
                                                          float out[RB][MC4]) {
    /* bf16 of -8 .. 7 in words 0 .. 15, repeated in words 16 .. 31: vpermw reads 5 index bits, so a
       zero-extended byte indexes its low nibble without masking off bit 4 */
#define Q4_VALUES (short)0x40e0, (short)0x40c0, (short)0x40a0, (short)0x4080, (short)0x4040, (short)0x4000, \
    (short)0x3f80, (short)0x0000, (short)0xbf80, (short)0xc000, (short)0xc040, (short)0xc080, (short)0xc0a0, \
    (short)0xc0c0, (short)0xc0e0, (short)0xc100
    const __m512i table = _mm512_set_epi16(Q4_VALUES, Q4_VALUES);
#undef Q4_VALUES
    const int64_t groups = K / G;
    /* the scales as float32: a broadcast from memory costs a load, not a shuffle */
    float sf[RB * groups];
    for (int64_t i = 0; i < rb * groups; i++) sf[i] = bf16_to_f32(scales[i]);
    __m512 acc[RB][MC4], part[RB][MC4];
    /* group g ends: its sums, times its scale, go into the row's sums */
#define FLUSH(g)                                                                      \
    for (int r = 0; r < rb; r++) {                                                    \
        const __m512 s = _mm512_set1_ps(sf[r * groups + (g)]);             \
        for (int c = 0; c < mc; c++) {                                                \
            acc[r][c] = _mm512_fmadd_ps(s, part[r][c], acc[r][c]);                    \
            part[r][c] = _mm512_setzero_ps();                                         \
        }                                                                             \
    }
    for (int r = 0; r < rb; r++) for (int c = 0; c < mc; c++) {
        acc[r][c] = _mm512_setzero_ps();
        part[r][c] = _mm512_setzero_ps();
    }
    int64_t g = 0, group_end = G;  /* the current group and where it ends (no division in the loop) */
    for (int64_t k = 0; k < K; k += 64) {
        __m512bh lo[RB], hi[RB];
        for (int r = 0; r < rb; r++) {
            const uint8_t* p = w + r * (K / 2) + k / 2;
            __builtin_prefetch(p + PREFETCH_BYTES / 2, 0, 1);
            const __m512i z = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p));
            lo[r] = (__m512bh)_mm512_permutexvar_epi16(z, table);
            hi[r] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(z, 4), table);
        }
        for (int c = 0; c < mc; c++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + c * K + k);
            for (int r = 0; r < rb; r++) part[r][c] = _mm512_dpbf16_ps(part[r][c], lo[r], xv);
        }
        if (k + 32 == group_end) { FLUSH(g); g++; group_end += G; }
        for (int c = 0; c < mc; c++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + c * K + k + 32);
            for (int r = 0; r < rb; r++) part[r][c] = _mm512_dpbf16_ps(part[r][c], hi[r], xv);
        }
        if (k + 64 == group_end) { FLUSH(g); g++; group_end += G; }
    }
    for (int r = 0; r < rb; r++) for (int c = 0; c < mc; c++) out[r][c] = _mm512_reduce_add_ps(acc[r][c]);
#undef FLUSH
}
#else
#define QUANT_SIMD 0
#define MC8 4
#define MC4 2
/* Portable tiles: one output at a time, the same order for any rows beside it. */
static void tile_i8(const float* xf, int64_t K, int mc, const int8_t* w, int rb, float out[RB][MC8]) {
    for (int r = 0; r < rb; r++) for (int c = 0; c < mc; c++) {
        float s = 0.f;
        for (int64_t k = 0; k < K; k++) s += (float)w[r * K + k] * xf[c * K + k];
        out[r][c] = s;
    }
}
static void tile_i4(const uint16_t* x, int64_t K, int mc, const uint8_t* w, const uint16_t* scales, int64_t G,
                    int rb, float out[RB][MC4]) {
    for (int r = 0; r < rb; r++) for (int c = 0; c < mc; c++) {
        float s = 0.f;
        for (int64_t g0 = 0; g0 < K; g0 += G) {
            float part = 0.f;
            for (int64_t k = g0; k < g0 + G; k++) {
                const uint8_t b = w[r * (K / 2) + k / 64 * 32 + k % 32];
                const int q = (k % 64 < 32 ? (b & 15) : (b >> 4)) - 8;
                part += (float)q * bf16_to_f32(x[c * K + k]);
            }
            s += bf16_to_f32(scales[r * (K / G) + g0 / G]) * part;
        }
        out[r][c] = s;
    }
}
#endif

/* x [M, K] bf16, q [N, K] int8, scale [N] float32, bias [N] bf16 or NULL, y [M, N] bf16. Returns 0 or
   -1 (out of memory). */
int hybridlm_linear_int8(const uint16_t* x, int64_t M, const int8_t* q, const float* scale, const uint16_t* bias,
                         uint16_t* y, int64_t N, int64_t K, int nthreads) {
    float* xf = malloc((size_t)(M * K) * sizeof(float));
    if (!xf) return -1;
    for (int64_t i = 0; i < M * K; i++) xf[i] = bf16_to_f32(x[i]);
    const int64_t nblocks = (N + RB - 1) / RB;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (N * K >= MIN_PARALLEL_BYTES)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * RB;
        const int rb = N - n0 < RB ? (int)(N - n0) : RB;
        for (int64_t m0 = 0; m0 < M; m0 += MC8) {
            const int mc = M - m0 < MC8 ? (int)(M - m0) : MC8;
            float out[RB][MC8];
            /* constant (rb, mc) per call site, so the tile's loops unroll into registers */
            if (rb == RB && mc == MC8) tile_i8(xf + m0 * K, K, MC8, q + n0 * K, RB, out);
            else if (rb == RB && mc == 1) tile_i8(xf + m0 * K, K, 1, q + n0 * K, RB, out);
            else tile_i8(xf + m0 * K, K, mc, q + n0 * K, rb, out);
            for (int r = 0; r < rb; r++) {
                const float bv = bias ? bf16_to_f32(bias[n0 + r]) : 0.f;
                for (int c = 0; c < mc; c++)
                    y[(m0 + c) * N + n0 + r] = f32_to_bf16(out[r][c] * scale[n0 + r] + bv);
            }
        }
    }
    free(xf);
    return 0;
}

/* x [M, K] bf16, q [N, K / 2] packed int4 (see above), scales [N, K / G] bf16, bias [N] bf16 or NULL,
   y [M, N] bf16; K % 64 == 0 and K % G == 0, G % 32 == 0. */
int hybridlm_linear_int4(const uint16_t* x, int64_t M, const uint8_t* q, const uint16_t* scales,
                         const uint16_t* bias, uint16_t* y, int64_t N, int64_t K, int64_t G, int nthreads) {
    const int64_t nblocks = (N + RB - 1) / RB;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (N * K / 2 >= MIN_PARALLEL_BYTES)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * RB;
        const int rb = N - n0 < RB ? (int)(N - n0) : RB;
        for (int64_t m0 = 0; m0 < M; m0 += MC4) {
            const int mc = M - m0 < MC4 ? (int)(M - m0) : MC4;
            float out[RB][MC4];
            const uint8_t* w = q + n0 * (K / 2);
            const uint16_t* s = scales + n0 * (K / G);
            if (rb == RB && mc == MC4) tile_i4(x + m0 * K, K, MC4, w, s, G, RB, out);
            else if (rb == RB && mc == 1) tile_i4(x + m0 * K, K, 1, w, s, G, RB, out);
            else tile_i4(x + m0 * K, K, mc, w, s, G, rb, out);
            for (int r = 0; r < rb; r++) {
                const float bv = bias ? bf16_to_f32(bias[n0 + r]) : 0.f;
                for (int c = 0; c < mc; c++) y[(m0 + c) * N + n0 + r] = f32_to_bf16(out[r][c] + bv);
            }
        }
    }
    return 0;
}

/* Rows [n0, n1) of the weight as bf16, w [n1 - n0, K]: q · scale rounded to bf16 once (to nearest
   even, as f32_to_bf16 and vcvtneps2bf16 both round). */
void hybridlm_dequant_int8(const int8_t* q, const float* scale, uint16_t* w, int64_t n0, int64_t n1, int64_t K,
                           int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = n0; n < n1; n++) {
        const int8_t* row = q + n * K;
        uint16_t* out = w + (n - n0) * K;
        int64_t k = 0;
#if QUANT_SIMD
        const __m512 s = _mm512_set1_ps(scale[n]);
        for (; k + 16 <= K; k += 16) {
            const __m128i b = _mm_loadu_si128((const __m128i*)(row + k));
            const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
            _mm256_storeu_si256((__m256i*)(out + k), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(v, s)));
        }
#endif
        for (; k < K; k++) out[k] = f32_to_bf16((float)row[k] * scale[n]);
    }
}

void hybridlm_dequant_int4(const uint8_t* q, const uint16_t* scales, uint16_t* w, int64_t n0, int64_t n1,
                           int64_t K, int64_t G, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t* row = q + n * (K / 2);
        uint16_t* out = w + (n - n0) * K;
        for (int64_t k0 = 0; k0 < K; k0 += 64) {
            const float s0 = bf16_to_f32(scales[n * (K / G) + k0 / G]);
            const float s1 = bf16_to_f32(scales[n * (K / G) + (k0 + 32) / G]);
#if QUANT_SIMD
            /* q - 8 as float32 for nibbles 0 .. 15 (vpermps reads 4 index bits: no masking) */
            const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
            for (int i = 0; i < 32; i += 16) {
                const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(row + k0 / 2 + i)));
                const __m512 lo = _mm512_permutexvar_ps(b, table);
                const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
                _mm256_storeu_si256((__m256i*)(out + k0 + i), (__m256i)_mm512_cvtneps_pbh(lo * s0));
                _mm256_storeu_si256((__m256i*)(out + k0 + 32 + i), (__m256i)_mm512_cvtneps_pbh(hi * s1));
            }
#else
            for (int i = 0; i < 32; i++) {
                const uint8_t b = row[k0 / 2 + i];
                out[k0 + i] = f32_to_bf16((float)((b & 15) - 8) * s0);
                out[k0 + 32 + i] = f32_to_bf16((float)((b >> 4) - 8) * s1);
            }
#endif
        }
    }
}
