/* The routed experts' outputs added into their tokens' rows (`ops.moe.combine`): combine.h's sum, over
   units of COMBINE_COLUMNS columns in parallel. */
#include "combine.h"
#include <stdlib.h>

/* ys [pairs, d] bf16; w: routing weights (bf16 when w_bf16, else float32), w_at [pairs] the index
   of pair p's weight; tokens [pairs] its row of out [n, d] bf16. 0, or -1 when out of memory. */
int hybridlm_moe_combine(const uint16_t* ys, const void* w, int w_bf16, const int64_t* w_at,
                         const int64_t* tokens, int64_t pairs, uint16_t* out, int64_t n, int64_t d,
                         int threads) {
    float* acc = calloc((size_t)(n * d), sizeof(float));
    if (!acc) return -1;
    const int64_t units = (d + COMBINE_COLUMNS - 1) / COMBINE_COLUMNS;
#pragma omp parallel for num_threads(threads) schedule(static) if (pairs * d >= (1 << 16))
    for (int64_t u = 0; u < units; u++) {
        const int64_t c0 = u * COMBINE_COLUMNS, c1 = c0 + COMBINE_COLUMNS < d ? c0 + COMBINE_COLUMNS : d;
        combine_columns(ys, w, w_bf16, w_at, tokens, pairs, acc, out, n, d, c0, c1);
    }
    free(acc);
    return 0;
}
