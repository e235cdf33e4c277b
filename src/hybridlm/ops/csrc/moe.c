/* The routed experts' outputs added into their tokens' rows (`ops.moe.combine`): combine.h's sum, over
   units of COMBINE_COLUMNS columns in parallel; and a gated MLP's hidden rows computed as the experts
   kernels compute an expert's (`ops.elementwise.gated_rows`). */
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
        combine_columns(ys, w, w_bf16, w_at, tokens, pairs, 0, acc, out, n, d, c0, c1);
    }
    free(acc);
    return 0;
}

/* out [M, I] = silu_times(gate, up) (bf16.h) of gate [M, I] and up [M, I], bf16, their rows `gate_stride`
   and `up_stride` elements apart (the halves of one fused product, or two products): the hidden rows of
   a gated MLP with the bits the experts kernels give an expert's, so that a shared expert computed apart
   equals the same expert computed inside them. Each element depends only on its own two inputs. */
void hybridlm_gated_silu(const uint16_t* gate, int64_t gate_stride, const uint16_t* up, int64_t up_stride,
                         uint16_t* out, int64_t M, int64_t I) {
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *g = gate + m * gate_stride, *u = up + m * up_stride;
        uint16_t* o = out + m * I;
        for (int64_t j = 0; j < I; j++) o[j] = f32_to_bf16(silu_times(bf16_to_f32(g[j]), bf16_to_f32(u[j])));
    }
}
