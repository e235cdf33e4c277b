"""The disk tier of the prefix cache: one safetensors file per demoted trie node.

A file holds the node's snapshot of every stateful layer l as tensors `l{l}.{name}` (`k`, `v` for
attention rows; `inputs`, `gates`, `tail`, `state` for scan caches) and string metadata:

  format       FORMAT (a different value is another version's file: never read)
  fingerprint  the model's `model_fingerprint` (another model's file is never read)
  tokens       JSON list: the node's whole token path from the root, [0, end) — enough to rebuild
               the trie from the files alone after a restart
  start        the node's first position (its edge is tokens[start:])
  layers       JSON {layer: snapshot fields (`Snapshot.to_state`) + "tensors": the names stored}
  last_used    wall-clock seconds of the node's last use (recency survives a restart)
  data_digest  BLAKE2b of every tensor (name, dtype, shape, bytes), checked when the file is read
  digest       BLAKE2b of the other metadata fields, checked when the directory is scanned

Writes are atomic (a temporary file in the same directory, then `os.replace`), and nothing is
fsynced: a file torn by a crash fails its digests and is ignored, which is all a cache needs.
Files are read whole and only on demand; a scan reads headers only (8 + header bytes per file).

Faults never reach the engine: a full disk skips the write (the node stays in RAM or is deleted),
warning at most once a minute; any other write failure (a read-only or removed directory...)
stops all further writes with one warning — the tier then only serves the files it already has.
A file that cannot be deleted is left behind (warned, rate-limited).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import math
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

from hybridlm.cache.base import Snapshot
from hybridlm.cache.kv import RowsSnapshot
from hybridlm.cache.recurrent import ScanSnapshot

log = logging.getLogger(__name__)

FORMAT = "hybridlm.prefix-node/1"
SUFFIX = ".safetensors"
KINDS: dict[str, type] = {RowsSnapshot.kind: RowsSnapshot, ScanSnapshot.kind: ScanSnapshot}
# A safetensors header this large is not one of ours (ours hold one node's metadata: its token path
# and a few fields per layer); refusing it keeps a corrupted length from allocating gigabytes.
MAX_HEADER = 64 << 20
# Write failures that pass once space is freed; any other OSError ends writing to the tier.
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class Throttled:
    """A warning logged at most once per `interval` seconds; the next one says how many were held back
    (a full disk fails every write: hundreds a minute)."""

    def __init__(self, interval: float = 60.0):
        self.interval = interval
        self._last = -math.inf
        self._held = 0

    def warning(self, message: str, *args) -> None:
        now = time.monotonic()
        if now - self._last < self.interval:
            self._held += 1
            return
        if self._held:
            message += f" (and {self._held} more like it in the last {self.interval:g} s)"
        log.warning(message, *args)
        self._last, self._held = now, 0


def model_fingerprint(model, samples: int = 64) -> str:
    """16 hex digits identifying a model's weights: its config, every parameter's name, shape and
    dtype, and `samples` evenly spaced values of each parameter. Cheap (no full pass over the
    weights: ~samples × parameters values read) and deterministic across processes."""
    h = hashlib.blake2b(digest_size=8)
    h.update(json.dumps(model.config, sort_keys=True, default=str).encode())
    picked = []
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        flat = p.detach().reshape(-1)
        if flat.numel():
            idx = torch.linspace(0, flat.numel() - 1, min(samples, flat.numel()), device=flat.device).long()
            picked.append(flat[idx].float())
    if picked:
        # float32 holds bf16/fp16 values exactly; one transfer for all samples (cheap on a GPU too).
        h.update(torch.cat(picked).cpu().numpy().tobytes())
    return h.hexdigest()


class CorruptFile(ValueError):
    """A cache file that cannot be used (unreadable, truncated, failing its digests)."""


@dataclass
class StoredNode:
    """What one usable file says about its node (read from its header, no tensors).

    nbytes: the file's size in bytes; tokens: the node's token path from the root, [0, end);
    layers: stateful layer -> snapshot fields (with "tensors"); last_used: wall-clock seconds."""

    name: str
    nbytes: int
    tokens: list[int]
    start: int
    layers: dict[int, dict]
    last_used: float


class StoredSnapshot(Snapshot):
    """Stand-in, in the trie, for a snapshot whose data is on disk: owns no RAM bytes and answers
    `reaches` / `standalone` exactly as the stored snapshot would (planning needs no file read).
    Never handed to a cache: the prefix cache loads the node before it restores from it."""

    _EMPTY = torch.empty(0)

    def __init__(self, fields: dict):
        self.start, self.end = fields["start"], fields["end"]
        # The reachability rules live in the snapshot classes; a copy with empty tensors answers them
        # (it only looks at the fields and at which tensors are present).
        self._probe = KINDS[fields["kind"]].from_state(fields, dict.fromkeys(fields["tensors"], self._EMPTY))

    @property
    def nbytes(self) -> int:
        return 0

    def reaches(self, target: int) -> bool:
        return self._probe.reaches(target)

    def standalone(self, target: int) -> bool:
        return self._probe.standalone(target)

    def _release(self) -> None:
        self._probe = None


def _header_digest(meta: dict[str, str]) -> str:
    fields = {k: v for k, v in meta.items() if k != "digest"}
    return hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=16).hexdigest()


def _data_digest(tensors: dict[str, torch.Tensor]) -> str:
    """Digest of CPU tensors by name, dtype, shape and bytes."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _read_header(f, size: int) -> tuple[dict, int]:
    """(the safetensors header, the file size it describes) of a file of `size` bytes open at its
    start; a size that differs from `size` means a truncated (or padded) file."""
    head = f.read(8)
    if len(head) < 8:
        raise CorruptFile("shorter than a safetensors header")
    n = int.from_bytes(head, "little")
    if n > min(MAX_HEADER, size - 8):
        raise CorruptFile(f"header length {n} does not fit a file of {size} bytes")
    try:
        header = json.loads(f.read(n))
        end = max((entry["data_offsets"][1] for k, entry in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise CorruptFile(f"unreadable header ({e})") from None
    return header, 8 + n + end


class DiskTier:
    """A directory of node files under a byte budget, for one model (`fingerprint`).

    The directory may be shared with other models' caches: their files are never read, counted or
    deleted. `nbytes` counts the files this tier owns (written by it, or adopted from a scan).
    Budget decisions belong to the prefix cache: `write` asks its `reserve` callback for room.
    """

    def __init__(self, directory: str | Path, budget_bytes: int, fingerprint: str):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.budget = budget_bytes
        self.fingerprint = fingerprint
        self.sizes: dict[str, int] = {}
        self.failed: str | None = None  # why writing stopped (None: writable)
        self._full = Throttled()
        self._undeletable = Throttled()

    @property
    def nbytes(self) -> int:
        return sum(self.sizes.values())

    def _tmp(self, name: str) -> Path:
        return self.directory / f".{self.fingerprint}.{name}.tmp"

    # ---- scan ----------------------------------------------------------------------------
    def scan(self) -> tuple[list[StoredNode], list[str]]:
        """Read every file's header: (this model's usable files, parents before children; one line
        per file ignored, with the reason). Usable files are owned from now on. Files of this model
        that are cut short, and its leftover temporary files (a crash mid-write), are deleted; files
        not provably this model's (another model or format, an unreadable header) are left alone."""
        found, ignored = [], []
        for tmp in self.directory.glob(f".{self.fingerprint}.*.tmp"):
            try:
                tmp.unlink(missing_ok=True)
            except OSError as e:  # e.g. a read-only directory: the leftover stays, harmless
                ignored.append(f"{tmp.name}: leftover temporary file, not deleted ({e.strerror or e})")
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            if path.name.startswith(".") or not path.is_file():
                continue
            try:
                size = path.stat().st_size
                with path.open("rb") as f:
                    header, described = _read_header(f, size)
                stored = self._check(path.name, header.get("__metadata__") or {}, size)
            except (OSError, CorruptFile) as e:
                ignored.append(f"{path.name}: {e}")
                continue
            if stored is None:
                ignored.append(f"{path.name}: written for another model or format")
                continue
            if described != size:
                path.unlink(missing_ok=True)
                ignored.append(f"{path.name}: {size} bytes where its header describes {described}; deleted")
                continue
            found.append(stored)
            self.sizes[stored.name] = stored.nbytes
        found.sort(key=lambda s: (s.start, len(s.tokens)))
        return found, ignored

    def _check(self, name: str, meta: dict, size: int) -> StoredNode | None:
        """The node a header describes; None for another model's or format's file."""
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            return None
        if meta.get("fingerprint") != self.fingerprint:
            return None
        if meta.get("digest") != _header_digest(meta):
            raise CorruptFile("metadata fails its digest")
        try:
            layers = {int(k): v for k, v in json.loads(meta["layers"]).items()}
            return StoredNode(
                name, size, json.loads(meta["tokens"]), int(meta["start"]), layers, float(meta["last_used"])
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptFile(f"bad metadata ({e})") from None

    # ---- write / read / delete -------------------------------------------------------------
    def write(
        self,
        tokens: list[int],
        start: int,
        last_used: float,
        snaps: dict[int, Snapshot],
        reserve: Callable[[int, bool], bool],
    ) -> StoredNode | None:
        """Store one node: `tokens` its path from the root, `snaps` its snapshot per stateful layer,
        `last_used` wall-clock seconds. `reserve(nbytes, evict)` says whether nbytes more fit the
        budget (evict: and makes room); it is asked with the tensor bytes before anything is written,
        then with the file's exact size before it is published. None when there is no room or the
        write fails (see the module docstring); the snapshots are left as they were either way."""
        if self.failed is not None:
            return None
        layers, tensors = {}, {}
        for i, snap in snaps.items():
            fields, data = snap.to_state()
            layers[str(i)] = {**fields, "tensors": sorted(data)}
            for key, t in data.items():
                tensors[f"l{i}.{key}"] = t.detach().to("cpu").contiguous()
        if not reserve(sum(t.numel() * t.element_size() for t in tensors.values()), False):
            return None
        meta = {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "tokens": json.dumps(tokens),
            "start": str(start),
            "layers": json.dumps(layers, sort_keys=True),
            "last_used": repr(last_used),
            "data_digest": _data_digest(tensors),
        }
        meta["digest"] = _header_digest(meta)
        name = f"node-{uuid.uuid4().hex}{SUFFIX}"
        tmp = self._tmp(name)
        # Serialized in memory, then written by Python: failures arrive as OSError with their errno.
        data = safetensors.torch.save(tensors, metadata=meta)
        size = len(data)
        try:
            if not reserve(size, True):
                return None
            with tmp.open("wb") as f:
                f.write(data)
            os.replace(tmp, self.directory / name)
        except OSError as e:
            self._write_failed(e)
            return None
        finally:
            self._unlink(tmp)
        self.sizes[name] = size
        return StoredNode(name, size, list(tokens), start, {int(k): v for k, v in layers.items()}, last_used)

    def read(self, name: str, device) -> dict[int, Snapshot]:
        """The snapshots stored in file `name`, on `device`, by stateful layer. Raises CorruptFile
        when the file cannot be read or fails a digest."""
        path = self.directory / name
        try:
            raw = path.read_bytes()
            header, described = _read_header(io.BytesIO(raw), len(raw))
            meta = header.get("__metadata__") or {}
            stored = self._check(name, meta, len(raw))
            if stored is None:
                raise CorruptFile("no longer this model's file")
            if described != len(raw):
                raise CorruptFile(f"{len(raw)} bytes where its header describes {described}")
            tensors = safetensors.torch.load(raw)
        except (OSError, safetensors.SafetensorError) as e:
            raise CorruptFile(str(e)) from None
        if _data_digest(tensors) != meta.get("data_digest"):
            raise CorruptFile("tensor data fails its digest")
        try:
            return {
                i: KINDS[fields["kind"]].from_state(
                    fields, {key: tensors[f"l{i}.{key}"].to(device) for key in fields["tensors"]}
                )
                for i, fields in stored.layers.items()
            }
        except (KeyError, TypeError) as e:
            raise CorruptFile(f"layers do not match the tensors ({e})") from None

    def delete(self, name: str) -> None:
        """Remove an owned file (already gone: nothing to do; cannot be removed: left behind)."""
        self.sizes.pop(name, None)
        self._unlink(self.directory / name)

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            self._undeletable.warning("prefix cache: could not delete %s: %s", path, e)

    def _write_failed(self, e: OSError) -> None:
        if e.errno in DISK_FULL:
            self._full.warning(
                "prefix cache: the disk tier at %s is full (%s); node not stored", self.directory, e
            )
            return
        self.failed = str(e)
        log.warning(
            "prefix cache: the disk tier at %s failed (%s); nothing more is written there (its files are "
            "still read)",
            self.directory,
            e,
        )


def wall_clock(monotonic: float) -> float:
    """Wall-clock seconds of a `time.monotonic()` instant (what a file records, to survive a restart)."""
    return time.time() - (time.monotonic() - monotonic)


def monotonic_of(wall: float) -> float:
    """The `time.monotonic()` instant of a recorded wall-clock time (never in the future)."""
    return time.monotonic() - max(0.0, time.time() - wall)
