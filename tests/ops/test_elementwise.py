"""`elementwise_rows` / `token_rows`: each row of an activation (each token of a per-token function)
computed as alone, whatever rows sit beside it."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

from hybridlm.ops.elementwise import elementwise_rows
from hybridlm.ops.linear import rowwise
from hybridlm.ops.native import FEW_TOKENS

FUNCTIONS = {
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "softcap": lambda x: torch.tanh(x / 30.0) * 30.0,
}


# Wider than a thread's chunk (32768 elements): 3 such rows are cut between 2 threads mid-vector.
BEYOND_A_CHUNK = 32832


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def rows_alone(fn, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([elementwise_rows(fn, x[i : i + 1]) for i in range(x.shape[0])])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_every_row_equals_the_row_alone(name, dtype, two_threads):
    """Widths that torch's vector loops leave a scalar tail of (1, 8, 48, 80, 160), aligned widths, one
    beyond a thread chunk; decode / verify row counts and, under `rowwise()`, a packed step's."""
    fn = FUNCTIONS[name]
    g = torch.Generator().manual_seed(0)
    for width in (1, 8, 48, 80, 128, 160, BEYOND_A_CHUNK):
        for rows, packed in ((3, False), (9, False), (FEW_TOKENS, False), (40, True)):
            if width == BEYOND_A_CHUNK and rows > 3:
                continue
            x = (torch.randn(rows, width, generator=g) * 4).to(dtype)
            with rowwise() if packed else torch.no_grad():
                got = elementwise_rows(fn, x)
                alone = rows_alone(fn, x)
            assert got.equal(alone), f"width {width}, {rows} rows"
            torch.testing.assert_close(got, fn(x))


def test_prefill_sized_inputs_take_the_function_directly():
    x = torch.randn(FEW_TOKENS + 1, 48, generator=torch.Generator().manual_seed(0))
    assert elementwise_rows(F.silu, x).equal(F.silu(x))
    assert elementwise_rows(F.silu, x[None]).shape == (1, FEW_TOKENS + 1, 48)


def test_token_rows_compute_every_token_as_alone():
    """`token_rows` over a per-head gated norm (it reduces within a token): each token of a few-token
    batch, and of any batch under `rowwise()`, is bit for bit that token's own call; prefill-sized
    inputs outside `rowwise()` take the function directly."""
    from hybridlm.ops.elementwise import token_rows
    from hybridlm.ops.norms import SigmoidGatedRMSNorm

    norm = SigmoidGatedRMSNorm(16)
    gen = torch.Generator().manual_seed(0)
    for rows, ctx in ((FEW_TOKENS, nullcontext), (3 * FEW_TOKENS, rowwise)):
        x, gate = (torch.randn(1, rows, 3, 16, generator=gen) for _ in range(2))
        with ctx():
            got = token_rows(norm, x, gate)
        for t in range(rows):
            assert torch.equal(got[:, t], norm(x[:, t : t + 1], gate[:, t : t + 1])[:, 0])
    x = torch.randn(1, 2 * FEW_TOKENS + 1, 3, 16, generator=gen)
    calls = []
    token_rows(lambda a: calls.append(a.shape) or a, x)
    assert calls == [x.shape]
