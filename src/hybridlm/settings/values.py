"""Parsers of flag and environment values (argparse `type`s): each turns the text a user typed into
the value a setting holds, or raises `argparse.ArgumentTypeError` with a one-line reason."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from hybridlm.ops import QUANTIZATIONS

if TYPE_CHECKING:
    import torch

# --dtype's names -> the torch dtype's name. Names, not dtypes: parsing flags (and `--help`) imports
# no torch; `torch_dtype` resolves one when the model loads.
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}


def torch_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype a --dtype value names; None (the model's own default) for None or a name
    --dtype does not take."""
    if DTYPES.get(name) is None:
        return None
    import torch

    return getattr(torch, DTYPES[name])


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `hybridlm serve: error: argument --port: ...` (its subcommand
    parsers are of this class too), not the whole usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def ranged(kind, low=None, high=None, low_open: bool = False, what: str | None = None):
    """An argparse type: `kind(text)` within [low, high] ((low, high] with `low_open`)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what or kind.__name__ + ' number'}: {text!r}") from None
        below = low is not None and (value <= low if low_open else value < low)
        if below or (high is not None and value > high):
            bounds = f"{'(' if low_open else '['}{low if low is not None else '-inf'}, "
            bounds += f"{high if high is not None else 'inf'}]"
            raise argparse.ArgumentTypeError(f"must be in {bounds}, got {text}")
        return value

    return parse


port = ranged(int, 1, 65535, what="a port number")
positive_int = ranged(int, 1, what="an integer")
non_negative_int = ranged(int, 0, what="an integer")
positive_float = ranged(float, 0.0, low_open=True, what="a number")
non_negative_float = ranged(float, 0.0, what="a number")
context_length = ranged(int, 2, what="an integer")


def at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def device(text: str) -> str:
    """A torch device this process can use ('cpu', 'cuda', 'cuda:1', 'mps'...)."""
    import torch

    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r}") from None
    if dev.type == "cpu":
        return text
    backend = getattr(torch, dev.type, None) if dev.type != "mps" else torch.backends.mps
    if backend is None or not backend.is_available():
        raise argparse.ArgumentTypeError(f"{dev.type} is not available to this torch build / machine")
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if dev.index is not None and dev.index >= count:
        raise argparse.ArgumentTypeError(f"{text}: this machine has {count} {dev.type} device(s)")
    return text


def quantization(text: str) -> str:
    """A --quantize value (checked here, so a bad HYBRIDLM_QUANTIZE is reported like a bad flag)."""
    if text not in QUANTIZATIONS:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(QUANTIZATIONS)})")
    return text


def byte_size(text: str) -> int:
    """'4G', '512MiB', '1.5GB', '1000000' -> bytes (binary multiples for K/M/G/T)."""
    units = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1] if t and t[-1] in units else ""
    try:
        value = float(t[: len(t) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 4G, 512M)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"byte size must be >= 0: {text!r}")
    return int(value * units[unit])


def store_url(text: str) -> str:
    """A Valkey / Redis URL: redis[s]:// or valkey[s]://HOST[:PORT][/DB], DB a number."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 -- raises ValueError for a port that is not a number
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    if parts.scheme not in ("redis", "rediss", "valkey", "valkeys") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r}: expected redis://HOST:PORT/DB")
    if parts.path.strip("/") and not parts.path.strip("/").isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: the database must be a number")
    return text
