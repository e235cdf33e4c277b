/* Few-token inputs (decode, speculative verify) run one C loop instead of a dozen small ATen ops
   (decode) or a oneDNN convolution set up for long inputs (~1.5 ms for 9 tokens x 6144 channels).
   From LONG_ROWS rows (every call without AVX-512) the taps are first transposed to float32 [K, C],
   so every load of the channel loop is contiguous, rows shared among the threads: oneDNN's bf16
   depthwise convolution without AVX-512 took 10x as long (512 x 6144, K = 4, one AVX2 thread).
   It rounds where the torch path does: the sum once to bf16, the activation once more. */
#include "bf16.h"
#include <stdlib.h>

/* Rows from which a call takes the taps transposed to float32 [K, C] (conv_row_t; the copy costs a
   pass over the taps). With AVX-512 conv_row's reads of the [C, K] taps vectorize and a few rows run
   faster without the copy; without AVX-512 they do not, and every call takes it. One thread, 8192
   channels, K = 4, bf16 with SiLU (Xeon, each -march build): AVX-512 1 row 12.5 µs (copy: 17), 8 rows
   108 (77); AVX2 1 row 74 (24), 4 rows 284 (70); SSE4 1 row 111 (42). */
#if defined(__AVX512F__)
#define LONG_ROWS 4
#else
#define LONG_ROWS 1
#endif

/* Row r of xp = prior ‖ x of one sequence (r < K-1: prior), as bytes. */
static inline const char* xp_row(const char* x, const char* prior, int64_t r, int64_t K, int64_t C,
                                 size_t es) {
    return r < K - 1 ? prior + r * C * es : x + (r - (K - 1)) * C * es;
}

/* Output row t of one sequence: per channel the K products summed in tap order, plus the bias,
   rounded to the element type, then SiLU, rounded again. Inlined with a constant K, the loop over
   channels vectorizes reading the taps in their [C, K] layout. */
static inline __attribute__((always_inline)) void conv_row(const char* x, const char* prior, const void* weight,
                                                           const void* bias, void* out, int64_t t, int64_t C,
                                                           int64_t K, int silu, int is_bf16) {
    const size_t es = is_bf16 ? 2 : 4;
    for (int64_t c = 0; c < C; c++) {
        float acc = 0.f;
        for (int64_t j = 0; j < K; j++)
            acc += load(weight, c * K + j, is_bf16) * load(xp_row(x, prior, t + j, K, C, es), c, is_bf16);
        float y = acc + (bias ? load(bias, c, is_bf16) : 0.f);
        if (is_bf16) {
            y = bf16_to_f32(f32_to_bf16(y));
            if (silu) y = y / (1.f + exp_fast(-y));
            ((uint16_t*)out)[t * C + c] = f32_to_bf16(y);
        } else {
            ((float*)out)[t * C + c] = silu ? y / (1.f + exp_fast(-y)) : y;
        }
    }
}

/* conv_row with the taps as float32 wt [K, C] (exact: a bf16 widens to float32 exactly) and the bias
   as float32 bf [C] (zeros without one: conv_row adds 0 then too), a tap at a time over the channels
   into acc [C]: the same products summed in the same order, so the same bits. */
static inline __attribute__((always_inline)) void conv_row_t(const char* x, const char* prior, const float* wt,
                                                             const float* bf, void* out, int64_t t, int64_t C,
                                                             int64_t K, int silu, int is_bf16, float* acc) {
    const size_t es = is_bf16 ? 2 : 4;
    for (int64_t c = 0; c < C; c++) acc[c] = 0.f;
    for (int64_t j = 0; j < K; j++) {
        const char* row = xp_row(x, prior, t + j, K, C, es);
        const float* w = wt + j * C;
        for (int64_t c = 0; c < C; c++) acc[c] += w[c] * load(row, c, is_bf16);
    }
    if (is_bf16) {
        uint16_t* o = (uint16_t*)out + t * C;
        for (int64_t c = 0; c < C; c++) {
            float y = round_to(acc[c] + bf[c], 1);
            if (silu) y = y / (1.f + exp_fast(-y));
            o[c] = (uint16_t)(bf16_bits(y) >> 16);
        }
    } else {
        float* o = (float*)out + t * C;
        for (int64_t c = 0; c < C; c++) {
            const float y = acc[c] + bf[c];
            o[c] = silu ? y / (1.f + exp_fast(-y)) : y;
        }
    }
}

#define CONV_ROW(k) conv_row(x, prior, weight, bias, out, t, C, k, silu, is_bf16)

/* The taps as float32 [K, C] followed by the bias as float32 [C] (zeros without one), in one block
   the caller frees; NULL when out of memory (callers then run conv_rows: the same bits). */
static float* transposed_taps(const void* weight, const void* bias, int64_t C, int64_t K, int is_bf16) {
    float* wt = malloc((size_t)((K + 1) * C) * sizeof(float));
    if (!wt) return NULL;
    for (int64_t c = 0; c < C; c++) {
        for (int64_t j = 0; j < K; j++) wt[j * C + c] = load(weight, c * K + j, is_bf16);
        wt[K * C + c] = bias ? load(bias, c, is_bf16) : 0.f;
    }
    return wt;
}

/* Row t of one sequence (x after prior, out as in conv_rows) by conv_row_t with taps from
   transposed_taps; acc [C] scratch. A constant K, activation and type per call site, so the channel
   loop vectorizes. */
static void row_t(const char* x, const char* prior, const float* wt, void* out, int64_t t, int64_t C,
                  int64_t K, int silu, int is_bf16, float* acc) {
    const float* bf = wt + K * C;
#define ROW_T(k, s, h) conv_row_t(x, prior, wt, bf, out, t, C, k, s, h, acc)
    if (is_bf16 && K == 4) { if (silu) ROW_T(4, 1, 1); else ROW_T(4, 0, 1); }
    else if (is_bf16) { if (silu) ROW_T(K, 1, 1); else ROW_T(K, 0, 1); }
    else if (silu) ROW_T(K, 1, 0);
    else ROW_T(K, 0, 0);
#undef ROW_T
}


/* Rows [t0, t1) of one sequence: x [L, C] after prior [K-1, C] -> out [L, C], reading the taps in
   their [C, K] layout. conv_row_t (row_t) gives the same bits, so whichever a call takes, a
   sequence's numbers never depend on its batch or its length. */
static void conv_rows(const char* x, const char* prior, const void* weight, const void* bias, void* out,
                      int64_t t0, int64_t t1, int64_t C, int64_t K, int silu, int is_bf16) {
    for (int64_t t = t0; t < t1; t++) {
        if (is_bf16) {
            switch (K) { case 2: CONV_ROW(2); break; case 3: CONV_ROW(3); break; case 4: CONV_ROW(4); break;
                         default: CONV_ROW(K); }
        } else {
            CONV_ROW(K);
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
   min(splits[i], lens[b]) tokens. All bf16 when is_bf16, else float32 (conv_row says how it rounds).
   Returns 0. */
int hybridlm_conv_short(const void* x, const void* prior, const void* weight, const void* bias,
                        void* out, void* tail, void** bounds, const int64_t* splits, int64_t nsplit,
                        const int64_t* lens, int64_t B, int64_t L, int64_t C, int64_t K, int silu,
                        int is_bf16, int nthreads) {
    const size_t es = is_bf16 ? 2 : 4;
    float* wt = L >= LONG_ROWS && K <= 8 ? transposed_taps(weight, bias, C, K, is_bf16) : NULL;
    /* one row (a decode step) runs on the calling thread: waking the team costs more than the row */
    #pragma omp parallel num_threads(nthreads) if (B * L > 1)
    {
    float* acc = wt ? malloc((size_t)C * sizeof(float)) : NULL;
    #pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < L; t++) {
            const char* xb = (const char*)x + b * L * C * es;
            const char* pb = (const char*)prior + b * (K - 1) * C * es;
            char* ob = (char*)out + b * L * C * es;
            if (acc) row_t(xb, pb, wt, ob, t, C, K, silu, is_bf16, acc);
            else conv_rows(xb, pb, weight, bias, ob, t, t + 1, C, K, silu, is_bf16);
        }
    free(acc);
    }
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
   after each. Rows outside every sequence are not touched. Each sequence's rows have the bits
   hybridlm_conv_short gives it alone (conv_row and conv_row_t agree). Returns 0. */
int hybridlm_conv_short_packed(const void* x, const void** priors, const void* weight, const void* bias,
                               void* out, void** tails, void** bounds, const int64_t* splits,
                               const int64_t* split_starts, const int64_t* starts, const int64_t* lens,
                               int64_t nseq, int64_t C, int64_t K, int silu, int is_bf16, int nthreads) {
    const size_t es = is_bf16 ? 2 : 4;
    int64_t rows = 0;
    for (int64_t i = 0; i < nseq; i++) rows += lens[i];
    float* wt = rows >= LONG_ROWS && K <= 8 ? transposed_taps(weight, bias, C, K, is_bf16) : NULL;
    /* One sequence's rows (~25 Ki multiply-adds for 6144 channels) cost less than waking the OpenMP
       team, which is slow when other processes share the cores; from 4 sequences on the two threads
       pay (8 decode rows of Qwen3.5-0.8B's 6144 channels: 263 -> 185 us a call, 2 cores). */
    #pragma omp parallel num_threads(nthreads) if (nseq >= 4)
    {
    float* acc = wt ? malloc((size_t)C * sizeof(float)) : NULL;
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < nseq; i++) {
        const char* xs = (const char*)x + starts[i] * C * es;
        char* os = (char*)out + starts[i] * C * es;
        const int64_t first = split_starts[i];
        if (acc)
            for (int64_t t = 0; t < lens[i]; t++) row_t(xs, priors[i], wt, os, t, C, K, silu, is_bf16, acc);
        else
            conv_rows(xs, priors[i], weight, bias, os, 0, lens[i], C, K, silu, is_bf16);
        copy_tails(xs, priors[i], tails[i], bounds + first, 0, splits + first, split_starts[i + 1] - first,
                   lens[i], C, K, es);
    }
    free(acc);
    }
    free(wt);
    return 0;
}
