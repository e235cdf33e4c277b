/* Few-token inputs (decode, speculative verify) run one C loop instead of a dozen small ATen ops
   (decode) or a oneDNN convolution set up for long inputs (~1.5 ms for 9 tokens x 6144 channels).
   It rounds where the torch path does: the sum once to bf16, the activation once more. */
#include "bf16.h"
#include <stdlib.h>

/* exp(x) to ~2 ulp (Cephes' expf), without branches or calls so that loops over it vectorize
   (a libm expf per channel was most of the kernel's time). */
static inline float exp_fast(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round to nearest */
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return y * scale;
}

/* Row r of xp = prior ‖ x of one sequence (r < K-1: prior), as bytes. */
static inline const char* xp_row(const char* x, const char* prior, int64_t r, int64_t K, int64_t C,
                                 size_t es) {
    return r < K - 1 ? prior + r * C * es : x + (r - (K - 1)) * C * es;
}

/* The taps transposed to wt [K, C] and the bias (zeros without one) to bz [C], as float32. */
static void load_taps(const void* weight, const void* bias, float* wt, float* bz, int64_t C, int64_t K,
                      int is_bf16) {
    const uint16_t *w16 = weight, *b16 = bias;
    const float *w32 = weight, *b32 = bias;
    for (int64_t c = 0; c < C; c++) {
        for (int64_t j = 0; j < K; j++)
            wt[j * C + c] = is_bf16 ? bf16_to_f32(w16[c * K + j]) : w32[c * K + j];
        bz[c] = !bias ? 0.f : is_bf16 ? bf16_to_f32(b16[c]) : b32[c];
    }
}

/* One sequence: x [L, C] after prior [K-1, C] -> out [L, C], with acc [C] scratch. Per output: the
   K products summed in tap order, plus the bias, rounded to the element type, then SiLU, rounded
   again. Both entry points run exactly this, so a sequence's numbers never depend on its batch. */
static void conv_rows(const char* x, const char* prior, const float* wt, const float* bz, float* acc,
                      void* out, int64_t L, int64_t C, int64_t K, int silu, int is_bf16) {
    const size_t es = is_bf16 ? 2 : 4;
    for (int64_t t = 0; t < L; t++) {
        for (int64_t c = 0; c < C; c++) acc[c] = 0.f;
        for (int64_t j = 0; j < K; j++) {
            const char* row = xp_row(x, prior, t + j, K, C, es);
            const float* restrict w = wt + j * C;
            if (is_bf16) {
                const uint16_t* restrict xr = (const uint16_t*)row;
                for (int64_t c = 0; c < C; c++) acc[c] += w[c] * bf16_to_f32(xr[c]);
            } else {
                const float* restrict xr = (const float*)row;
                for (int64_t c = 0; c < C; c++) acc[c] += w[c] * xr[c];
            }
        }
        if (is_bf16) {
            uint16_t* restrict o = (uint16_t*)out + t * C;
            for (int64_t c = 0; c < C; c++) {
                float y = bf16_to_f32(f32_to_bf16(acc[c] + bz[c]));
                if (silu) y = y / (1.f + exp_fast(-y));
                o[c] = f32_to_bf16(y);
            }
        } else {
            float* restrict o = (float*)out + t * C;
            for (int64_t c = 0; c < C; c++) {
                const float y = acc[c] + bz[c];
                o[c] = silu ? y / (1.f + exp_fast(-y)) : y;
            }
        }
    }
}

/* One sequence's tails: the K-1 rows of prior ‖ x after `real` tokens into tail, and after
   min(splits[i], real) tokens into bounds[i] + boff (bytes). */
static void copy_tails(const char* x, const char* prior, char* tail, void** bounds, int64_t boff,
                       const int64_t* splits, int64_t nsplit, int64_t real, int64_t C, int64_t K,
                       size_t es) {
    for (int64_t i = -1; i < nsplit; i++) {
        const int64_t end = i < 0 ? real : (splits[i] < real ? splits[i] : real);
        char* dst = i < 0 ? tail : (char*)bounds[i] + boff;
        for (int64_t r = 0; r < K - 1; r++)
            memcpy(dst + r * C * es, xp_row(x, prior, end + r, K, C, es), C * es);
    }
}

/* x [B, L, C], prior [B, K-1, C], weight [C, K], bias [C] or NULL -> out [B, L, C],
   tail [B, K-1, C] after each row's lens[b] (or L) tokens, bounds[i] [B, K-1, C] after
   min(splits[i], lens[b]) tokens. All bf16 when is_bf16, else float32 (conv_rows says how it rounds).
   Returns 0, or -1 when out of memory. */
int hybridlm_conv_short(const void* x, const void* prior, const void* weight, const void* bias,
                        void* out, void* tail, void** bounds, const int64_t* splits, int64_t nsplit,
                        const int64_t* lens, int64_t B, int64_t L, int64_t C, int64_t K, int silu,
                        int is_bf16, int nthreads) {
    (void)nthreads;
    const size_t es = is_bf16 ? 2 : 4;
    float* wt = malloc(sizeof(float) * (K + 2) * C);  /* taps transposed [K, C], bias, sums */
    if (!wt) return -1;
    float *bz = wt + K * C, *acc = bz + C;
    load_taps(weight, bias, wt, bz, C, K, is_bf16);
    for (int64_t b = 0; b < B; b++)
        conv_rows((const char*)x + b * L * C * es, (const char*)prior + b * (K - 1) * C * es, wt, bz, acc,
                  (char*)out + b * L * C * es, L, C, K, silu, is_bf16);
    free(wt);
    for (int64_t b = 0; b < B; b++)
        copy_tails((const char*)x + b * L * C * es, (const char*)prior + b * (K - 1) * C * es,
                   (char*)tail + b * (K - 1) * C * es, bounds, b * (K - 1) * C * es, splits, nsplit,
                   lens ? lens[b] : L, C, K, es);
    return 0;
}

/* Several sequences packed end to end in one call (decode and verify rows of many sequences):
   x and out [T, C] hold sequence i's rows at [starts[i], starts[i] + lens[i]); priors[i] is its own
   [K-1, C] tail before them, tails[i] receives its [K-1, C] tail after them and, for its splits
   splits[split_starts[i] .. split_starts[i+1]), the matching bounds entries ([K-1, C]) the tail
   after each. Rows outside every sequence are not touched. Each sequence runs conv_rows as
   hybridlm_conv_short would on it alone (same bits); sequences run in parallel. Returns 0, or -1
   when out of memory. */
int hybridlm_conv_short_packed(const void* x, const void** priors, const void* weight, const void* bias,
                               void* out, void** tails, void** bounds, const int64_t* splits,
                               const int64_t* split_starts, const int64_t* starts, const int64_t* lens,
                               int64_t nseq, int64_t C, int64_t K, int silu, int is_bf16, int nthreads) {
    const size_t es = is_bf16 ? 2 : 4;
    float* wt = malloc(sizeof(float) * (K + 1) * C);  /* taps transposed [K, C], bias */
    if (!wt) return -1;
    float* bz = wt + K * C;
    load_taps(weight, bias, wt, bz, C, K, is_bf16);
    int failed = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        float* acc = malloc(sizeof(float) * C);
        if (!acc) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < nseq; i++) {
            if (!acc) continue;
            const char* xs = (const char*)x + starts[i] * C * es;
            const int64_t first = split_starts[i];
            conv_rows(xs, priors[i], wt, bz, acc, (char*)out + starts[i] * C * es, lens[i], C, K, silu,
                      is_bf16);
            copy_tails(xs, priors[i], tails[i], bounds + first, 0, splits + first,
                       split_starts[i + 1] - first, lens[i], C, K, es);
        }
        free(acc);
    }
    free(wt);
    return failed ? -1 : 0;
}
