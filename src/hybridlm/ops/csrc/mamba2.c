/* The Mamba-2 step recurrence (ops/mamba2.py), every token in order, per (row, head) in one loop:
   the torch step form runs ~8 small ATen ops a token and layer. Each (row, head) reads its token's x,
   B, C straight from the conv output [L, x ‖ B ‖ C] and keeps its [P, N] float32 state in place.
   A token's arithmetic never depends on how many tokens the call holds or on the rows beside it, so
   decode steps, verify passes, recorded prefills and replays all give the same bits.

   A state row's update and its dot product with C run in vectors of the ISA's width with four
   accumulators (vector j of the row into accumulator j % 4), then the accumulators and the lanes
   are summed in a fixed order. The scalar loop it replaces summed each row in one dependent chain:
   0.37 ms a token for a Nemotron-H-8B-shaped layer on 2 AVX2 cores, so a recorded prompt (the
   prefix cache's range snapshots) ran at ~200 tokens/s through 12 such layers. */
#include "bf16.h"
#include <math.h>
#include <string.h>

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * sizeof(float))));
static inline vf ldv(const float* p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void stv(float* p, vf v) { memcpy(p, &v, sizeof v); }

/* torch's softplus (threshold 20: above it, x itself) */
static inline float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

/* The lanes of v summed pairwise, halving the width each round (the same order at every call). */
static inline float hsum(vf v) {
    float lanes[VW];
    memcpy(lanes, &v, sizeof v);
    for (int w = VW / 2; w > 0; w /= 2)
        for (int i = 0; i < w; i++) lanes[i] += lanes[i + w];
    return lanes[0];
}

/* One state row s [N] of a token: s = decay·s + xd·b; returns Σ_n s[n]·c[n]. The accumulators are
   named, not an indexed array: indexed by a loop counter they lived in memory and every vector
   waited on a store (4x slower). */
static inline float row_step(float* s, const float* b, const float* c, float decay, float xd, int64_t N) {
    vf a0 = (vf){0}, a1 = (vf){0}, a2 = (vf){0}, a3 = (vf){0};
#define ROW_VECTOR(acc, at)                                       \
    do {                                                          \
        const vf sv = ldv(s + (at)) * decay + xd * ldv(b + (at)); \
        stv(s + (at), sv);                                        \
        acc += sv * ldv(c + (at));                                \
    } while (0)
    int64_t n = 0;
    for (; n + 4 * VW <= N; n += 4 * VW) {
        ROW_VECTOR(a0, n);
        ROW_VECTOR(a1, n + VW);
        ROW_VECTOR(a2, n + 2 * VW);
        ROW_VECTOR(a3, n + 3 * VW);
    }
    if (n + VW <= N) { ROW_VECTOR(a0, n); n += VW; }
    if (n + VW <= N) { ROW_VECTOR(a1, n); n += VW; }
    if (n + VW <= N) { ROW_VECTOR(a2, n); n += VW; }
#undef ROW_VECTOR
    float total = hsum((a0 + a1) + (a2 + a3));
    for (; n < N; n++) {
        s[n] = s[n] * decay + xd * b[n];
        total += s[n] * c[n];
    }
    return total;
}

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
    float b[N], c[N];  /* the token's B and C of this head's group, as float32 */
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
            for (int64_t n = 0; n < N; n++) {
                b[n] = load(row, b0 + n, is_bf16);
                c[n] = load(row, c0 + n, is_bf16);
            }
            for (int64_t p = 0; p < P; p++) {
                const float xp = load(row, h * P + p, is_bf16);
                yt[p] = row_step(s + p * N, b, c, decay, xp * delta, N) + D * xp;
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

/* The gated RMSNorm per group after the scan (models/mamba2.py: GroupedGatedRMSNorm), in float32:
   gate = silu(z); x = y·gate (before: norm_before_gate 0), each of G groups of the C channels
   x · rsqrt(mean(x²) + eps), then ·gate (norm_before_gate 1); out = bf16(w · x). y [rows, C] float32,
   z bf16 with row stride z_stride elements, w [C] bf16, out [rows, C] bf16. A group's sum of squares
   is `sum_squares` (bf16.h), so a row's numbers depend on that row alone. */
void hybridlm_mamba2_gated_norm(const float* y, const uint16_t* z, int64_t z_stride, const uint16_t* w,
                                uint16_t* out, int64_t rows, int64_t C, int64_t G, float eps,
                                int norm_before_gate, int nthreads) {
    const int64_t width = C / G;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * C >= (1 << 15))
    for (int64_t rg = 0; rg < rows * G; rg++) {
        const int64_t r = rg / G, c0 = (rg % G) * width;
        const float* yr = y + r * C + c0;
        const uint16_t* zr = z + r * z_stride + c0;
        uint16_t* o = out + r * C + c0;
        float x[width], gate[width];
        for (int64_t i = 0; i < width; i++) {
            const float g = bf16_to_f32(zr[i]);
            gate[i] = g / (1.f + exp_fast(-g));
            x[i] = norm_before_gate ? yr[i] : yr[i] * gate[i];
        }
        const float ss = sum_squares(x, 0, width, 0);
        const float scale = 1.f / sqrtf(ss / (float)width + eps);
        for (int64_t j = 0; j < width; j++) {
            float v = x[j] * scale;
            if (norm_before_gate) v *= gate[j];
            o[j] = f32_to_bf16(bf16_to_f32(w[c0 + j]) * v);
        }
    }
}
