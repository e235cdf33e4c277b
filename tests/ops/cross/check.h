/* Shared by the cross-ISA checks: a seeded generator, bf16 rounding and the tolerance of one bf16
   rounding of a float32-accumulated dot product against its float64 value. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static double uniform(void) {  /* [-1, 1) */
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(rng_state >> 11) / (double)(1ull << 52) - 1.0;
}
static uint16_t bf16_of(double v) { return f32_to_bf16((float)v); }

static int failures = 0;
/* y (bf16) is ref (float64) rounded once, up to float32 accumulation over `size` terms of `scale`. */
static void expect_close(const char* what, int64_t i, uint16_t y, double ref, double size) {
    const double got = bf16_to_f32(y);
    if (!(fabs(got - ref) <= fabs(ref) * 0x1p-8 + size * 1e-5)) {
        if (failures++ < 5) fprintf(stderr, "%s[%lld]: %g, want %g\n", what, (long long)i, got, ref);
    }
}
/* n pairs combining into themselves (the experts kernels' last step): pair p is token p, weight 1. */
static void own_pairs(float* weights, int64_t* rows, int n) {
    for (int p = 0; p < n; p++) weights[p] = 1.f, rows[p] = p;
}
/* h = bf16(relu(y)²), element by element: the experts kernels' non-gated activation. */
static void relu2_bf16(const uint16_t* y, int64_t n, uint16_t* h) {
    for (int64_t i = 0; i < n; i++) {
        const float g = bf16_to_f32(y[i]) > 0.f ? bf16_to_f32(y[i]) : 0.f;
        h[i] = f32_to_bf16(g * g);
    }
}
/* Row m of a call with M rows equals the same row computed alone. */
static void expect_same(const char* what, const uint16_t* a, const uint16_t* b, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (a[i] != b[i]) {
            if (failures++ < 5) fprintf(stderr, "%s: output %lld differs alone\n", what, (long long)i);
            return;
        }
}
