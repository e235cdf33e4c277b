/* The routed experts' outputs added into their tokens' rows (`ops.moe.combine`, for
   `models.moe.dispatch`): pair p (a token's product with one of its experts) adds y[p] times its
   routing weight w[w_at[p]] into row tokens[p]; the rows start at zero, add in float32 in pair order
   and are rounded to bf16 once. The product is a float32 multiply, rounded to bf16 first when the
   weights are bf16 (torch's `ys * w` in the weights' dtype): exactly what `index_add_` over
   `(ys * w).float()` computes, for every row, whatever else the call holds.

   No product may fuse with the add that follows it (an FMA would round once where torch rounds
   twice), hence contraction off for the whole file, helpers included. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include "bf16.h"
#include <stdlib.h>

#define COLUMNS 256 /* columns per unit of work: every pair's slice of them is added in order */

/* ys [pairs, d] bf16; w: routing weights (bf16 when w_bf16, else float32), w_at [pairs] the index
   of pair p's weight; tokens [pairs] its row of out [n, d] bf16. 0, or -1 when out of memory. */
int hybridlm_moe_combine(const uint16_t* ys, const void* w, int w_bf16, const int64_t* w_at,
                         const int64_t* tokens, int64_t pairs, uint16_t* out, int64_t n, int64_t d,
                         int threads) {
    float* acc = calloc((size_t)(n * d), sizeof(float));
    if (!acc) return -1;
    const int64_t units = (d + COLUMNS - 1) / COLUMNS;
#pragma omp parallel for num_threads(threads) schedule(static) if (pairs * d >= (1 << 16))
    for (int64_t u = 0; u < units; u++) {
        const int64_t c0 = u * COLUMNS, c1 = c0 + COLUMNS < d ? c0 + COLUMNS : d;
        for (int64_t p = 0; p < pairs; p++) {
            const float wp = load(w, w_at[p], w_bf16);
            const uint16_t* y = ys + p * d;
            float* row = acc + tokens[p] * d;
            for (int64_t c = c0; c < c1; c++) row[c] += round_to(bf16_to_f32(y[c]) * wp, w_bf16);
        }
        for (int64_t t = 0; t < n; t++)
            for (int64_t c = c0; c < c1; c++) out[t * d + c] = f32_to_bf16(acc[t * d + c]);
    }
    free(acc);
    return 0;
}
