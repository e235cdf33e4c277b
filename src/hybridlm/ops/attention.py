"""Scaled dot-product attention over a cache history with composed masks.

The logical mask of a layer (causal, optionally a sliding window) is composed with where the
cache keeps its keys (`key_start`: absolute position of key row 0) and dispatched to SDPA's
no-mask or causal fast paths when the composed mask allows.

Few-query CPU inputs (decode, speculative verify) run a C kernel instead, whose result for a query
depends only on the keys it sees: it reads only those, in blocks aligned to absolute positions,
with an online softmax. SDPA's result for a query row also depends on how many rows share the
call (in bf16 ~20% of rows differed between a 9-row masked call and one-row calls), so a verify
pass would not compute what decoding computes, and speculative greedy output would drift.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from hybridlm.batch import Batch
from hybridlm.ops.native import BF16_HELPERS, FEW_TOKENS, NativeKernel

_ATTENTION_SOURCE = BF16_HELPERS + r"""
#include <math.h>
#include <stdlib.h>

#define KB 64  /* keys per block, aligned to absolute positions */

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline f32x16 load16(const void* p, int bf16) {
    f32x16 v;
    if (bf16) {
        u16x16 h; memcpy(&h, p, sizeof h);
        u32x16 u = __builtin_convertvector(h, u32x16) << 16;
        memcpy(&v, &u, sizeof v);
    } else memcpy(&v, p, sizeof v);
    return v;
}
static inline float hsum(f32x16 v) {
    float s = 0.f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}
/* dot(a[0:D], b[0:D]) with a float32 and b in the element type; fixed summation order. */
static inline float dot(const float* a, const void* b, int64_t D, int bf16) {
    f32x16 acc = {0};
    int64_t i = 0;
    const size_t es = bf16 ? 2 : 4;
    for (; i + 16 <= D; i += 16) {
        f32x16 av; memcpy(&av, a + i, sizeof av);
        acc += av * load16((const char*)b + i * es, bf16);
    }
    float s = hsum(acc);
    for (; i < D; i++) s += a[i] * load(b, i, bf16);
    return s;
}
static inline void axpy(float* y, float a, const void* x, int64_t D, int bf16) {
    int64_t i = 0;
    const size_t es = bf16 ? 2 : 4;
    for (; i + 16 <= D; i += 16) {
        f32x16 yv; memcpy(&yv, y + i, sizeof yv);
        yv += a * load16((const char*)x + i * es, bf16);
        memcpy(y + i, &yv, sizeof yv);
    }
    for (; i < D; i++) y[i] += a * load(x, i, bf16);
}

/* q [B, Hq, L, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv] (strides in elements, last dim contiguous),
   out [B, Hq, L, Dv] contiguous; qpos [B, L] absolute query positions; key row j holds position
   key_start + j. A query at p sees keys at positions in [p - window + 1, p] (window 0: [0, p]).
   Returns 0, or -1 when out of memory. */
int hybridlm_attention(const void* q, const void* k, const void* v, void* out, const int64_t* qpos,
                       int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t T, int64_t D, int64_t Dv,
                       int64_t q_sb, int64_t q_sh, int64_t q_sl, int64_t k_sb, int64_t k_sh,
                       int64_t k_st, int64_t v_sb, int64_t v_sh, int64_t v_st, int64_t key_start,
                       int64_t window, float scale, float softcap, int is_bf16, int nthreads) {
    const int64_t rep = Hq / Hkv, R = rep * L;
    const size_t es = is_bf16 ? 2 : 4;
    int failed = 0;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t bg = 0; bg < B * Hkv; bg++) {
        const int64_t b = bg / Hkv, g = bg % Hkv;
        float* buf = malloc(sizeof(float) * (R * (D + Dv + 2) + KB));
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
            continue;
        }
        float *qf = buf, *acc = qf + R * D, *m = acc + R * Dv, *l = m + R, *sc = l + R;
        int64_t lo = INT64_MAX, hi = -1;
        for (int64_t r = 0; r < R; r++) {
            const int64_t h = g * rep + r / L, t = r % L;
            const int64_t qrow = b * q_sb + h * q_sh + t * q_sl;
            for (int64_t i = 0; i < D; i++) qf[r * D + i] = load(q, qrow + i, is_bf16);
            for (int64_t i = 0; i < Dv; i++) acc[r * Dv + i] = 0.f;
            m[r] = -INFINITY;
            l[r] = 0.f;
            const int64_t p = qpos[b * L + t], first = window > 0 ? p - window + 1 : 0;
            if (first < lo) lo = first;
            if (p > hi) hi = p;
        }
        if (lo < key_start) lo = key_start;
        if (hi > key_start + T - 1) hi = key_start + T - 1;
        const int64_t b0 = lo >= 0 ? lo / KB * KB : 0;
        for (int64_t p0 = b0; p0 <= hi; p0 += KB) {
            for (int64_t r = 0; r < R; r++) {
                const int64_t p = qpos[b * L + r % L];
                int64_t a = p0, z = p0 + KB - 1;
                if (a < key_start) a = key_start;
                if (window > 0 && a < p - window + 1) a = p - window + 1;
                if (z > p) z = p;
                if (z > key_start + T - 1) z = key_start + T - 1;
                if (a > z) continue;
                float bm = -INFINITY;
                for (int64_t j = a; j <= z; j++) {
                    const char* kj = (const char*)k + (b * k_sb + g * k_sh + (j - key_start) * k_st) * es;
                    float s = dot(qf + r * D, kj, D, is_bf16) * scale;
                    if (softcap > 0.f) s = tanhf(s / softcap) * softcap;
                    sc[j - a] = s;
                    if (s > bm) bm = s;
                }
                const float mn = bm > m[r] ? bm : m[r];
                const float alpha = expf(m[r] - mn);
                float* ar = acc + r * Dv;
                for (int64_t i = 0; i < Dv; i++) ar[i] *= alpha;
                l[r] *= alpha;
                for (int64_t j = a; j <= z; j++) {
                    const float e = expf(sc[j - a] - mn);
                    l[r] += e;
                    const char* vj = (const char*)v + (b * v_sb + g * v_sh + (j - key_start) * v_st) * es;
                    axpy(ar, e, vj, Dv, is_bf16);
                }
                m[r] = mn;
            }
        }
        for (int64_t r = 0; r < R; r++) {
            const int64_t h = g * rep + r / L, t = r % L;
            const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
            for (int64_t i = 0; i < Dv; i++) {
                const int64_t o = ((b * Hq + h) * L + t) * Dv + i;
                const float y = acc[r * Dv + i] * inv;
                store(out, o, y, is_bf16);
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
"""
_i64 = ctypes.c_int64
KERNEL = NativeKernel(
    "attention",
    _ATTENTION_SOURCE,
    "hybridlm_attention",
    [ctypes.c_void_p] * 5 + [_i64] * 18 + [ctypes.c_float, ctypes.c_float, ctypes.c_int, ctypes.c_int],
    ctypes.c_int,
    fallback="scaled_dot_product_attention",
)
KERNEL_MAX_QUERIES = FEW_TOKENS


def _kernel_attention(q, k, v, batch, key_start, scale, window, softcap) -> torch.Tensor | None:
    """`attention` by the C kernel, or None where it does not apply."""
    B, Hq, L, D = q.shape
    if not (
        L <= KERNEL_MAX_QUERIES
        and q.is_cpu
        and q.dtype in (torch.bfloat16, torch.float32)
        and k.dtype is q.dtype
        and v.dtype is q.dtype
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and not torch.compiler.is_compiling()
        and not (torch.is_grad_enabled() and q.requires_grad)
    ):
        return None
    fn = KERNEL.get()
    if fn is None:
        return None
    Hkv, T, Dv = k.shape[1], k.shape[2], v.shape[-1]
    out = torch.empty(B, Hq, L, Dv, dtype=q.dtype)
    qpos = batch.positions().to(torch.int64).contiguous()
    fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), qpos.data_ptr(), B, Hq, Hkv, L,
                T, D, Dv, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], key_start, window or 0,
                scale, softcap or 0.0, int(q.dtype is torch.bfloat16), torch.get_num_threads())
    return out


def _mask(batch: Batch, key_start: int, n_keys: int, window: int | None) -> torch.Tensor | str | None:
    """None (every key visible), "causal" (SDPA's top-left causal) or a bool mask [B, 1, L, T]."""
    length = batch.length
    if len(set(batch.offsets)) == 1:
        q0 = batch.offsets[0]
        fits_window = window is None or n_keys <= window
        if length == 1 and key_start + n_keys == q0 + 1 and fits_window:
            return None
        if key_start == q0 and n_keys == length and (window is None or length <= window):
            return "causal"

    def build():
        qpos = batch.positions()[:, None, :, None]
        kpos = torch.arange(key_start, key_start + n_keys, device=batch.device)[None, None, None, :]
        allowed = kpos <= qpos
        if window is not None:
            allowed &= kpos > qpos - window
        return allowed

    return batch.memoize(("attn_mask", key_start, n_keys, window), build)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: Batch,
    *,
    key_start: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal (optionally windowed) GQA attention.

    q: [B, Hq, L, D] at positions `batch.positions()`; k, v: [B, Hkv, T, D] holding absolute
    positions [key_start, key_start + T). Returns [B, Hq, L, Dv] in q's dtype. Padded query rows
    produce finite values that callers discard; padded keys are never visible to real queries
    because they lie after every real query of their row.
    """
    out = _kernel_attention(q, k, v, batch, key_start, scale, window, softcap)
    if out is not None:
        return out
    mask = _mask(batch, key_start, k.shape[2], window)
    if softcap is None:
        gqa = q.shape[1] != k.shape[1]
        if mask is None or isinstance(mask, str):
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=mask == "causal", scale=scale, enable_gqa=gqa
            )
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask == "causal":
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1).to(v.dtype), v)
