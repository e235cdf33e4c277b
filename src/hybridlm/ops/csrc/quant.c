/* Weight-only quantized linear layers: y[m, n] = bf16(scale(n) · Σ_k x[m, k] q[n, k] + bias[n]), with
   x, bias, y bf16 and float32 accumulation.

   int8: q [N, K] int8, one float32 scale per output row (symmetric, q in [-127, 127]). Weight rows
   are processed in blocks of RB rows against up to MC8 input rows at a time (each weight byte is
   read from memory once for every input row), widened to float32 16 at a time; a one-row input
   takes blocks of RB1 rows (more rows streaming at once: +20% out of cache on one core, where the
   conversion keeps up with memory either way).

   int4: q [N, K / 2] bytes in panels of 16 weight rows (the last panel holds the N % 16 rows left,
   if any): panel p is rows 16p .. 16p + 15 of the array, read as 32-bit words (b, n) for k-block
   b = 0 .. K / 8 - 1 and row n of the panel, word (b, n) holding q[n, 8b + s] + 8 in bits
   4s .. 4s + 3 (q in [-8, 7], so the nibble is unsigned; GPTQ packs its words the same way). One
   scale per group of G consecutive weights of a row (G a multiple of 8 dividing K), bf16 or fp16,
   [N, K / G] laid out by panels the same way: panel p's scales are (group, row) ordered. Within a
   group the products are summed unscaled, then the group's sum is multiplied by its scale and
   added to the row's sum. A lane of a vector holds one output row, so no sum needs a horizontal
   reduction, and a 64-byte load is 8 weights of each of 16 rows.

   The sum of one output is computed by the same instructions in the same order whatever rows share
   the call, so a row's result never depends on the rows beside it. Prefill-sized inputs take the
   integer path of quant_prefill.c where the CPU has VNNI; elsewhere they dequantize the weight to
   bf16 (hybridlm_dequant_*) and use the bf16 GEMM. */
#include "bf16.h"
#include "combine.h"
#include <stdlib.h>

#define RB 4  /* int8: weight rows per block against several input rows */
#define RB1 8 /* ... and against one: more independent rows streaming at once */
#define PREFETCH_BYTES 16384
#define MIN_PARALLEL_BYTES 65536 /* below this a second thread costs more to wake than it saves */

/* A bf16 (fp16 == 0) or IEEE fp16 scale as float32. */
static inline float scale_f32(uint16_t v, int fp16) {
    if (!fp16) return bf16_to_f32(v);
    const int e = (v >> 10) & 31, m = v & 1023;  /* IEEE half: 1 sign, 5 exponent, 10 fraction bits */
    const float mag = e == 0 ? m * 0x1p-24f : e == 31 ? (m ? __builtin_nanf("") : __builtin_inff())
                                                      : (1024 + m) * __builtin_ldexpf(1.f, e - 25);
    return v & 0x8000 ? -mag : mag;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define QUANT_SIMD 1
#include <immintrin.h>
#define MC8 4 /* input rows per pass of the int8 tile */
#define MP4 2 /* most panels of an int4 tile (2 for one input row, else 1) */
#define MC4 4 /* its most input rows */
#define TILE4_ROWS(mc) switch (mc) { case 1: TILE4(1, 1); break; case 2: TILE4(1, 2); break; \
                                     case 3: TILE4(1, 3); break; default: TILE4(1, MC4); }

/* int8: weights widened to float32 16 at a time and multiplied with x in float32. */
static inline __attribute__((always_inline)) void tile_i8(const float* xf, int64_t K, int mc, const int8_t* w,
                                                          int rb, float out[RB1][MC8]) {
    __m512 acc[RB1][MC8];
    for (int r = 0; r < rb; r++) for (int c = 0; c < mc; c++) acc[r][c] = _mm512_setzero_ps();
    /* Whole blocks ahead, so each row stream prefetches its own row of a later block (the thread's
       next ones, schedule(static)); PREFETCH_BYTES straight ahead lands mid-row of another stream when
       the block is not a divisor of it: 1024 x 3584 (one input row) streamed at 26 GB/s, now 31 (2
       threads, out of cache; K = 1024 and 2048 prefetch the same addresses as before). */
    const int64_t ahead = (PREFETCH_BYTES + rb * K - 1) / (rb * K) * rb * K;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512 w0[RB1], w1[RB1];
        for (int r = 0; r < rb; r++) {
            __builtin_prefetch((const char*)(w + r * K + k + ahead), 0, 1);
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

/* The 16 scales of a panel's group as float32: bf16 is the upper half of a float32, fp16 converts
   exactly. `tail` (lanes of a short last panel, 0 for a full one) masks the load. */
static inline __m512 scales_f32(const uint16_t* s, int fp16, uint16_t tail) {
    const __m256i v = tail ? _mm256_maskz_loadu_epi16(tail, s) : _mm256_loadu_si256((const __m256i*)s);
    return fp16 ? _mm512_cvtph_ps(v) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* int4: acc [np][mc][16] = the sums of np panels' rows against mc input rows (xf, float32). vpermps
   maps the low 4 bits of each 32-bit word to q as float32, giving lane n the weight q[n, 8b + s],
   multiplied with x[8b + s] broadcast, exactly (a bf16 times a 4-bit integer fits a float32):
   float32 FMAs run two a cycle where vdpbf16ps runs one every two. Nibble 2j is the low nibble of
   the word's byte j, so the 64 bytes loaded j bytes further on hold it in their low bits (lane n
   reads bytes 4n + j .. 4n + j + 3, the last lane 1..3 bytes of the next block); nibble 2j + 1 is
   that load shifted right by 4. Vector shifts issue on one port of the two that run vpermps and
   FMAs, and these loads save 3 of the 7 a block needed by shifting alone: +9..14% (one row, in and
   out of cache). The array's last block, whose loads would read past its end, shifts instead.
   Each output sums s mod 4 = 0, 1, 2, 3 apart (four dependency chains), adds the four in that
   order at the group's end and scales. */
static inline __attribute__((always_inline)) void tile_i4(const float* xf, int64_t K, int mc, const uint32_t* w,
                                                          const uint16_t* scales, int fp16, int64_t G, int np,
                                                          uint16_t tail, const char* end, float* acc) {
    const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const int64_t groups = K / G, blocks = G / 8, width = tail ? __builtin_popcount(tail) : 16;
    for (int i = 0; i < np * mc * 16; i++) acc[i] = 0.f;
    for (int64_t g = 0; g < groups; g++) {
        __m512 part[MP4][MC4][4];
        for (int p = 0; p < np; p++) for (int c = 0; c < mc; c++) for (int j = 0; j < 4; j++)
            part[p][c][j] = _mm512_setzero_ps();
        for (int64_t b = g * blocks; b < (g + 1) * blocks; b++) {
            __m512 wt[MP4][8];
            for (int p = 0; p < np; p++) {
                const uint32_t* src = w + p * 16 * (K / 8) + b * width;
                /* Past its panel's end a stream prefetches the same panel of the next tile (the thread's
                   next, schedule(static)), not the tile's next panel that another stream already reads:
                   with long K (down projections) straight-ahead prefetching missed most of each panel,
                   1024 x 3584 streamed at 22 GB/s, now 27 (2 threads, out of cache). */
                const char* ahead = (const char*)src + PREFETCH_BYTES;
                if (ahead >= (const char*)(w + (p + 1) * 16 * (K / 8))) ahead += (np - 1) * 16 * (K / 2);
                __builtin_prefetch(ahead, 0, 1);
                const __mmask16 lanes = tail ? tail : 0xffff;
                const __m512i raw = _mm512_maskz_loadu_epi32(lanes, src);
                if ((const char*)(src + width) + 3 <= end) {
                    for (int j = 0; j < 4; j++) {
                        const __m512i v = j ? _mm512_maskz_loadu_epi32(lanes, (const char*)src + j) : raw;
                        wt[p][2 * j] = _mm512_permutexvar_ps(v, table);
                        wt[p][2 * j + 1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
                    }
                } else {
                    for (int s = 0; s < 8; s++) wt[p][s] = _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 4 * s), table);
                }
            }
            for (int c = 0; c < mc; c++)
                for (int s = 0; s < 8; s++) {
                    const __m512 xv = _mm512_set1_ps(xf[c * K + b * 8 + s]);
                    for (int p = 0; p < np; p++) part[p][c][s % 4] = _mm512_fmadd_ps(wt[p][s], xv, part[p][c][s % 4]);
                }
        }
        for (int p = 0; p < np; p++) {
            const __m512 sv = scales_f32(scales + p * 16 * groups + g * width, fp16, tail);
            for (int c = 0; c < mc; c++) {
                const __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(part[p][c][0], part[p][c][1]),
                                                               part[p][c][2]), part[p][c][3]);
                float* a = acc + (p * mc + c) * 16;
                _mm512_storeu_ps(a, _mm512_fmadd_ps(sv, sum, _mm512_loadu_ps(a)));
            }
        }
    }
}
#else
/* Without AVX-512: GCC vector extensions of 8 floats, one AVX2 register (two of SSE or NEON). A tile's
   accumulators must fit AVX2's 16 registers: int8 takes 3 input rows a pass (12 sums), int4 keeps two
   sums per half panel and input row (even and odd inputs: 8 for two panels against one row). */
#define QUANT_SIMD 0
#if defined(__SSE4_1__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif
#define MC8 3
#define MP4 2
#define MC4 2
#define TILE4_ROWS(mc) switch (mc) { case 1: TILE4(1, 1); break; default: TILE4(1, MC4); }
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

static inline f32x8 load_f32x8(const float* p) { f32x8 v; memcpy(&v, p, sizeof v); return v; }
/* 8 int8 weights as float32 exactly. GCC 12 lowers a generic int8 -> float vector conversion to one
   scalar conversion per element, so each ISA gets its widening instructions. */
static inline f32x8 widen_i8(const int8_t* p) {
#if defined(__AVX2__)
    return (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
#elif defined(__SSE4_1__)
    const __m128i b = _mm_loadl_epi64((const __m128i*)p);
    const __m128 lo = _mm_cvtepi32_ps(_mm_cvtepi8_epi32(b)), hi = _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_srli_si128(b, 4)));
    f32x8 v;
    memcpy(&v, &lo, 16);
    memcpy((char*)&v + 16, &hi, 16);
    return v;
#elif defined(__ARM_NEON)
    const int16x8_t h = vmovl_s8(vld1_s8(p));
    const float32x4_t lo = vcvtq_f32_s32(vmovl_s16(vget_low_s16(h))), hi = vcvtq_f32_s32(vmovl_s16(vget_high_s16(h)));
    f32x8 v;
    memcpy(&v, &lo, 16);
    memcpy((char*)&v + 16, &hi, 16);
    return v;
#else
    f32x8 v;
    for (int i = 0; i < 8; i++) v[i] = (float)p[i];
    return v;
#endif
}
static inline float hsum(f32x8 v) {
    f32x4 a, b; memcpy(&a, &v, 16); memcpy(&b, (char*)&v + 16, 16); a += b;
    return (a[0] + a[2]) + (a[1] + a[3]);
}

/* int8: weights widened to float32 8 at a time and multiplied with x in float32. */
static inline __attribute__((always_inline)) void tile_i8(const float* xf, int64_t K, int mc, const int8_t* w,
                                                          int rb, float out[RB1][MC8]) {
    f32x8 acc[RB1][MC8];
    for (int r = 0; r < rb; r++) for (int c = 0; c < mc; c++) acc[r][c] = (f32x8){0};
    /* whole blocks ahead: each row stream prefetches its own row of the thread's next block */
    const int64_t ahead = (PREFETCH_BYTES + rb * K - 1) / (rb * K) * rb * K;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        for (int r = 0; r < rb; r++) {
            __builtin_prefetch((const char*)(w + r * K + k + ahead), 0, 1);
            const f32x8 w0 = widen_i8(w + r * K + k), w1 = widen_i8(w + r * K + k + 8);
            for (int c = 0; c < mc; c++) {
                acc[r][c] += w0 * load_f32x8(xf + c * K + k);
                acc[r][c] += w1 * load_f32x8(xf + c * K + k + 8);
            }
        }
    }
    for (int r = 0; r < rb; r++) for (int c = 0; c < mc; c++) {
        float s = hsum(acc[r][c]);
        for (int64_t t = k; t < K; t++) s += (float)w[r * K + t] * xf[c * K + t];
        out[r][c] = s;
    }
}

/* 8 scales of a panel's group as float32 (bf16: the upper half of a float32). */
static inline f32x8 scales8(const uint16_t* s, int fp16) {
    if (fp16) {
        f32x8 v;
        for (int i = 0; i < 8; i++) v[i] = scale_f32(s[i], 1);
        return v;
    }
    u16x8 h;
    memcpy(&h, s, sizeof h);
    return (f32x8)(__builtin_convertvector(h, u32x8) << 16);
}

/* int4: acc [np][mc][16] = the sums of np panels' rows against mc input rows, a panel as two halves of
   8 lanes (a lane is one output row). A nibble becomes q as float32 exactly ((w >> 4s) & 15, converted,
   minus 8) and is multiplied with x[8b + s] broadcast; within a group the even and odd inputs sum
   apart and are added at the group's end, times the scales. A short last panel (`tail`) runs one
   output at a time in the same order. */
static inline __attribute__((always_inline)) void tile_i4(const float* xf, int64_t K, int mc, const uint32_t* w,
                                                          const uint16_t* scales, int fp16, int64_t G, int np,
                                                          uint16_t tail, const char* end, float* acc) {
    (void)end;
    const int64_t groups = K / G, blocks = G / 8;
    if (tail) {
        const int width = __builtin_popcount(tail);
        for (int c = 0; c < mc; c++) for (int n = 0; n < width; n++) {
            float total = 0.f;
            for (int64_t g = 0; g < groups; g++) {
                float part[2] = {0.f, 0.f};
                for (int64_t b = g * blocks; b < (g + 1) * blocks; b++) {
                    const uint32_t word = w[b * width + n];
                    for (int t = 0; t < 8; t++)
                        part[t & 1] += (float)((int)((word >> (4 * t)) & 15) - 8) * xf[c * K + b * 8 + t];
                }
                total += scale_f32(scales[g * width + n], fp16) * (part[0] + part[1]);
            }
            acc[c * 16 + n] = total;
        }
        return;
    }
    const u32x8 low = (u32x8){0} + 15u;
    const f32x8 eight = (f32x8){0} + 8.f;
    for (int i = 0; i < np * mc * 16; i++) acc[i] = 0.f;
    for (int64_t g = 0; g < groups; g++) {
        f32x8 part[MP4][MC4][2][2];
        for (int p = 0; p < np; p++) for (int c = 0; c < mc; c++) for (int h = 0; h < 2; h++)
            part[p][c][h][0] = part[p][c][h][1] = (f32x8){0};
        for (int64_t b = g * blocks; b < (g + 1) * blocks; b++)
            for (int p = 0; p < np; p++) {
                const uint32_t* src = w + p * 16 * (K / 8) + b * 16;
                __builtin_prefetch((const char*)src + PREFETCH_BYTES, 0, 1);
                for (int h = 0; h < 2; h++) {
                    u32x8 raw;
                    memcpy(&raw, src + h * 8, sizeof raw);
                    for (int t = 0; t < 8; t++) {
                        const f32x8 q = __builtin_convertvector((i32x8)((raw >> (4 * t)) & low), f32x8) - eight;
                        for (int c = 0; c < mc; c++)
                            part[p][c][h][t & 1] += q * ((f32x8){0} + xf[c * K + b * 8 + t]);
                    }
                }
            }
        for (int p = 0; p < np; p++)
            for (int h = 0; h < 2; h++) {
                const f32x8 sv = scales8(scales + p * 16 * groups + g * 16 + h * 8, fp16);
                for (int c = 0; c < mc; c++) {
                    float* a = acc + (p * mc + c) * 16 + h * 8;
                    f32x8 total;
                    memcpy(&total, a, sizeof total);
                    total += sv * (part[p][c][h][0] + part[p][c][h][1]);
                    memcpy(a, &total, sizeof total);
                }
            }
    }
}
#endif

/* Weight rows [n0, n0 + block) of an int8 product against its M input rows (xf, float32), then the
   scale, bias and rounding: the unit of work of the single and the grouped kernels alike, so a product
   has the same bits in both. */
static void block_i8(const float* xf, int64_t M, const int8_t* q, const float* scale, const uint16_t* bias,
                     uint16_t* y, int64_t N, int64_t K, int64_t n0, int block) {
    const int rb = N - n0 < block ? (int)(N - n0) : block;
    for (int64_t m0 = 0; m0 < M; m0 += MC8) {
        const int mc = M - m0 < MC8 ? (int)(M - m0) : MC8;
        float out[RB1][MC8];
        /* constant (rb, mc) per call site, so the tile's loops unroll into registers */
#define TILE8(rows, cols) tile_i8(xf + m0 * K, K, cols, q + n0 * K, rows, out)
        if (rb == RB1 && mc == 1) TILE8(RB1, 1);
        else if (rb == RB) {
            switch (mc) { case 1: TILE8(RB, 1); break; case 2: TILE8(RB, 2); break; case 3: TILE8(RB, 3); break;
                          default: TILE8(RB, MC8); }
        } else {
            tile_i8(xf + m0 * K, K, mc, q + n0 * K, rb, out);
        }
#undef TILE8
        for (int r = 0; r < rb; r++) {
            const float bv = bias ? bf16_to_f32(bias[n0 + r]) : 0.f;
            for (int c = 0; c < mc; c++)
                y[(m0 + c) * N + n0 + r] = f32_to_bf16(out[r][c] * scale[n0 + r] + bv);
        }
    }
}

/* Weight rows per block of an int8 product of M input rows. */
static inline int block_rows_i8(int64_t M) { return M == 1 ? RB1 : RB; }

/* Tiles of an int4 product of M input rows: one input row takes tiles of 2 panels (more independent
   sums to hide the FMA latency), more rows one panel against up to MC4 rows at a time (the sums fill
   the registers); a short last panel is a tile of its own. */
static inline int tile_panels_i4(int64_t M) { return M == 1 ? MP4 : 1; }
static inline int64_t tiles_i4(int64_t M, int64_t N) {
    const int tp = tile_panels_i4(M);
    return (N / 16 + tp - 1) / tp + (N % 16 != 0);
}

/* Tile b of an int4 product (see tiles_i4) against its M input rows (xf, float32), then bias and
   rounding: the unit of work of the single and the grouped kernels alike. */
static void tile_rows_i4(const float* xf, int64_t M, const uint8_t* q, const uint16_t* scales, int fp16,
                         const uint16_t* bias, uint16_t* y, int64_t N, int64_t K, int64_t G, int64_t b) {
    const int tile_panels = tile_panels_i4(M);
    const char* end = (const char*)q + N * (K / 2); /* the tiles read no further */
    const int64_t full = N / 16;
    /* the short last panel is the last tile, at panel `full` (not b * tile_panels: with two-panel tiles
       and an odd number of full panels that would be one panel past it) */
    const int short_tile = N % 16 != 0 && b == tiles_i4(M, N) - 1;
    const int64_t p0 = short_tile ? full : b * tile_panels;
    const int np = short_tile ? 1 : (full - p0 < tile_panels ? (int)(full - p0) : tile_panels);
    const uint16_t tail = short_tile ? (uint16_t)((1u << (N % 16)) - 1) : 0;
    const int64_t n0 = p0 * 16, width = tail ? N % 16 : 16;
    const uint32_t* w = (const uint32_t*)(q + n0 * (K / 2));
    const uint16_t* s = scales + n0 * (K / G);
    for (int64_t m0 = 0; m0 < M; m0 += MC4) {
        const int mc = M - m0 < MC4 ? (int)(M - m0) : MC4;
        float acc[MP4 * MC4 * 16];
        const float* xm = xf + m0 * K;
        /* constant (np, mc) per call site, so the tile's loops unroll into registers */
#define TILE4(panels, cols) tile_i4(xm, K, cols, w, s, fp16, G, panels, 0, end, acc)
        if (tail) tile_i4(xm, K, mc, w, s, fp16, G, 1, tail, end, acc);
        else if (np == MP4) TILE4(MP4, 1);
        else TILE4_ROWS(mc);
#undef TILE4
        for (int p = 0; p < np; p++)
            for (int c = 0; c < mc; c++)
                for (int64_t i = 0; i < width; i++) {
                    const int64_t n = n0 + p * 16 + i;
                    const float bv = bias ? bf16_to_f32(bias[n]) : 0.f;
                    y[(m0 + c) * N + n] = f32_to_bf16(acc[(p * mc + c) * 16 + i] + bv);
                }
    }
}

/* The float32 copies of P products' inputs (xs[p] [ms[p], K] bf16) one after another, product p's from
   element first[p]; NULL when out of memory. */
static float* inputs_f32(const uint16_t* const* xs, const int64_t* ms, int64_t P, int64_t K, int64_t* first) {
    int64_t rows = 0;
    for (int64_t p = 0; p < P; p++) {
        first[p] = rows * K;
        rows += ms[p];
    }
    float* xf = malloc((size_t)(rows * K) * sizeof(float));
    if (!xf) return NULL;
    for (int64_t p = 0; p < P; p++)
        for (int64_t i = 0; i < ms[p] * K; i++) xf[first[p] + i] = bf16_to_f32(xs[p][i]);
    return xf;
}

/* The product whose units of work [start[p], start[p + 1]) hold unit i. */
static inline int64_t product_of(const int64_t* start, int64_t i) {
    int64_t p = 0;
    while (start[p + 1] <= i) p++;
    return p;
}

/* The units of work of a product of M input rows against N weight rows: int8 row blocks (block_i8),
   int4 tiles (tile_rows_i4). */
static inline int64_t units_of(int bits, int64_t M, int64_t N) {
    return bits == 8 ? (N + block_rows_i8(M) - 1) / block_rows_i8(M) : tiles_i4(M, N);
}

/* Unit u of a product: int8 with scales [N] float32, int4 with scales [N, K / G] bf16 (fp16: fp16). */
static inline void unit_of(int bits, const float* xf, int64_t M, const void* q, const void* scales, int fp16,
                           const uint16_t* bias, uint16_t* y, int64_t N, int64_t K, int64_t G, int64_t u) {
    if (bits == 8) {
        const int block = block_rows_i8(M);
        block_i8(xf, M, q, scales, bias, y, N, K, u * block, block);
    } else {
        tile_rows_i4(xf, M, q, scales, fp16, bias, y, N, K, G, u);
    }
}

/* P independent products of one shape and kind in one parallel region (a token's routed experts: their
   small matrices each cost a region's wake-up and barrier, and a Python call, more than their reads):
   for p < P, ys[p] [ms[p], N] = xs[p] [ms[p], K] · (qs[p] · scales[p])ᵀ + biases[p] (biases NULL, or
   an entry NULL: none). A product's units (unit_of) are the same whatever products share the call, so
   each product has the bits of a call of its own. Returns 0 or -1 (out of memory). */
static int grouped(int bits, const uint16_t* const* xs, const int64_t* ms, const void* const* qs,
                   const void* const* scales, int fp16, const uint16_t* const* biases, uint16_t* const* ys,
                   int64_t P, int64_t N, int64_t K, int64_t G, int nthreads) {
    int64_t first[P], start[P + 1];
    float* xf = inputs_f32(xs, ms, P, K, first);
    if (!xf) return -1;
    start[0] = 0;
    for (int64_t p = 0; p < P; p++) start[p + 1] = start[p] + units_of(bits, ms[p], N);
    const int64_t bytes = P * N * K * bits / 8;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (bytes >= MIN_PARALLEL_BYTES)
    for (int64_t i = 0; i < start[P]; i++) {
        const int64_t p = product_of(start, i);
        unit_of(bits, xf + first[p], ms[p], qs[p], scales[p], fp16, biases ? biases[p] : NULL, ys[p], N, K, G,
                i - start[p]);
    }
    free(xf);
    return 0;
}

/* int8 products (q [N, K] int8, scale [N] float32); see grouped. */
int hybridlm_linear_int8_grouped(const uint16_t* const* xs, const int64_t* ms, const int8_t* const* qs,
                                 const float* const* scales, const uint16_t* const* biases, uint16_t* const* ys,
                                 int64_t P, int64_t N, int64_t K, int nthreads) {
    return grouped(8, xs, ms, (const void* const*)qs, (const void* const*)scales, 0, biases, ys, P, N, K, 0,
                   nthreads);
}

/* x [M, K] bf16, q [N, K] int8, scale [N] float32, bias [N] bf16 or NULL, y [M, N] bf16: one product
   of hybridlm_linear_int8_grouped. Returns 0 or -1 (out of memory). */
int hybridlm_linear_int8(const uint16_t* x, int64_t M, const int8_t* q, const float* scale, const uint16_t* bias,
                         uint16_t* y, int64_t N, int64_t K, int nthreads) {
    return hybridlm_linear_int8_grouped(&x, &M, &q, &scale, &bias, &y, 1, N, K, nthreads);
}

/* int4 products (scales[p] [N, K / G] bf16, fp16 != 0: fp16); see grouped. */
int hybridlm_linear_int4_grouped(const uint16_t* const* xs, const int64_t* ms, const uint8_t* const* qs,
                                 const uint16_t* const* scales, int fp16, const uint16_t* const* biases,
                                 uint16_t* const* ys, int64_t P, int64_t N, int64_t K, int64_t G, int nthreads) {
    return grouped(4, xs, ms, (const void* const*)qs, (const void* const*)scales, fp16, biases, ys, P, N, K, G,
                   nthreads);
}

/* x [M, K] bf16, q [N, K / 2] packed int4 (see above), scales [N, K / G] bf16 (fp16 != 0: fp16),
   bias [N] bf16 or NULL, y [M, N] bf16; K % G == 0, G % 8 == 0: one product of
   hybridlm_linear_int4_grouped. Returns 0 or -1 (out of memory). */
int hybridlm_linear_int4(const uint16_t* x, int64_t M, const uint8_t* q, const uint16_t* scales, int fp16,
                         const uint16_t* bias, uint16_t* y, int64_t N, int64_t K, int64_t G, int nthreads) {
    return hybridlm_linear_int4_grouped(&x, &M, &q, &scales, fp16, &bias, &y, 1, N, K, G, nthreads);
}

/* One projection of a stack of quantized experts: bits (8 or 4), per expert its weight q and scales (see
   grouped), fp16 scales, group size G (int4). */
typedef struct {
    int bits, fp16;
    int64_t G;
    const void* const* q;
    const void* const* scales;
} projection;

/* The routed experts of a few tokens in one parallel region (models.moe.dispatch on decode rows): expert
   p's first product over its rows xs[p] [ms[p], D] (first.q[p] [N1, D]: gate rows then up rows when
   gated, N1 = 2·I, else up rows, N1 = I), the activation expert_hidden (bf16.h), its down product
   (down.q[p] [D, I]), then the pairs' outputs (expert p's rows after expert p - 1's) added into their
   tokens' rows of out [n, D] bf16 with their routing weights (combine.h: w, w_bf16, w_at, tokens, late).
   Each product is computed by the units of the linear kernels, so a row has the bits of its own calls
   whatever else the call holds. Returns 0 or -1 (out of memory). */
int hybridlm_moe_experts(const uint16_t* const* xs, const int64_t* ms, int64_t P, projection first,
                         projection down, int gated, const void* w, int w_bf16, const int64_t* w_at,
                         const int64_t* tokens, int64_t late, uint16_t* out, int64_t n, int64_t D, int64_t I,
                         int nthreads) {
    const int64_t N1 = gated ? 2 * I : I;
    int64_t xf_at[P], rows_before[P + 1], start1[P + 1], start2[P + 1];
    float* xf = inputs_f32(xs, ms, P, D, xf_at);
    if (!xf) return -1;
    rows_before[0] = start1[0] = start2[0] = 0;
    for (int64_t p = 0; p < P; p++) {
        rows_before[p + 1] = rows_before[p] + ms[p];
        start1[p + 1] = start1[p] + units_of(first.bits, ms[p], N1);
        start2[p + 1] = start2[p] + units_of(down.bits, ms[p], D);
    }
    const int64_t rows = rows_before[P];
    uint16_t *y1 = malloc((size_t)(rows * N1) * sizeof(uint16_t)), *ys = malloc((size_t)(rows * D) * 2);
    float *hf = malloc((size_t)(rows * I) * sizeof(float)), *acc = calloc((size_t)(n * D), sizeof(float));
    if (!y1 || !ys || !hf || !acc) {
        free(xf), free(y1), free(ys), free(hf), free(acc);
        return -1;
    }
    const int64_t bytes = P * D * (N1 * first.bits + I * down.bits) / 8;
    #pragma omp parallel num_threads(nthreads) if (bytes >= MIN_PARALLEL_BYTES)
    {
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < start1[P]; i++) {
            const int64_t p = product_of(start1, i);
            unit_of(first.bits, xf + xf_at[p], ms[p], first.q[p], first.scales[p], first.fp16, NULL,
                    y1 + rows_before[p] * N1, N1, D, first.G, i - start1[p]);
        }
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t j = 0; j < I; j++) hf[r * I + j] = expert_hidden(y1 + r * N1, I, j, gated);
        }
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < start2[P]; i++) {
            const int64_t p = product_of(start2, i);
            unit_of(down.bits, hf + rows_before[p] * I, ms[p], down.q[p], down.scales[p], down.fp16, NULL,
                    ys + rows_before[p] * D, D, I, down.G, i - start2[p]);
        }
        #pragma omp for schedule(static)
        for (int64_t c0 = 0; c0 < D; c0 += COMBINE_COLUMNS)
            combine_columns(ys, w, w_bf16, w_at, tokens, rows, late, acc, out, n, D, c0,
                            c0 + COMBINE_COLUMNS < D ? c0 + COMBINE_COLUMNS : D);
    }
    free(xf), free(y1), free(ys), free(hf), free(acc);
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

/* Rows [n0, n1) of an int4 weight [N, K] as bf16, transposed: wt [K, n1 - n0] (column n - n0 is row
   n, so a panel's 16 rows are 16 consecutive values), each q · scale rounded to bf16 once (to nearest
   even, as f32_to_bf16 and vcvtneps2bf16 both round; q · scale is exact in float32); n0 is a
   multiple of 16 and n1 one too or N (whole panels). */
void hybridlm_dequant_int4(const uint8_t* q, const uint16_t* scales, int fp16, uint16_t* wt, int64_t n0, int64_t n1,
                           int64_t N, int64_t K, int64_t G, int nthreads) {
    const int64_t cols = n1 - n0, groups = K / G;
    /* 8 inputs (8 rows of wt) at a time across every panel: the stores fill those rows in order
       (rows of wt are far apart: a column strip through many of them would keep missing L1) */
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < K / 8; b++) {
        const int64_t g = b * 8 / G;
        uint16_t* out = wt + b * 8 * cols;
        for (int64_t p0 = n0; p0 < n1; p0 += 16) {
            const int64_t width = N - p0 < 16 ? N - p0 : 16;
            const uint32_t* words = (const uint32_t*)(q + p0 * (K / 2)) + b * width;
            const uint16_t* s = scales + p0 * groups + g * width;
            uint16_t* o = out + (p0 - n0);
#if QUANT_SIMD
            /* lane n: row n of the panel; the word shifted right by 4t indexes q of input 8b + t */
            const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
            const uint16_t tail = width < 16 ? (uint16_t)((1u << width) - 1) : 0;
            const __mmask16 lanes = tail ? tail : 0xffff;
            const __m512 sv = scales_f32(s, fp16, tail);
            const __m512i raw = _mm512_maskz_loadu_epi32(lanes, words);
            for (int t = 0; t < 8; t++) {
                const __m512 v = _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 4 * t), table);
                _mm256_mask_storeu_epi16(o + t * cols, lanes, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(v, sv)));
            }
#else
            for (int64_t i = 0; i < width; i++) {
                const float scale = scale_f32(s[i], fp16);
                for (int t = 0; t < 8; t++)
                    o[t * cols + i] = f32_to_bf16((float)((int)((words[i] >> (4 * t)) & 15) - 8) * scale);
            }
#endif
        }
    }
}
