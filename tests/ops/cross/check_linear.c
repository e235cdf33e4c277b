/* linear.c on this ISA against float64: y = x w^T + bias for 1..17 rows, each row equal to itself alone;
   the experts kernel (relu², products of 1, 5 and 17 rows) equal to its products' own calls with the
   activation between; the router kernel's softmax top 3 of 77 experts against float64, each row equal
   to itself alone; moe.c's gated silu rows against float64. */
#include "linear.c"
#include "moe.c"
#include "check.h"

/* Row m's routing (softmax over the bf16 logits, top k, renormalised) against float64: the chosen are
   a top k (ties either way) and their weights the renormalised probabilities. */
static void expect_routes(const uint16_t* logits, int64_t E, int k, const int64_t* chosen, const float* w) {
    double top = -INFINITY, sum = 0, p[E], picked = 0;
    for (int64_t e = 0; e < E; e++) top = fmax(top, bf16_to_f32(logits[e]));
    for (int64_t e = 0; e < E; e++) sum += p[e] = exp(bf16_to_f32(logits[e]) - top);
    double least = INFINITY, most_left = -INFINITY;
    for (int j = 0; j < k; j++) least = fmin(least, p[chosen[j]]), picked += p[chosen[j]];
    for (int64_t e = 0; e < E; e++) {
        int in = 0;
        for (int j = 0; j < k; j++) in |= chosen[j] == e;
        if (!in) most_left = fmax(most_left, p[e]);
    }
    if (least < most_left && failures++ < 5) fprintf(stderr, "route: not a top %d\n", k);
    for (int j = 0; j < k; j++)
        if (fabs(w[j] - p[chosen[j]] / picked) > 1e-5 * p[chosen[j]] / picked && failures++ < 5)
            fprintf(stderr, "route: weight %d %g, want %g\n", j, w[j], p[chosen[j]] / picked);
}

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
    if (hybridlm_moe_experts_bf16(xs, ms, 3, w1, w2, 0, ones, 0, each, each, 0, ys, 23, D, I, 2)) return 2;
    for (int64_t p = 0, row = 0; p < 3; row += ms[p], p++) {
        if (hybridlm_linear_bf16(xs[p], ms[p], w, NULL, y, I, D, 1)) return 2;
        relu2_bf16(y, ms[p] * I, h);
        if (hybridlm_linear_bf16(h, ms[p], w, NULL, y2, D, I, 1)) return 2;
        expect_same("experts", ys + row * D, y2, ms[p] * D);
    }
    /* router: w's 77 rows as the router, top 3, softmax, renormalised */
    int64_t index[M * 3], one_index[3];
    float weights[M * 3], one_weights[3];
    if (hybridlm_moe_route(x, M, K, w, N, 0, NULL, 0, NULL, 1, 1, 3, 1, 1.f, 0.f, -1, 0, weights, index, NULL)) return 2;
    if (hybridlm_linear_bf16(x, M, w, NULL, y, N, K, 1)) return 2;
    for (int64_t m = 0; m < M; m++) {
        expect_routes(y + m * N, N, 3, index + m * 3, weights + m * 3);
        if (hybridlm_moe_route(x + m * K, 1, K, w, N, 0, NULL, 0, NULL, 1, 1, 3, 1, 1.f, 0.f, -1, 0, one_weights,
                               one_index, NULL)) return 2;
        if (memcmp(one_index, index + m * 3, sizeof one_index) || memcmp(one_weights, weights + m * 3, sizeof one_weights))
            if (failures++ < 5) fprintf(stderr, "route: row %lld differs alone\n", (long long)m);
    }
    /* gated silu: x's rows as gates, w's as ups */
    hybridlm_gated_silu(x, K, w, K, y2, M, K);
    for (int64_t i = 0; i < M * K; i++) {
        const double g = bf16_to_f32(x[i]), u = bf16_to_f32(w[i]), want = g / (1 + exp(-g)) * u;
        if (fabs(bf16_to_f32(y2[i]) - want) > fabs(want) * 0x1p-7 + 1e-30 && failures++ < 5)
            fprintf(stderr, "gated_silu[%lld]: %g, want %g\n", (long long)i, bf16_to_f32(y2[i]), want);
    }
    printf(failures ? "FAILED\n" : "ok\n");
    return failures != 0;
}
