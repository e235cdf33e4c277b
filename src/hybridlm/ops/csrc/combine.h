/* The routed experts' outputs added into their tokens' rows (models.moe.dispatch), shared by moe.c's
   combine and the experts kernels: pair p (a token's product with one of its experts) adds ys[p] times
   its routing weight w[w_at[p]] into row tokens[p]; the rows start at zero, add in float32 in pair order
   and are rounded to bf16 once. The product is a float32 multiply, rounded to bf16 first when the
   weights are bf16 (torch's `ys * w` in the weights' dtype): what `index_add_` over `(ys * w).float()`
   computes, for every row, whatever else the call holds. The last `late` pairs (a shared expert computed
   in the same call) are added after that rounding, each rounding the row again: torch's bf16 `out + y`
   for an output y computed apart, so the row keeps those bits. */
#ifndef HYBRIDLM_COMBINE_H
#define HYBRIDLM_COMBINE_H
#include "bf16.h"

#define COMBINE_COLUMNS 256 /* columns per unit of work: every pair's slice of them is added in order */

/* Columns [c0, c1) of out [n, d] bf16 from ys [pairs, d] bf16; acc [n, d] float32, zero in those columns.
   No product may fuse with the add that follows it (an FMA would round once where torch rounds twice):
   contraction is off in this function, which is never inlined into code compiled with it on. */
#if defined(__clang__)
__attribute__((noinline))
#else
__attribute__((noinline, optimize("fp-contract=off")))
#endif
static void combine_columns(const uint16_t* ys, const void* w, int w_bf16, const int64_t* w_at,
                            const int64_t* tokens, int64_t pairs, int64_t late, float* acc, uint16_t* out,
                            int64_t n, int64_t d, int64_t c0, int64_t c1) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    for (int64_t p = 0; p < pairs - late; p++) {
        const float wp = load(w, w_at[p], w_bf16);
        const uint16_t* y = ys + p * d;
        float* row = acc + tokens[p] * d;
        for (int64_t c = c0; c < c1; c++) row[c] += round_to(bf16_to_f32(y[c]) * wp, w_bf16);
    }
    if (late > 0)
        for (int64_t t = 0; t < n; t++)
            for (int64_t c = c0; c < c1; c++) acc[t * d + c] = round_to(acc[t * d + c], 1);
    for (int64_t p = pairs - late; p < pairs; p++) {
        const float wp = load(w, w_at[p], w_bf16);
        const uint16_t* y = ys + p * d;
        float* row = acc + tokens[p] * d;
        for (int64_t c = c0; c < c1; c++) row[c] = round_to(row[c] + round_to(bf16_to_f32(y[c]) * wp, w_bf16), 1);
    }
    for (int64_t t = 0; t < n; t++)
        for (int64_t c = c0; c < c1; c++) out[t * d + c] = f32_to_bf16(acc[t * d + c]);
}
#endif
