/* linear.c on this ISA against float64: y = x w^T + bias for 1..17 rows, each row equal to itself alone. */
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
    printf(failures ? "FAILED\n" : "ok\n");
    return failures != 0;
}
