/* quant.c on this ISA against float64: int8 (per-row scales) and int4 (groups of 32, panels of 16 rows,
   a short last panel) decode products for 1..17 rows, each row equal to itself alone; grouped calls
   (products of 1, 5 and 17 rows) equal to one call per product; the experts kernel (relu², an int4
   first and an int8 down product) equal to those products' own calls with the activation between. */
#include "quant.c"
#include "check.h"

int main(void) {
    const int64_t N = 37, K = 256, M = 17, G = 32, groups = K / G;
    uint16_t *x = malloc(M * K * 2), *b = malloc(N * 2), *y = malloc(M * N * 2), *one = malloc(N * 2);
    int8_t* q8 = malloc(N * K);
    int* q4 = malloc(N * K * sizeof(int));
    float* s8 = malloc(N * 4);
    uint16_t* s4 = malloc(N * groups * 2);
    uint32_t* packed = calloc(N * K / 8, 4);
    uint16_t* panel_scales = malloc(N * groups * 2);
    for (int64_t i = 0; i < M * K; i++) x[i] = bf16_of(uniform());
    for (int64_t i = 0; i < N; i++) b[i] = bf16_of(uniform()), s8[i] = (float)(0.01 + 0.005 * uniform());
    for (int64_t i = 0; i < N * K; i++) q8[i] = (int8_t)lrint(127 * uniform()), q4[i] = (int)lrint(7.49 * uniform());
    for (int64_t i = 0; i < N * groups; i++) s4[i] = bf16_of(0.02 + 0.01 * uniform());
    for (int64_t n = 0; n < N; n++) {  /* the documented panel layout */
        const int64_t p0 = n / 16 * 16, width = N - p0 < 16 ? N - p0 : 16, r = n - p0;
        for (int64_t k = 0; k < K; k++)
            packed[p0 * (K / 8) + k / 8 * width + r] |= (uint32_t)(q4[n * K + k] + 8) << (4 * (k % 8));
        for (int64_t g = 0; g < groups; g++) panel_scales[p0 * groups + g * width + r] = s4[n * groups + g];
    }
    for (int bits = 8; bits >= 4; bits -= 4)
        for (int64_t rows = 1; rows <= M; rows += 4) {
            const int status = bits == 8 ? hybridlm_linear_int8(x, rows, q8, s8, b, y, N, K, 2)
                                         : hybridlm_linear_int4(x, rows, (const uint8_t*)packed, panel_scales, 0, b,
                                                                y, N, K, G, 2);
            if (status) return 2;
            for (int64_t m = 0; m < rows; m++) {
                for (int64_t n = 0; n < N; n++) {
                    double ref = bf16_to_f32(b[n]), size = 0;
                    for (int64_t k = 0; k < K; k++) {
                        const double xv = bf16_to_f32(x[m * K + k]);
                        const double wv = bits == 8 ? q8[n * K + k] * (double)s8[n]
                                                    : q4[n * K + k] * (double)bf16_to_f32(s4[n * groups + k / G]);
                        ref += xv * wv;
                        size += fabs(xv * wv);
                    }
                    expect_close(bits == 8 ? "int8" : "int4", m * N + n, y[m * N + n], ref, size);
                }
                const int alone = bits == 8 ? hybridlm_linear_int8(x + m * K, 1, q8, s8, b, one, N, K, 1)
                                            : hybridlm_linear_int4(x + m * K, 1, (const uint8_t*)packed, panel_scales,
                                                                   0, b, one, N, K, G, 1);
                if (alone) return 2;
                expect_same(bits == 8 ? "int8" : "int4", y + m * N, one, N);
            }
        }
    const int64_t ms[3] = {1, 5, 17};
    const uint16_t* xs[3] = {x, x + K, x};
    uint16_t* outs[3];
    for (int p = 0; p < 3; p++) outs[p] = malloc(ms[p] * N * 2);
    for (int bits = 8; bits >= 4; bits -= 4) {
        const int8_t* q8s[3] = {q8, q8, q8};
        const float* s8s[3] = {s8, s8, s8};
        const uint8_t* q4s[3] = {(const uint8_t*)packed, (const uint8_t*)packed, (const uint8_t*)packed};
        const uint16_t* s4s[3] = {panel_scales, panel_scales, panel_scales};
        const int status = bits == 8 ? hybridlm_linear_int8_grouped(xs, ms, q8s, s8s, NULL, outs, 3, N, K, 2)
                                     : hybridlm_linear_int4_grouped(xs, ms, q4s, s4s, 0, NULL, outs, 3, N, K, G, 2);
        if (status) return 2;
        for (int p = 0; p < 3; p++) {
            const int alone = bits == 8 ? hybridlm_linear_int8(xs[p], ms[p], q8, s8, NULL, y, N, K, 1)
                                        : hybridlm_linear_int4(xs[p], ms[p], (const uint8_t*)packed, panel_scales, 0,
                                                               NULL, y, N, K, G, 1);
            if (alone) return 2;
            expect_same(bits == 8 ? "int8 grouped" : "int4 grouped", outs[p], y, ms[p] * N);
        }
    }
    const int64_t D = K, I = N; /* first [I, D]: the int4 weights above; down [D, I] int8 */
    int8_t* qd = malloc(D * I);
    float* sd = malloc(D * 4);
    for (int64_t i = 0; i < D * I; i++) qd[i] = (int8_t)lrint(127 * uniform());
    for (int64_t i = 0; i < D; i++) sd[i] = (float)(0.01 + 0.005 * uniform());
    const void *q1[3] = {packed, packed, packed}, *s1[3] = {panel_scales, panel_scales, panel_scales};
    const void *q2[3] = {qd, qd, qd}, *s2[3] = {sd, sd, sd};
    const projection first = {4, 0, G, q1, s1}, down = {8, 0, 0, q2, s2};
    uint16_t *ys = malloc((1 + 5 + 17) * D * 2), *h = malloc(M * I * 2), *y2 = malloc(M * D * 2);
    float ones[23]; /* each pair its own token, weight 1: the combined rows are the pairs' outputs */
    int64_t each[23];
    own_pairs(ones, each, 23);
    if (hybridlm_moe_experts(xs, ms, 3, first, down, 0, ones, 0, each, each, 0, ys, 23, D, I, 2)) return 2;
    for (int64_t p = 0, row = 0; p < 3; row += ms[p], p++) {
        if (hybridlm_linear_int4(xs[p], ms[p], (const uint8_t*)packed, panel_scales, 0, NULL, y, I, D, G, 1)) return 2;
        relu2_bf16(y, ms[p] * I, h);
        if (hybridlm_linear_int8(h, ms[p], qd, sd, NULL, y2, D, I, 1)) return 2;
        expect_same("experts", ys + row * D, y2, ms[p] * D);
    }
    printf(failures ? "FAILED\n" : "ok\n");
    return failures != 0;
}
