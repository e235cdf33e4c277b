/* The Mamba-2 step recurrence (ops/mamba2.py), every token in order, per (row, head) in one loop:
   the torch step form runs ~8 small ATen ops a token and layer. Each (row, head) reads its token's x,
   B, C straight from the conv output [L, x ‖ B ‖ C] and keeps its [P, N] float32 state in place.
   A token's arithmetic never depends on how many tokens the call holds or on the rows beside it, so
   decode steps, verify passes, recorded prefills and replays all give the same bits. */
#include "bf16.h"
#include <math.h>
#include <string.h>

/* torch's softplus (threshold 20: above it, x itself) */
static inline float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

/* One (row, head): tokens [0, L) of x (the conv output of this row, [L, conv_dim]) and dt ([L, H]),
   the first `real` of them real (later ones are identity steps with zero output). s [P, N] is the
   state, advanced in place; after token t, for every split == t + 1, s is copied to
   bounds[i] + offset. y [L, H, P] float32. */
static void scan_head(const char* x, const char* dt, float A, float bias, float D, float lo, float hi,
                      float* s, float* y, float** bounds, int64_t offset, const int64_t* splits,
                      int64_t nsplit, int64_t L, int64_t real, int64_t h, int64_t H, int64_t P,
                      int64_t G, int64_t N, int is_bf16) {
    const int64_t inner = H * P, g = h / (H / G), conv_dim = inner + 2 * G * N;
    const size_t es = is_bf16 ? 2 : 4;
    for (int64_t i = 0; i < nsplit; i++)
        if (splits[i] == 0) memcpy(bounds[i] + offset, s, sizeof(float) * P * N);
    for (int64_t t = 0; t < L; t++) {
        float* yt = y + (t * H + h) * P;
        if (t < real) {
            const char* row = x + t * conv_dim * es;
            float delta = softplus(load(dt, t * H + h, is_bf16) + bias);
            delta = delta < lo ? lo : (delta > hi ? hi : delta);
            const float decay = expf(delta * A);
            const int64_t b0 = inner + g * N, c0 = inner + G * N + g * N;
            for (int64_t p = 0; p < P; p++) {
                const float xp = load(row, h * P + p, is_bf16), xd = xp * delta;
                float* sp = s + p * N;
                float acc = 0.f;
                for (int64_t n = 0; n < N; n++) {
                    sp[n] = sp[n] * decay + xd * load(row, b0 + n, is_bf16);
                    acc += sp[n] * load(row, c0 + n, is_bf16);
                }
                yt[p] = acc + D * xp;
            }
        } else {
            for (int64_t p = 0; p < P; p++) yt[p] = 0.f;
        }
        for (int64_t i = 0; i < nsplit; i++)
            if (splits[i] == t + 1) memcpy(bounds[i] + offset, s, sizeof(float) * P * N);
    }
}

/* xbc [B, L, H*P + 2*G*N] the conv output (bf16 or float32), dt [B, L, H] raw time steps (same
   dtype), A / dt_bias / D [H] float32, state [B, H, P, N] float32 advanced in place, y [B, L, H, P]
   float32; bounds[i] [B, H, P, N] float32 receives the state after splits[i] tokens; lens[b] real
   tokens of row b (NULL: all L). Parallel over rows x heads. */
void hybridlm_mamba2_scan(const void* xbc, const void* dt, const float* A, const float* dt_bias,
                          const float* D, float* state, float* y, float** bounds, const int64_t* splits,
                          int64_t nsplit, const int64_t* lens, int64_t B, int64_t L, int64_t H, int64_t P,
                          int64_t G, int64_t N, float lo, float hi, int is_bf16, int nthreads) {
    const int64_t conv_dim = H * P + 2 * G * N;
    const size_t es = is_bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t bh = 0; bh < B * H; bh++) {
        const int64_t b = bh / H, h = bh % H;
        const int64_t real = lens ? (lens[b] < L ? lens[b] : L) : L;
        scan_head((const char*)xbc + b * L * conv_dim * es, (const char*)dt + b * L * H * es, A[h],
                  dt_bias[h], D ? D[h] : 0.f, lo, hi, state + bh * P * N, y + b * L * H * P, bounds,
                  bh * P * N, splits, nsplit, L, real, h, H, P, G, N, is_bf16);
    }
}
