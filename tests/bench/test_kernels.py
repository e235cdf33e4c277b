"""`bench kernels`: every case runs at every level asked for, on that level's build of its kernel."""

from __future__ import annotations

import pytest

from hybridlm.bench import kernels
from hybridlm.ops import linear, native
from hybridlm.ops.native import isa_levels


@pytest.mark.usefixtures("single_thread")
def test_every_kernel_is_timed_at_each_level_on_that_levels_build(monkeypatch):
    """Each case runs once per level, inside `built_for(level)` (so the ops take that build), and at
    `native` every case finds the kernel it is meant to time."""
    seen = []
    real = linear.KERNEL.get

    def get():
        seen.append(native.isa_level())
        return real()

    monkeypatch.setattr(linear.KERNEL, "get", get)
    levels = [isa_levels()[0], "native"]
    results = kernels.measure(levels, quick=True, budget_s=0.0)
    names = [c.name for c in kernels.cases(quick=True)]
    assert [(r.kernel, r.level) for r in results] == [(n, level) for n in names for level in levels]
    assert all(r.us > 0 and r.rate > 0 for r in results)
    assert all(r.native for r in results if r.level == "native")
    assert set(levels) <= set(seen)


def test_a_level_this_cpu_does_not_run_is_refused():
    class Args:
        threads, levels, quick, json = None, ["armv9-a"], True, None

    with pytest.raises(SystemExit, match="does not run --levels armv9-a"):
        kernels.main(Args())
