"""Small C kernels compiled with the system C compiler on first use and cached on disk.

The CPU decode path is dominated by per-call overhead of many tiny ATen ops and by memory-bound
matrix-vector products; a few fused C loops (``ops.linear``, ``ops.gated_delta``) remove both. Each
kernel family is one C file in ``ops/csrc/`` (shipped with the package; ``bf16.h`` holds the shared
bf16 helpers), built with ``-O3 -march=<level> -fopenmp`` into ``$XDG_CACHE_HOME/hybridlm/kernels``
(default ``~/.cache/hybridlm/kernels``) under a name keyed by the sources (the file and every header
beside it), compiler, flags and CPU, so a changed kernel or machine never loads a stale build.

The level is ``native`` (every instruction this CPU has) unless ``HYBRIDLM_MARCH`` names another.
Each kernel has a path per ISA level it matters on (AVX-512, AVX2 + FMA, and portable GCC vector
code for the rest, NEON included) chosen by the compiler's predefined macros, so building one source
at each level this CPU runs (`isa_levels`, `built_for`) tests every path the machine can execute.

Set ``HYBRIDLM_COMPILE=0`` to disable every kernel; if one cannot be built (no compiler, build
error) its callers fall back to plain torch with one logged warning.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

# Recurrent kernels hit subnormal floats on realistic gates; flushing them avoids 10x slowdowns. The
# flag is per thread and OpenMP's workers take it from the thread that starts them, so it must be set
# before the first parallel op: here, where every kernel and every model is first imported (the
# engine's worker sets it again on its own thread).
torch.set_flush_denormal(True)

logger = logging.getLogger(__name__)

# -fopenmp: the library then needs libgomp.so.1, which the dynamic loader resolves to the copy
# torch already loaded, so the kernels share torch's OpenMP thread pool instead of adding one.
# -fno-trapping-math: no kernel reads floating-point exception flags; without it GCC will not turn the
# selects of exp_fast's clamps into vector blends, and a loop calling it stays scalar (the prefill
# conv's SiLU: 5x). It changes no value.
CFLAGS = ("-O3", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")

# The -march level kernels are built for now: `HYBRIDLM_MARCH`, else every instruction of this CPU.
# Tests switch it process-wide with `built_for`.
_level = os.environ.get("HYBRIDLM_MARCH") or "native"

# Most tokens a call is treated as decode-like: a verify pass of 16 drafts plus its current token.
# Every per-token kernel takes at least this many tokens, and computes each token as it would alone,
# so a verify pass computes every position bit for bit as a decode step does (speculative greedy
# output equals plain greedy output in bf16 too).
FEW_TOKENS = 17

CSRC = Path(__file__).parent / "csrc"


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/hybridlm/kernels`` (default ``~/.cache/hybridlm/kernels``), else a per-user temp
    dir. Not under ``HYBRIDLM_CACHE_DIR``: that names the prefix cache's disk tier, whose files an
    operator may wipe or share between models."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybridlm"
    for path in (base / "kernels", Path(tempfile.gettempdir()) / f"hybridlm-{os.getuid()}"):
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(path, os.W_OK):
            return path
    raise RuntimeError(f"no writable directory for compiled kernels (tried {base / 'kernels'})")


def _cpu_signature() -> str:
    """CPU model and feature flags: a library built with -march=native only runs on such CPUs."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("flags", "Features"))]
        return {flag for ln in lines for flag in ln.split(":", 1)[1].split()}
    except OSError:
        return set()


# What each x86-64 micro-architecture level adds (as /proc/cpuinfo names them), after GCC's levels.
X86_LEVELS = {
    "x86-64-v2": {"ssse3", "sse4_1", "sse4_2", "popcnt"},
    "x86-64-v3": {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"},
    "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}


def isa_levels() -> list[str]:
    """The ``-march`` levels whose code this CPU runs, lowest first, ending with ``native``: on x86-64
    ``x86-64-v2`` (SSE4.2: the kernels' portable vector code), ``x86-64-v3`` (AVX2 + FMA + F16C) and
    ``x86-64-v4`` (AVX-512) as far as the CPU has them; on aarch64 ``armv8-a`` (NEON)."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        flags, levels, need = _cpu_flags(), [], set()
        for level, adds in X86_LEVELS.items():
            need |= adds
            if need <= flags:
                levels.append(level)
        return [*levels, "native"]
    if machine in ("aarch64", "arm64"):
        return ["armv8-a", "native"]
    return ["native"]


def isa_level() -> str:
    """The ``-march`` level kernels are built for now."""
    return _level


@contextmanager
def built_for(level: str) -> Iterator[None]:
    """Inside, every `NativeKernel.get()` (on every thread) returns the kernel built with
    ``-march=level``: how the tests run each ISA path this CPU can execute."""
    global _level
    before, _level = _level, level
    try:
        yield
    finally:
        _level = before


def source_path(file: str) -> Path:
    """Path of kernel source `file` (e.g. ``"linear.c"``) in the package's ``csrc`` directory."""
    return CSRC / file


def compiler() -> str:
    """The C compiler: ``$CC``, else gcc, else cc."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    return cc


def compile_library(name: str, file: str, level: str | None = None) -> Path:
    """Compile kernel source `file` for ``-march=level`` (default: `isa_level()`) into a shared library
    (or reuse the cached build) and return its path."""
    cc = compiler()
    flags = (*CFLAGS, f"-march={level or _level}")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    # The headers are part of every kernel's source: a changed helper rebuilds every kernel.
    sources = [source_path(file).read_text()] + [h.read_text() for h in sorted(CSRC.glob("*.h"))]
    parts = [*sources, cc, version, " ".join(flags), platform.machine(), _cpu_signature()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    lib_path = cache_dir() / f"{name}-{key}.so"
    if not lib_path.exists():
        with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
            out = Path(tmp) / lib_path.name
            cmd = [cc, *flags, f"-I{CSRC}", str(source_path(file)), "-o", str(out)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
            # Atomic, so concurrent processes never load a half-written library.
            os.replace(out, lib_path)
    return lib_path


class ThreadFlag:
    """A boolean per thread: true inside `with flag.raised():` on that thread (nestable; the
    context manager also decorates functions), false elsewhere."""

    def __init__(self):
        self._local = threading.local()

    def __bool__(self) -> bool:
        return getattr(self._local, "on", False)

    @contextmanager
    def raised(self) -> Iterator[None]:
        before = bool(self)
        self._local.on = True
        try:
            yield
        finally:
            self._local.on = before


class NativeKernel:
    """One C entry point, built on first `get()` (thread-safe, at most once per process and ISA level).

    name: library file stem; file: its C source in ``csrc``; symbol: the exported function;
    argtypes / restype: its ctypes
    signature — a C `int` result is a status (0, or -1 when out of memory: `MemoryError`);
    fallback: what callers do without it (named in the one warning a failed build logs).
    """

    def __init__(self, name: str, file: str, symbol: str, argtypes: list, restype, fallback: str):
        self.name, self.file, self.symbol = name, file, symbol
        self.argtypes, self.restype, self.fallback = argtypes, restype, fallback
        self._lock = threading.Lock()
        self._fns: dict[str, ctypes._CFuncPtr | None] = {}

    def build(self, level: str | None = None) -> ctypes._CFuncPtr:
        """Compile for ``-march=level`` (default: `isa_level()`; or reuse the cached build) and return
        the entry point."""
        fn = getattr(ctypes.CDLL(str(compile_library(self.name, self.file, level))), self.symbol)
        fn.argtypes, fn.restype = self.argtypes, self.restype
        if self.restype is ctypes.c_int:  # the kernels' status: 0, or -1 when out of memory
            fn.errcheck = self._check_status
        return fn

    def _check_status(self, status: int, fn, args) -> int:
        if status != 0:
            raise MemoryError(f"hybridlm {self.name} kernel: out of memory")
        return status

    def get(self) -> ctypes._CFuncPtr | None:
        """The entry point built for `isa_level()`; None when HYBRIDLM_COMPILE=0 or the build failed."""
        level = _level
        try:
            return self._fns[level]
        except KeyError:
            pass
        with self._lock:
            if level not in self._fns:
                fn = None
                if os.environ.get("HYBRIDLM_COMPILE", "1") != "0":
                    try:
                        fn = self.build(level)
                    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                        logger.warning("%s kernel unavailable, using %s: %s", self.name, self.fallback, exc)
                self._fns[level] = fn
        return self._fns[level]


def checked_splits(splits, length: int) -> list[int]:
    """Split points of a scan over `length` tokens as ints, checked to be sorted and in [0, length]."""
    splits = [int(s) for s in splits]
    if any(not 0 <= s <= length for s in splits) or splits != sorted(splits):
        raise ValueError(f"splits must be sorted and within [0, {length}], got {splits}")
    return splits


def int64_array(values) -> ctypes.Array:
    """`values` as a C int64 array, passed where a kernel takes a pointer: a few microseconds cheaper
    than a tensor (`torch.tensor` of a short list costs ~4 us), which counts in per-step calls."""
    return (ctypes.c_int64 * len(values))(*values)


def row_pointers(y: torch.Tensor, rows: list[int]) -> ctypes.Array:
    """The addresses of consecutive row blocks of y [Σ rows, N] (contiguous), `rows[i]` rows each, as a
    C int64 array: where a grouped kernel writes product i's output."""
    start, row_bytes, addresses = y.data_ptr(), y.shape[1] * y.element_size(), []
    for m in rows:
        addresses.append(start)
        start += m * row_bytes
    return int64_array(addresses)


def split_args(splits, bounds, query_lens) -> tuple:
    """The ctypes arguments ``(bounds, splits, nsplit, lens)`` of a scan kernel: an array of the
    boundary tensors' pointers (each its own allocation, so a stored boundary pins nothing else),
    the split offsets, their count, and per-row real lengths (or NULL)."""
    n = len(splits)
    ptrs = (ctypes.c_void_p * n)(*(t.data_ptr() for t in bounds)) if n else None
    at = int64_array(splits) if n else None
    lens = None if query_lens is None else int64_array([int(n) for n in query_lens])
    return ptrs, at, n, lens


def packed_args(starts, lens, splits, bounds) -> tuple:
    """The ctypes arguments ``(bounds, splits, split_starts, starts, lens)`` of a packed scan kernel
    over several sequences: sequence i's rows are ``[starts[i], starts[i] + lens[i])`` of the packed
    input and ``splits[i]`` its split offsets, whose boundary tensors ``bounds[i]`` are flattened
    into one pointer array (sequence i's from ``split_starts[i]`` to ``split_starts[i + 1]``)."""
    flat = [t.data_ptr() for b in bounds for t in b]
    at = [int(s) for seq in splits for s in seq]
    firsts = [0]
    for seq in splits:
        firsts.append(firsts[-1] + len(seq))
    return (
        (ctypes.c_void_p * max(len(flat), 1))(*flat),
        int64_array(at or [0]),
        int64_array(firsts),
        int64_array(starts),
        int64_array(lens),
    )
