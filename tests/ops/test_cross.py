"""The kernels beyond this CPU: every C source compiles for aarch64 (NEON) without warnings, and the
C checks of tests/ops/cross (the bf16 / int8 / int4 products against float64, each row equal to itself
alone) pass at every ISA level this CPU runs and, built for aarch64, under qemu-user.

The cross compiler and qemu come from Debian's packages (`gcc-aarch64-linux-gnu`,
`libgomp1-arm64-cross`, `qemu-user`; .ci/run installs them where apt-get can)."""

import shutil
import subprocess
from pathlib import Path

import pytest

from hybridlm.ops.native import CFLAGS, CSRC, compiler, isa_levels

CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"
CHECKS = sorted(p.name for p in (Path(__file__).parent / "cross").glob("check_*.c"))
STRICT = ("-Wall", "-Wextra", "-Werror", "-Wno-psabi")
KERNEL_SOURCES = sorted(p.name for p in CSRC.glob("*.c"))
needs_cross = pytest.mark.skipif(shutil.which(CROSS_CC) is None, reason=f"{CROSS_CC} not installed")


def build_check(cc: str, level: str, check: str, out: Path) -> Path:
    cmd = [cc, "-O2", "-fopenmp", "-std=gnu11", f"-march={level}", *STRICT, f"-I{CSRC}",
           str(Path(__file__).parent / "cross" / check), "-o", str(out), "-lm"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return out


@needs_cross
@pytest.mark.parametrize("file", KERNEL_SOURCES)
def test_kernel_source_compiles_for_aarch64_without_warnings(file, tmp_path):
    flags = [*CFLAGS, "-march=armv8-a", *STRICT]
    proc = subprocess.run([CROSS_CC, *flags, f"-I{CSRC}", str(CSRC / file), "-o", str(tmp_path / "k.so")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("level", isa_levels())
@pytest.mark.parametrize("check", CHECKS)
def test_kernel_checks_pass_at_every_level_of_this_cpu(check, level, tmp_path):
    try:
        cc = compiler()
    except RuntimeError:
        pytest.skip("no C compiler")
    exe = build_check(cc, level, check, tmp_path / "check")
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@needs_cross
@pytest.mark.skipif(shutil.which(QEMU) is None, reason=f"{QEMU} not installed")
@pytest.mark.parametrize("check", CHECKS)
def test_kernel_checks_pass_on_aarch64_under_qemu(check, tmp_path):
    exe = build_check(CROSS_CC, "armv8-a", check, tmp_path / "check")
    proc = subprocess.run([QEMU, "-L", SYSROOT, str(exe)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
