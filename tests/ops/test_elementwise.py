"""`elementwise_rows`: each row of an activation computed as alone, whatever rows sit beside it."""

from __future__ import annotations

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
