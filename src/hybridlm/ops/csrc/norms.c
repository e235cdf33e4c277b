/* mode: 0 RMSNorm `w * r(norm)`, 1 OffsetRMSNorm `(1 + w) * norm`, 2 GatedRMSNorm
   `r(w * r(norm)) * silu(gate)`, 3 Float32RMSNorm `w * norm` (Nemotron-H: the scale in float32);
   r() (`round_to`) rounds to the activation dtype (bf16 only), as the reference's `.to(x.dtype)` does.

   Every loop vectorizes: the sum of squares keeps SQUARE_LANES partial sums (`sum_squares` in
   bf16.h) added in a fixed tree at the end, and the gate's SiLU uses exp_fast. A row's numbers
   depend only on the row (its length and values), never on how many rows a call has or how many
   threads share them. */
#include "bf16.h"
#include <math.h>

/* One row; inlined with constant mode and is_bf16, so each variant is a straight vector loop. */
static inline __attribute__((always_inline)) void norm_row(const void* x, const void* w, const void* gate,
                                                           void* out, int64_t base, int64_t D, float eps,
                                                           int mode, int is_bf16) {
    const float r = 1.f / sqrtf(sum_squares(x, base, D, is_bf16) / (float)D + eps);
    for (int64_t i = 0; i < D; i++) {
        const float v = load(x, base + i, is_bf16) * r, wi = load(w, i, is_bf16);
        float y;
        if (mode == 1) y = v * (1.f + wi);
        else if (mode == 3) y = v * wi;
        else {
            y = wi * round_to(v, is_bf16);
            if (mode == 2) {
                const float g = load(gate, base + i, is_bf16);
                y = round_to(y, is_bf16) * (g / (1.f + exp_fast(-g)));
            }
        }
        store(out, base + i, y, is_bf16);
    }
}

/* Rows split over the threads only past a prompt chunk's few rows: a decode row's norm is ~1 us, less
   than waking the team. */
#define ROWS(mode, bf16) \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (N * D >= (1 << 16))") \
    for (int64_t n = 0; n < N; n++) norm_row(x, w, gate, out, n * D, D, eps, mode, bf16)

/* x, gate, out [N, D]; w [D]; all bf16 when is_bf16, else float32. */
void hybridlm_rms_norm(const void* x, const void* w, const void* gate, void* out, int64_t N, int64_t D,
                       float eps, int mode, int is_bf16, int nthreads) {
    if (is_bf16) {
        switch (mode) {
        case 0: ROWS(0, 1); break;
        case 1: ROWS(1, 1); break;
        case 3: ROWS(3, 1); break;
        default: ROWS(2, 1);
        }
    } else {
        switch (mode) {
        case 0: ROWS(0, 0); break;
        case 1: ROWS(1, 0); break;
        case 3: ROWS(3, 0); break;
        default: ROWS(2, 0);
        }
    }
}
