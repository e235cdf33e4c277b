/* Shared by the kernels: bf16 conversions and element access (bf16 is the upper half of an fp32),
   a vectorizable exp, and the norms' fixed-order sum of squares. */
#ifndef HYBRIDLM_BF16_H
#define HYBRIDLM_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f;
}
/* f rounded to bf16 (to nearest even; a NaN stays a NaN), in the upper half of a float32's bits. All
   32-bit operations and a select, so that loops calling it vectorize. */
static inline uint32_t bf16_bits(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x00400000u) & 0xffff0000u : rounded;
}
static inline uint16_t f32_to_bf16(float f) { return (uint16_t)(bf16_bits(f) >> 16); }
/* Element i of a bf16 (bf16 != 0) or float32 array, as float32; and back. Always inlined, so that a
   loop calling them with a constant `bf16` is a straight vector loop. */
static inline __attribute__((always_inline)) float load(const void* p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}
static inline __attribute__((always_inline)) void store(void* p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t*)p)[i] = f32_to_bf16(v); else ((float*)p)[i] = v;
}
/* v rounded as a bf16 tensor op would round its result (identity for float32) */
static inline float round_to(float v, int bf16) {
    if (!bf16) return v;
    const uint32_t u = bf16_bits(v);
    float r; memcpy(&r, &u, 4); return r;
}
/* exp(x) to ~2 ulp (Cephes' expf), without branches or calls so that loops over it vectorize
   (a libm expf per channel was most of the kernel's time). */
static inline float exp_fast(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round to nearest */
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return y * scale;
}
/* silu(g) rounded to bf16, times u, rounded to bf16: torch's bf16 silu and multiply, with exp_fast. */
static inline __attribute__((always_inline)) float silu_times(float g, float u) {
    return round_to(round_to(g / (1.f + exp_fast(-g)), 1) * u, 1);
}
/* Element j < I of an expert's hidden row from its first product y (bf16): gated, y = gate ‖ up [2·I]
   and the hidden value is silu_times(gate, up); not gated, y [I] and it is relu(y)² rounded to bf16
   (Nemotron-H's relu² experts). The experts kernels of quant.c, quant_prefill.c and linear.c, so a
   hidden row has the same bits in each, and moe.c's gated MLP rows. */
static inline __attribute__((always_inline)) float expert_hidden(const uint16_t* y, int64_t I, int64_t j,
                                                                 int gated) {
    const float g = bf16_to_f32(y[j]);
    if (gated) return silu_times(g, bf16_to_f32(y[I + j]));
    const float r = g > 0.f ? g : 0.f;
    return round_to(r * r, 1);
}
/* Σ x[base + i]² over i < D: SQUARE_LANES partial sums (element i into lane i % SQUARE_LANES) added in a
   fixed tree, then the elements past the last full block one by one; the loop vectorizes, and the sum
   depends only on the D values (the norms of norms.c and mamba2.c). */
#define SQUARE_LANES 16
static inline __attribute__((always_inline)) float sum_squares(const void* x, int64_t base, int64_t D,
                                                               int is_bf16) {
    float part[SQUARE_LANES] = {0.f};
    int64_t i = 0;
    for (; i + SQUARE_LANES <= D; i += SQUARE_LANES)
        for (int l = 0; l < SQUARE_LANES; l++) {
            const float v = load(x, base + i + l, is_bf16);
            part[l] += v * v;
        }
    for (int half = SQUARE_LANES / 2; half > 0; half /= 2)
        for (int l = 0; l < half; l++) part[l] += part[l + half];
    float ss = part[0];
    for (; i < D; i++) {
        const float v = load(x, base + i, is_bf16);
        ss += v * v;
    }
    return ss;
}
#endif
