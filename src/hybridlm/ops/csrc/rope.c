/* Rotary position embedding, rotate-half layout, of bf16 rows: the first `rot` dims of each row
   rotated, the rest copied. Rounded where torch's bf16 ops round `x * cos + rotate_half(x) * sin`:
   each product to bf16, then their sum (negation and concatenation are exact), so the result equals
   the composed torch ops bit for bit at any shape. A row's numbers depend only on the row and its
   position's table. */
#include "bf16.h"

/* x [B, H, L, D] bf16 with element strides sb, sh, sl (D contiguous: a [B, L, H, D] projection
   viewed as heads-first); out [B, H, L, D] contiguous; cos, sin [B, L, rot] contiguous bf16 (one
   table row per position, shared by the H heads). Rows are split among `threads` threads from
   2^16 elements on. */
void hybridlm_rotary(const uint16_t* x, int64_t sb, int64_t sh, int64_t sl, const uint16_t* cos,
                     const uint16_t* sin, uint16_t* out, int64_t B, int64_t H, int64_t L, int64_t D,
                     int64_t rot, int threads) {
    const int64_t half = rot / 2, rows = B * H * L;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * D >= (1 << 16))
    for (int64_t row = 0; row < rows; row++) {
        const int64_t b = row / (H * L), h = row / L % H, l = row % L;
        const uint16_t* xr = x + b * sb + h * sh + l * sl;
        uint16_t* yr = out + row * D;
        const uint16_t* c = cos + (b * L + l) * rot;
        const uint16_t* s = sin + (b * L + l) * rot;
        for (int64_t i = 0; i < rot; i++) {
            const float r = i < half ? -bf16_to_f32(xr[i + half]) : bf16_to_f32(xr[i - half]);
            const float a = round_to(bf16_to_f32(xr[i]) * bf16_to_f32(c[i]), 1);
            const float p = round_to(r * bf16_to_f32(s[i]), 1);
            yr[i] = f32_to_bf16(a + p);
        }
        for (int64_t i = rot; i < D; i++) yr[i] = xr[i];
    }
}
