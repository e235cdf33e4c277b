"""The command line: a bad flag is one line and a non-zero exit, never a traceback (issue 11, points
12, 15, 19)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hybridlm.cli import build_parser
from hybridlm.ops import native

BAD = [
    ["serve", "--port", "99999"],
    ["serve", "--device", "cuda"],
    ["serve", "--prefill-chunk", "0"],
    ["serve", "--max-queue", "-5"],
    ["serve", "--context-length", "0"],
    ["serve", "--max-body", "lots"],
    ["serve", "--read-timeout", "0"],
    ["chat", "--top-p", "5"],
    ["generate", "--prompt", "hi", "--temperature", "-1"],
    ["generate", "--prompt", "hi", "--max-tokens", "0"],
    ["demo-model", "--out", "/proc/hybridlm-demo"],
]


def hybridlm(*args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "hybridlm.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        **kwargs,
    )


def test_bad_flags_are_one_line_and_a_nonzero_exit():
    bad = [args for args in BAD if not (args[-1] == "cuda" and torch.cuda.is_available())]
    procs = [(args, hybridlm(*args)) for args in bad]  # all at once: some checks need torch (--device)
    for args, proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode != 0, (args, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err, (args, err)
        assert args[-2].lstrip("-").split("-")[0] in lines[0], (args, err)


def test_parsing_flags_and_help_import_no_torch():
    """The parser (every flag, preset and quantization it lists) and the sampling checks of `chat` and
    `generate` are plain Python: `hybridlm --help` and a bad flag answer without the second and a half
    torch takes to import."""
    code = (
        "import sys\n"
        "from hybridlm.cli import build_parser, main\n"
        "build_parser().parse_args(['serve', '--port', '8001', '--quantize', 'int4', '--dtype', 'bf16'])\n"
        "build_parser().parse_args(['bench', 'forward', '--preset', 'nemotron-h-1b'])\n"
        "for argv in (['chat', '--top-p', '5'], ['generate', '--prompt', 'hi', '--max-tokens', '0']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code not in (0, None), argv\n"
        "    else:\n"
        "        raise AssertionError(argv)\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'numpy'))\n"
        "assert not loaded, loaded[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    out, err = hybridlm("serve", "--help").communicate(timeout=60)
    assert "--quantize" in out and "--cache-ram" in out, err


def test_version_and_bench_help():
    from hybridlm import __version__

    version = hybridlm("--version")
    assert version.communicate(timeout=60)[0].strip() == f"hybridlm {__version__}"
    bench = next(
        a for a in build_parser()._subparsers._group_actions[0].choices["bench"]._actions if a.choices
    )
    names = set(bench.choices)
    assert names >= {"forward", "serve", "multiturn", "restore", "speculative"}
    text = " ".join(build_parser()._subparsers._group_actions[0].choices["bench"].format_help().split())
    description = text.split("positional arguments")[0]
    assert all(f"`{name}`" in description for name in names), description


def test_kernels_live_under_the_user_cache_not_the_prefix_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HYBRIDLM_CACHE_DIR", str(tmp_path / "prefix"))
    assert native.cache_dir() == tmp_path / "xdg" / "hybridlm" / "kernels"
    assert not (tmp_path / "prefix").exists()


def test_a_cache_dir_naming_a_file_is_a_warning_not_a_traceback(tmp_path):
    """The command runs without a disk tier, with one warning."""
    target = tmp_path / "not-a-dir"
    target.write_text("x")
    proc = hybridlm(
        "chat",
        "--cache-dir",
        str(target),
        stdin=subprocess.PIPE,
        env={"HYBRIDLM_DEMO_DIR": str(tmp_path / "d")},
    )
    err = proc.communicate("/exit\n", timeout=180)[1]
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert "--cache-dir" in err and "no disk tier" in err, err


class _Loaded(Exception):
    """Raised by the stand-in loader once it has seen what a command asks for."""


@pytest.mark.parametrize("command", ["forward", "speculative", "restore", "multiturn", "concurrency"])
def test_bench_commands_load_the_model_as_the_flags_say(command, monkeypatch):
    """--dtype and --quantize reach the model loader of every benchmark that loads one model (bench
    speculative and restore once ignored --quantize and measured bf16 weights; `bench quality` reads
    --quantize as the schemes to compare against its unquantized reference)."""
    import hybridlm.models

    seen = {}

    def load_model(path, dtype=None, device=None, quantize=None):
        seen.update(dtype=dtype, quantize=quantize)
        raise _Loaded

    monkeypatch.setattr(hybridlm.models, "load_model", load_model)
    args = build_parser().parse_args(["bench", command, "--quantize", "int8", "--dtype", "float32"])
    with pytest.raises(_Loaded):
        args.func(args)
    assert seen == {"dtype": torch.float32, "quantize": "int8"}


def test_a_bad_checkpoint_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no_such_family"}')
    proc = hybridlm("generate", "--model", str(tmp_path), "--prompt", "hi")
    _, err = proc.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert proc.returncode == 2, err
    assert len(lines) == 1 and "no_such_family" in lines[0] and "Traceback" not in err, err
