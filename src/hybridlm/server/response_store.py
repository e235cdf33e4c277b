"""The Responses API's stored responses (`previous_response_id`, `GET` / `DELETE /v1/responses/{id}`):
an in-process LRU, saved beside the prefix cache's disk tier, and shared through its store tier."""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class Stored:
    response: dict[str, Any]
    history: list[dict[str, Any]]  # the conversation through this response's output
    size: int


class ResponseStore:
    """Responses kept for `previous_response_id` and `GET`, least recently used dropped first beyond
    `max_count` responses or `max_bytes` (their JSON size). With a `path`, `load()` reads what
    `save()` wrote there (a missing or unreadable file: an empty store).

    With `shared` (the prefix cache's `StoreTier`: `--cache-store`), every response is also written
    to that Valkey / Redis store under the model's namespace for the store's TTL, and the store is
    the truth: a replica finds what another stored (the next turn of a conversation routed
    elsewhere, a `GET` on any replica), and a `DELETE` anywhere deletes it everywhere. While the
    store does not answer, this server's own copies serve."""

    def __init__(
        self, max_count: int = 1024, max_bytes: int = 256 << 20, path: Path | None = None, shared=None
    ):
        self.max_count, self.max_bytes, self.path, self.shared = max_count, max_bytes, path, shared
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0

    def _key(self, response_id: str) -> str:
        return f"{self.shared.ns}:response:{response_id}"

    def _shared(self, what: str, call):
        """`call(client)` on the shared store; None (and a warning) when it fails or is skipped."""
        if self.shared is None or not self.shared.available():
            return None
        try:
            return call(self.shared.client)
        except Exception as e:  # valkey errors, a closed connection: the local copies serve
            self.shared._failed(f"responses: {what}", e)
            return None

    def load(self) -> None:
        if self.path is None:
            return
        try:
            for response, history in json.loads(self.path.read_text()):  # least recently used first
                self._put_local(response, history)
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError, KeyError) as e:
            log.warning("responses: %s not read (%s); the store starts empty", self.path, e)
            self._entries.clear()
            self.bytes = 0

    def save(self) -> None:
        """Write the store to `path` (atomically: a crash leaves the previous file)."""
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps([[e.response, e.history] for e in self._entries.values()]))
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("responses: %s not written (%s)", self.path, e)

    def put(self, response: dict[str, Any], history: list[dict[str, Any]]) -> None:
        self._put_local(response, history)
        if self.shared is not None:
            raw = json.dumps([response, history], ensure_ascii=False)
            self._shared("write", lambda c: c.set(self._key(response["id"]), raw, ex=self.shared.ttl_s))

    def _put_local(self, response: dict[str, Any], history: list[dict[str, Any]]) -> None:
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(history, ensure_ascii=False))
        self._drop_local(response["id"])
        if size > self.max_bytes:
            return
        self._entries[response["id"]] = Stored(response, history, size)
        self.bytes += size
        while len(self._entries) > self.max_count or self.bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= dropped.size

    def get(self, response_id: str) -> Stored | None:
        found = self._shared("read", lambda c: (c.get(self._key(response_id)),))
        if found is not None:  # the store answered: it decides
            if found[0] is None:
                self._drop_local(response_id)
                return None
            try:
                response, history = json.loads(found[0])
                self._put_local(response, history)
            except (ValueError, TypeError) as e:
                log.warning("responses: stored %s unreadable (%s)", response_id, e)
                return None
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        removed = self._shared("delete", lambda c: (c.delete(self._key(response_id)),))
        local = self._drop_local(response_id)
        return bool(removed[0]) if removed is not None else local

    def _drop_local(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry is not None

    def __len__(self) -> int:
        return len(self._entries)
