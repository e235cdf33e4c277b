"""The shared store tier: trie nodes' snapshots in a Valkey / Redis server, shared by replicas.

Content addressing. `prefix_key(fingerprint, tokens)` is a BLAKE2b of the model fingerprint and the
token prefix (int32 bytes); computed incrementally, so one pass over a prompt yields the key of
every prefix. An edge [start, end) of `tokens` is stored under

  {ns}:node:{key(tokens[:start])}:{key(tokens[:end])}   the entry: one safetensors blob (below)
  {ns}:kids:{key(tokens[:start])}                       hash: field key(tokens[:end]) -> index value
  {ns}:at:{key(tokens[:end])}                           the replica that last held the prefix (router)

with ns = `hybridlm:{fingerprint}`; an index value is int32 [start, end, *edge tokens]. Edges of
every replica, at whatever boundaries their tries cut, coexist: a lookup walks the `kids` hashes
from the root (one round trip per edge), at each level taking the longest edge that the prompt
contains whole, and ends with the edge the prompt enters partly (restorable inside by replay).

Entries use the disk tier's encoding (tensors `l{layer}.{name}` from `Snapshot.to_state`, a data
digest and a metadata digest) plus the entry's own key, start and edge tokens: an entry is used
only when both digests hold, its key equals the key of the prompt prefix it is read for, its
fingerprint is this model's and its layers cover the edge. Anything else (corrupted, truncated,
another model's, evicted) is a miss: the index field and entry are deleted, counted and warned
about (rate-limited).

Budget: every key gets a TTL (`ttl_s`), and the server's own `maxmemory` with an LRU policy bounds
the bytes (a server without eviction answers OOM when full: the write is dropped and counted).

Writes never block a request: `put` copies the snapshots' tensors (lazy rows out of the live
buffers, which the next request overwrites) and queues them; a writer thread encodes and sends.
A full queue (`queue_bytes`) drops the write (counted). After a connection failure the store is
skipped for `retry_s` seconds, so a store that is down costs one failed call per interval, never
a request.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import safetensors
import safetensors.torch
import valkey

from hybridlm.cache.base import Snapshot
from hybridlm.cache.kv import KVCache
from hybridlm.prefix.disk import (
    CorruptFile,
    _data_digest,
    _header_digest,
    _read_header,
    decode_snapshots,
    encode_snapshots,
)

log = logging.getLogger(__name__)

FORMAT = "hybridlm.store-node/1"
WARN_EVERY_S = 30.0  # at most one warning per kind of failure per interval
PUBLISHED_MEMORY = 65536  # edges remembered as already written (not re-sent on every request)


def prefix_keys(fingerprint: str, tokens: list[int], ends) -> dict[int, str]:
    """{end: key of tokens[:end]} for each end in `ends` (0 ≤ end ≤ len(tokens)), in one pass."""
    h = hashlib.blake2b(fingerprint.encode(), digest_size=16)
    arr = np.asarray(tokens, dtype=np.int32)
    out, pos = {}, 0
    for end in sorted(set(ends)):
        h.update(arr[pos:end].tobytes())
        pos = end
        out[end] = h.hexdigest()
    return out


@dataclass
class StoreStats:
    """Counters for /metrics. lookups: walks of the index; fetched_nodes / fetched_bytes: entries
    read and used; writes / written_bytes: entries sent; dropped_writes: not sent (queue full or
    the store unreachable or full); rejected_entries: corrupted, truncated, foreign or evicted
    entries found; errors: failed calls to the server (down, timeout, out of memory)."""

    lookups: int = 0
    fetched_nodes: int = 0
    fetched_bytes: int = 0
    writes: int = 0
    written_bytes: int = 0
    dropped_writes: int = 0
    rejected_entries: int = 0
    errors: int = 0


@dataclass
class StoreEdge:
    """An edge found in the store: positions [start, start + len(tokens)) under parent key `parent`."""

    parent: str
    key: str
    start: int
    tokens: list[int]

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class _Warnings:
    """Log one warning per kind every WARN_EVERY_S seconds (and how many were held back)."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}
        self.held: dict[str, int] = {}

    def __call__(self, kind: str, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self.last.get(kind, -WARN_EVERY_S) < WARN_EVERY_S:
            self.held[kind] = self.held.get(kind, 0) + 1
            return
        held = self.held.pop(kind, 0)
        self.last[kind] = now
        log.warning(
            "prefix store: " + msg + (f" ({held} more since the last warning)" if held else ""), *args
        )


def _index_value(start: int, tokens: list[int]) -> bytes:
    return np.asarray([start, start + len(tokens), *tokens], dtype=np.int32).tobytes()


def _parse_index(raw: bytes) -> tuple[int, list[int]] | None:
    if len(raw) % 4 or len(raw) < 12:
        return None
    arr = np.frombuffer(raw, dtype=np.int32)
    start, end, tokens = int(arr[0]), int(arr[1]), arr[2:].tolist()
    return (start, tokens) if start >= 0 and end == start + len(tokens) else None


class StoreTier:
    """One model's view of a shared Valkey / Redis store (see the module docstring).

    url: redis://HOST:PORT/DB; fingerprint: `model_fingerprint(model)`; replica: this server's
    name, published for the router; ttl_s: lifetime of every key; queue_bytes: most tensor bytes
    waiting to be written; timeout_s: socket timeout of every call; retry_s: how long the store is
    skipped after a failed call."""

    def __init__(
        self,
        url: str,
        fingerprint: str,
        replica: str = "",
        ttl_s: int = 86400,
        queue_bytes: int = 256 << 20,
        timeout_s: float = 1.0,
        retry_s: float = 2.0,
    ):
        self.url = url
        self.fingerprint = fingerprint
        self.replica = replica
        self.ns = f"hybridlm:{fingerprint}"
        self.ttl_s = ttl_s
        self.queue_bytes = queue_bytes
        self.retry_s = retry_s
        self.stats = StoreStats()
        self.client = valkey.Valkey.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, health_check_interval=0
        )
        self._warn = _Warnings()
        self._down_until = 0.0
        self._published: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="prefix-store-writer", daemon=True)
        self._writer.start()

    # ---- availability --------------------------------------------------------------------
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, e: Exception) -> None:
        self.stats.errors += 1
        self._down_until = time.monotonic() + self.retry_s
        self._warn("down", "%s failed (%s); reuse from the store is off for %.0f s", what, e, self.retry_s)

    def _reject(self, edge: StoreEdge, why: str) -> None:
        """Count, warn about and delete an unusable entry (content-addressed: it can only be garbage)."""
        self.stats.rejected_entries += 1
        self._warn(
            "entry",
            "entry %s..%s [%d, %d) unusable: %s",
            edge.parent[:8],
            edge.key[:8],
            edge.start,
            edge.end,
            why,
        )
        try:
            self.client.hdel(f"{self.ns}:kids:{edge.parent}", edge.key)
            self.client.delete(f"{self.ns}:node:{edge.parent}:{edge.key}")
        except valkey.ValkeyError as e:
            self._failed("delete", e)

    # ---- lookup --------------------------------------------------------------------------
    def find(self, tokens: list[int], max_levels: int = 4096) -> list[StoreEdge]:
        """The store's path along `tokens` that reaches furthest: edges from position 0, each
        contained whole in `tokens` except possibly the last (which `tokens` enters partly). Replicas
        cut edges at different places, so every path is followed, level by level (one pipelined
        round trip per level; paths reaching the same position share the rest). [] when the store
        has nothing or cannot be reached."""
        if not self.available():
            return []
        self.stats.lookups += 1
        arr = np.asarray(tokens, dtype=np.int32)
        root = hashlib.blake2b(self.fingerprint.encode(), digest_size=16)
        # position -> (hash state of tokens[:position], the path of edges reaching it)
        frontier: dict[int, tuple] = {0: (root, [])}
        seen = {0}
        best: tuple[int, int, list[StoreEdge]] = (0, 0, [])  # (reach, -edges, path)
        try:
            for _ in range(max_levels):
                if not frontier:
                    break
                pipe = self.client.pipeline(transaction=False)
                for h, _path in frontier.values():
                    pipe.hgetall(f"{self.ns}:kids:{h.hexdigest()}")
                nxt: dict[int, tuple] = {}
                for (pos, (h, path)), kids in zip(frontier.items(), pipe.execute(), strict=True):
                    parent = h.hexdigest()
                    for field, raw in kids.items():
                        parsed = _parse_index(raw)
                        if parsed is None or parsed[0] != pos:
                            continue
                        edge = StoreEdge(parent, field.decode(), pos, parsed[1])
                        n = len(edge.tokens)
                        common = common_length(edge.tokens, tokens[pos:])
                        if common == n:
                            key = h.copy()
                            key.update(arr[pos : pos + n].tobytes())
                            if key.hexdigest() != edge.key:
                                continue
                            if edge.end not in seen:
                                seen.add(edge.end)
                                nxt[edge.end] = (key, [*path, edge])
                        if common:
                            best = max(
                                best, (pos + common, -len(path) - 1, [*path, edge]), key=lambda b: b[:2]
                            )
                frontier = nxt
        except valkey.ValkeyError as e:
            self._failed("lookup", e)
            return []
        return best[2]

    def fetch(self, edge: StoreEdge, layers: dict[int, dict], device) -> dict[int, Snapshot] | None:
        """The snapshots of one edge found by `find`, on `device`, by stateful layer; layers: the
        model's stateful layers and the snapshot fields each must have (kind, window). None when the
        entry is gone or unusable (counted, warned about, deleted) or the store cannot be reached."""
        if not self.available():
            return None
        try:
            raw = self.client.get(f"{self.ns}:node:{edge.parent}:{edge.key}")
        except valkey.ValkeyError as e:
            self._failed("read", e)
            return None
        if raw is None:
            self._reject(edge, "evicted or expired")
            return None
        try:
            snaps = self._decode(raw, edge, layers, device)
        except CorruptFile as e:
            self._reject(edge, str(e))
            return None
        self.stats.fetched_nodes += 1
        self.stats.fetched_bytes += len(raw)
        return snaps

    def _decode(self, raw: bytes, edge: StoreEdge, layers: dict[int, dict], device) -> dict[int, Snapshot]:
        header, described = _read_header(io.BytesIO(raw), len(raw))
        if described != len(raw):
            raise CorruptFile(f"{len(raw)} bytes where its header describes {described}")
        meta = header.get("__metadata__") or {}
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CorruptFile("not a hybridlm store entry")
        if meta.get("fingerprint") != self.fingerprint:
            raise CorruptFile("written for another model")
        if meta.get("digest") != _header_digest(meta):
            raise CorruptFile("metadata fails its digest")
        if meta.get("key") != edge.key or meta.get("parent") != edge.parent:
            raise CorruptFile("stored under another prefix's key")
        try:
            fields = {int(k): v for k, v in json.loads(meta["layers"]).items()}
            start, tokens = int(meta["start"]), json.loads(meta["tokens"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptFile(f"bad metadata ({e})") from None
        if (start, tokens) != (edge.start, edge.tokens):
            raise CorruptFile("its edge is not the indexed one")
        if sorted(fields) != sorted(layers):
            raise CorruptFile("its layers are not the model's")
        try:
            tensors = safetensors.torch.load(raw)
        except safetensors.SafetensorError as e:
            raise CorruptFile(str(e)) from None
        if _data_digest(tensors) != meta.get("data_digest"):
            raise CorruptFile("tensor data fails its digest")
        for i, f in fields.items():
            wanted = {**layers[i], "start": edge.start, "end": edge.end}
            if not isinstance(f, dict) or any(f.get(k) != v for k, v in wanted.items()):
                raise CorruptFile(f"layer {i} does not cover the edge")
        return decode_snapshots(fields, tensors, device)

    # ---- write ---------------------------------------------------------------------------
    def known(self, parent: str, key: str) -> bool:
        """Whether this replica wrote or read the edge parent -> key recently (no need to send it)."""
        return (parent, key) in self._published

    def remember(self, parent: str, key: str) -> None:
        with self._lock:
            self._published[(parent, key)] = None
            self._published.move_to_end((parent, key))
            while len(self._published) > PUBLISHED_MEMORY:
                self._published.popitem(last=False)

    def put(self, parent: str, key: str, start: int, tokens: list[int], snaps: dict[int, Snapshot]) -> bool:
        """Queue edge [start, start + len(tokens)) with its snapshot per stateful layer for writing;
        the tensors are taken now (lazy rows copied out; the snapshots stay the caller's). False
        when dropped."""
        if not self.available():
            self.stats.dropped_writes += 1
            return False
        # Snapshot tensors are never written in place (restores copy out of them) and lazy rows come
        # out as copies, so holding references until the writer sends them is safe.
        layers, tensors = encode_snapshots(snaps)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        with self._lock:
            if self._queued_bytes + nbytes > self.queue_bytes:
                self.stats.dropped_writes += 1
                self._warn("queue", "write queue full (%d bytes waiting): dropped a node", self._queued_bytes)
                return False
            self._queued_bytes += nbytes
        self.remember(parent, key)
        self._queue.put((parent, key, start, list(tokens), layers, tensors, nbytes))
        return True

    def publish(self, keys: list[str]) -> None:
        """Tell the router that this replica holds the prefixes `keys` (sent by the writer thread)."""
        if self.replica and keys and self.available():
            self._queue.put(("at", keys))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every write queued so far was sent; False on timeout."""
        done = threading.Event()
        self._queue.put(("flush", done))
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """At shutdown: send what is queued (waiting at most `timeout_s`), then disconnect."""
        self._queue.put(None)
        self._writer.join(timeout_s)
        self.client.close()

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if item[0] == "flush":
                item[1].set()
            elif item[0] == "at":
                self._send_at(item[1])
            else:
                self._send(*item)

    def _send_at(self, keys: list[str]) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.set(f"{self.ns}:at:{key}", self.replica, ex=self.ttl_s)
            pipe.execute()
        except valkey.ValkeyError as e:
            self._failed("publish", e)

    def _send(self, parent, key, start, tokens, layers, tensors, nbytes) -> None:
        try:
            if not self.available():
                self.stats.dropped_writes += 1
                return
            meta = {
                "format": FORMAT,
                "fingerprint": self.fingerprint,
                "parent": parent,
                "key": key,
                "start": str(start),
                "tokens": json.dumps(tokens),
                "layers": json.dumps(layers, sort_keys=True),
                "data_digest": _data_digest(tensors),
            }
            meta["digest"] = _header_digest(meta)
            blob = safetensors.torch.save(tensors, metadata=meta)
            pipe = self.client.pipeline(transaction=True)
            pipe.set(f"{self.ns}:node:{parent}:{key}", blob, ex=self.ttl_s)
            pipe.hset(f"{self.ns}:kids:{parent}", key, _index_value(start, tokens))
            pipe.expire(f"{self.ns}:kids:{parent}", self.ttl_s)
            if self.replica:
                pipe.set(f"{self.ns}:at:{key}", self.replica, ex=self.ttl_s)
            pipe.execute()
            self.stats.writes += 1
            self.stats.written_bytes += len(blob)
        except valkey.ValkeyError as e:
            self.stats.dropped_writes += 1
            with self._lock:
                self._published.pop((parent, key), None)
            if isinstance(e, valkey.ResponseError):  # e.g. OOM: the store is full, not down
                self.stats.errors += 1
                self._warn("full", "write refused (%s): dropped a node", e)
            else:
                self._failed("write", e)
        finally:
            with self._lock:
                self._queued_bytes -= nbytes


def common_length(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(differ[0]) if len(differ) else n


def layer_fields(caches: list, layers: list[int]) -> dict[int, dict]:
    """The snapshot fields each stateful layer (index in `layers`, its live cache in `caches`) must
    have in an entry read for a model with those caches."""
    fields = {}
    for i in layers:
        cache = caches[i]
        fields[i] = (
            {"kind": "rows", "window": cache.window} if isinstance(cache, KVCache) else {"kind": "scan"}
        )
    return fields
