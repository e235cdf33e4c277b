/* mode: 0 RMSNorm `w * r(norm)`, 1 OffsetRMSNorm `(1 + w) * norm`, 2 GatedRMSNorm
   `r(w * r(norm)) * silu(gate)`; r() (`round_to`) rounds to the activation dtype (bf16 only), as the
   reference's `.to(x.dtype)` does. */
#include "bf16.h"
#include <math.h>

/* x, gate, out [N, D]; w [D]; all bf16 when is_bf16, else float32. */
void hybridlm_rms_norm(const void* x, const void* w, const void* gate, void* out, int64_t N, int64_t D,
                       float eps, int mode, int is_bf16) {
    for (int64_t n = 0; n < N; n++) {
        const int64_t base = n * D;
        float ss = 0.f;
        for (int64_t i = 0; i < D; i++) { const float v = load(x, base + i, is_bf16); ss += v * v; }
        const float r = 1.f / sqrtf(ss / (float)D + eps);
        for (int64_t i = 0; i < D; i++) {
            const float v = load(x, base + i, is_bf16) * r, wi = load(w, i, is_bf16);
            float y;
            if (mode == 1) y = v * (1.f + wi);
            else {
                y = wi * round_to(v, is_bf16);
                if (mode == 2) {
                    const float g = load(gate, base + i, is_bf16);
                    y = round_to(y, is_bf16) * (g / (1.f + expf(-g)));
                }
            }
            store(out, base + i, y, is_bf16);
        }
    }
}
