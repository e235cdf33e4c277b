import subprocess
import sys

import pytest

from hybridlm.ops import attention, conv, gated_delta, linear, mamba2, norms, quant, rope
from hybridlm.ops.native import CFLAGS, CSRC, compile_library, compiler, isa_levels

# -Wno-psabi: GCC notes that passing 64-byte vectors between *static* functions changes ABI without
# AVX-512; no such function crosses the library boundary.
STRICT = ("-Wall", "-Wextra", "-Werror", "-Wno-psabi")
KERNEL_SOURCES = sorted(p.name for p in CSRC.glob("*.c"))


@pytest.mark.parametrize("level", isa_levels())
@pytest.mark.parametrize("file", KERNEL_SOURCES)
def test_kernel_source_compiles_without_warnings_at_every_isa_level(file, level, tmp_path):
    try:
        cc = compiler()
    except RuntimeError:
        pytest.skip("no C compiler")
    out = tmp_path / "k.so"
    cmd = [cc, *CFLAGS, f"-march={level}", *STRICT, f"-I{CSRC}", str(CSRC / file), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_kernel_names_a_shipped_source():
    kernels = [linear.KERNEL, norms.NORM_KERNEL, conv.CONV_KERNEL, gated_delta.GDN_KERNEL,
               attention.KERNEL, quant.INT8_KERNEL, quant.INT4_KERNEL, quant.DEQUANT_INT8, quant.DEQUANT_INT4,
               rope.ROTARY_KERNEL, mamba2.STEP_KERNEL]
    assert {k.file for k in kernels} <= set(KERNEL_SOURCES)


def test_changed_header_rebuilds_the_kernel(tmp_path, monkeypatch):
    """The cache key covers the headers a kernel includes, not just its own file."""
    import hybridlm.ops.native as native

    for f in ("norms.c", "bf16.h"):
        (tmp_path / f).write_text((CSRC / f).read_text())
    monkeypatch.setattr(native, "CSRC", tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = compile_library("rms_norm", "norms.c")
    assert compile_library("rms_norm", "norms.c") == first
    (tmp_path / "bf16.h").write_text((CSRC / "bf16.h").read_text() + "\n/* changed */\n")
    second = compile_library("rms_norm", "norms.c")
    assert second != first and second.exists()


def test_importing_the_kernels_flushes_subnormal_floats():
    """The model path (every layer imports ops.native) sets the per-thread flag before any op runs;
    `import hybridlm` alone, which the command line's parser needs, does not import torch."""
    code = (
        "import sys, torch, hybridlm\n"
        "x = torch.tensor([1e-39])\n"
        "assert (x * 2).item() != 0, 'subnormals already flushed: the test proves nothing'\n"
        "import hybridlm.ops.native\n"
        "assert (x * 2).item() == 0\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
