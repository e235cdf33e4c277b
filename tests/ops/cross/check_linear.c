/* linear.c on this ISA against float64: y = x w^T + bias for 1..17 rows, each row equal to itself alone;
   the experts kernel (relu², products of 1, 5 and 17 rows) equal to its products' own calls with the
   activation between. */
#include "linear.c"
#include "check.h"

int main(void) {
    const int64_t N = 77, K = 1000, M = 17;
    uint16_t *x = malloc(M * K * 2), *w = malloc(N * K * 2), *b = malloc(N * 2), *y = malloc(M * N * 2),
             *one = malloc(N * 2);
    for (int64_t i = 0; i < M * K; i++) x[i] = bf16_of(uniform());
    for (int64_t i = 0; i < N * K; i++) w[i] = bf16_of(uniform());
    for (int64_t i = 0; i < N; i++) b[i] = bf16_of(uniform());
    for (int64_t rows = 1; rows <= M; rows += 4) {
        if (hybridlm_linear_bf16(x, rows, w, b, y, N, K, 2)) return 2;
        for (int64_t m = 0; m < rows; m++) {
            for (int64_t n = 0; n < N; n++) {
                double ref = bf16_to_f32(b[n]), size = 0;
                for (int64_t k = 0; k < K; k++) {
                    const double p = (double)bf16_to_f32(x[m * K + k]) * bf16_to_f32(w[n * K + k]);
                    ref += p;
                    size += fabs(p);
                }
                expect_close("linear_bf16", m * N + n, y[m * N + n], ref, size);
            }
            if (hybridlm_linear_bf16(x + m * K, 1, w, b, one, N, K, 1)) return 2;
            expect_same("linear_bf16", y + m * N, one, N);
        }
    }
    /* experts: first [I, D] = w's rows, down [D, I] = w's first D·I values as a matrix */
    const int64_t D = K, I = N, ms[3] = {1, 5, 17};
    const uint16_t *xs[3] = {x, x + K, x}, *w1[3] = {w, w, w}, *w2[3] = {w, w, w};
    uint16_t *ys = malloc((1 + 5 + 17) * D * 2), *h = malloc(M * I * 2), *y2 = malloc(M * D * 2);
    float ones[23]; /* each pair its own token, weight 1: the combined rows are the pairs' outputs */
    int64_t each[23];
    own_pairs(ones, each, 23);
    if (hybridlm_moe_experts_bf16(xs, ms, 3, w1, w2, 0, ones, 0, each, each, ys, 23, D, I, 2)) return 2;
    for (int64_t p = 0, row = 0; p < 3; row += ms[p], p++) {
        if (hybridlm_linear_bf16(xs[p], ms[p], w, NULL, y, I, D, 1)) return 2;
        relu2_bf16(y, ms[p] * I, h);
        if (hybridlm_linear_bf16(h, ms[p], w, NULL, y2, D, I, 1)) return 2;
        expect_same("experts", ys + row * D, y2, ms[p] * D);
    }
    printf(failures ? "FAILED\n" : "ok\n");
    return failures != 0;
}
