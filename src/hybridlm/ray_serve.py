"""hybridlm replicas as a Ray Serve deployment behind a prefix-aware request router.

`HybridReplica` runs one engine and hybridlm's own app (called in-process through ASGI, so
validation, errors and streams are the server's), with the shared store tier when there is one; it
publishes, under its Ray replica id, the store keys of the prefixes it holds (`StoreTier.publish`).
`Frontend` is the HTTP ingress: the OpenAI, Anthropic and Ollama generation routes, streamed
through (SSE / NDJSON as the replica writes them), and `GET` / `DELETE` of stored responses, which
the replicas share through the store (`server.responses.ResponseStore`). `PrefixAwareRouter` (a Ray Serve
`RequestRouter`) picks the replica; see its docstring.

No `from __future__ import annotations` here: FastAPI reads the ingress methods' annotations at
run time, in Ray's copy of the class.
"""

import asyncio
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import valkey
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayError
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import RequestRouter

from hybridlm.prefix.store import common_length

log = logging.getLogger(__name__)

# The generation routes the frontend forwards (the replica's own app answers them).
ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/api/chat",
    "/api/generate",
)
POLICIES = ("prefix", "round_robin")
RECENT = 256  # answered requests the router remembers (prompt tokens, replica)
RECENT_S = 30.0  # ... for this long: a store write lands within a second unless it failed
POLL_S = 0.02  # how often a waiting router looks at the store again


@dataclass
class RayCluster:
    """What `build` needs: checkpoint directory, store URL (None: private caches), the model's
    fingerprint (`model_fingerprint`; the store's namespace), replica count, torch threads per
    replica, more `hybridlm serve` flags, the routing policy (`prefix` or `round_robin`) and how long
    the router waits for an answer's store write before sending a follow-up to another replica."""

    model: str
    store_url: str | None
    fingerprint: str | None
    replicas: int = 3
    threads: int = 1
    serve_args: tuple[str, ...] = ()
    policy: str = "prefix"
    wait_s: float = 2.0


def request_tokens(tokenizer, path: str, raw: bytes, responses=None) -> list[int] | None:
    """The prompt's token ids as hybridlm's server makes them (None when the route has no OpenAI
    prompt or the body cannot be read: the replica answers it, with its own error body). A
    Responses request continuing a stored one (`previous_response_id`) is read through `responses`
    (a `ResponseStore` on the shared store), as the replica will read it."""
    try:
        body = json.loads(raw)
        if path == "/v1/chat/completions":
            from hybridlm.server.protocol import ChatCompletionRequest, chat_prompt

            return chat_prompt(tokenizer, ChatCompletionRequest.model_validate(body))[1]
        if path == "/v1/responses":
            from hybridlm.server.responses import ResponsesRequest, prepare

            request = ResponsesRequest.model_validate(body)
            earlier = []
            if request.previous_response_id:
                previous = responses.get(request.previous_response_id) if responses is not None else None
                if previous is None:  # no shared store, or not found: the replica answers
                    return None
                earlier = previous.history
            return prepare(tokenizer, request, earlier).ids
        if path != "/v1/completions":
            return None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
    except Exception:  # a bad request is the replica's to answer, not ours
        return None
    return None


@dataclass
class Routed:
    """A request the router sent: its prompt tokens, the replica, when its answer ended (None
    while in flight)."""

    tokens: np.ndarray
    replica: str
    done: float | None = None


class PrefixAwareRouter(RequestRouter):
    """Ranks the replicas for each request (Ray tries the ranks in order, skipping replicas at
    `max_ongoing_requests`, and gives the replica to that very request: no FIFO mixin, which would
    hand a replica chosen for one prompt to whichever request is oldest).

    `prefix`: the holder of the request's longest reusable prefix first — the replica named by the
    store's `at` key of its deepest stored node, or, when the router itself sent a longer prefix
    of it to a replica whose store write has not landed yet, that replica (it holds the prefix in
    RAM) — unless the holder has more requests in flight than another replica; then (and with no
    holder) the replicas by requests in flight. Any replica can restore a stored prefix from the
    store, so locality saves reading entries and load wins.

    `round_robin`: the next replica in turn (every conversation spread over all replicas: the
    shared store's worst case).

    Fast follow-ups, both modes: when the chosen replica is not the one that answered a longer
    prefix of the request less than `RECENT_S` ago and the store does not hold that prefix yet (a
    write lands 50–200 ms after its answer), the router waits for it, polling the store, at most
    `wait_s`. Only this request waits; the write is never waited on by the replica that makes it.
    """

    def initialize_state(
        self,
        model: str,
        store_url: str | None,
        fingerprint: str | None,
        policy: str = "prefix",
        wait_s: float = 2.0,
    ) -> None:
        from hybridlm.models.tokenizer import Tokenizer
        from hybridlm.prefix.store import StoreTier
        from hybridlm.server.response_store import ResponseStore

        self.tokenizer = Tokenizer.from_dir(model)
        self.store = StoreTier(store_url, fingerprint, retry_s=2.0) if store_url else None
        self.responses = ResponseStore(max_count=RECENT, shared=self.store) if self.store else None
        self.policy = policy
        self.wait_s = wait_s
        self.turn = 0  # round-robin position
        self.prompts: dict[str, list[int]] = {}  # request id -> prompt tokens, until routed
        self.routed: dict[str, Routed] = {}  # request id -> in flight
        self.recent: deque[Routed] = deque(maxlen=RECENT)

    # ---- what the router knows ----------------------------------------------------------
    def stored(self, ids: list[int]) -> tuple[int, str | None]:
        """(tokens of `ids` the store can restore, the replica published for its deepest stored
        node or None). Blocking: called off the event loop."""
        if self.store is None:
            return 0, None
        keep = ids[:-1]
        edges = self.store.find(keep)
        if not edges:
            return 0, None
        reach = edges[-1].start + common_length(edges[-1].tokens, keep[edges[-1].start :])
        keys = [f"{self.store.ns}:at:{e.key}" for e in edges if e.end <= len(keep)]
        if not keys:
            return reach, None
        try:
            owners = self.store.client.mget(keys[::-1])
        except valkey.ValkeyError as e:  # the store is down: route by load
            log.warning("prefix router: store lookup failed (%s)", e)
            return reach, None
        return reach, next((o.decode() for o in owners if o is not None), None)

    def fresh(self, ids: list[int], reach: int) -> tuple[int, str] | None:
        """(tokens, replica) of the longest prefix of `ids` that a replica answered recently and
        the store does not hold yet (beyond `reach`), or None."""
        now, ids = time.monotonic(), np.asarray(ids, dtype=np.int64)
        while self.recent and now - self.recent[0].done > RECENT_S:
            self.recent.popleft()
        best = None
        for r in self.recent:
            n = min(common_length(r.tokens, ids), len(ids) - 1)
            if n > reach and (best is None or n > best[0]):
                best = (n, r.replica)
        return best

    def in_flight(self, candidates) -> dict[str, int]:
        load = {r.replica_id.unique_id: 0 for r in candidates}
        for r in self.routed.values():
            if r.replica in load:
                load[r.replica] += 1
        return load

    # ---- Ray's hooks ----------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        ids = None
        if pending_request is not None and len(pending_request.args) == 2:
            path, raw = pending_request.args
            ids = await asyncio.to_thread(request_tokens, self.tokenizer, path, raw, self.responses)
        if ids:
            rid = pending_request.metadata.internal_request_id
            self.prompts[rid] = ids
            while len(self.prompts) > RECENT:  # requests cancelled before they were routed
                self.prompts.pop(next(iter(self.prompts)))
        reach, owner = await asyncio.to_thread(self.stored, ids) if ids else (0, None)
        fresh = self.fresh(ids, reach) if ids else None
        if self.policy == "round_robin":
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            k = self.turn % len(ordered)
            ranks = [[r] for r in ordered[k:] + ordered[:k]]
        else:
            load = self.in_flight(candidate_replicas)
            holder = fresh[1] if fresh else owner
            by_load = sorted(candidate_replicas, key=lambda r: load[r.replica_id.unique_id])
            ranks = [[r] for r in by_load]
            if holder in load and load[holder] <= min(load.values()):
                ranks.sort(key=lambda rank: rank[0].replica_id.unique_id != holder)
        if fresh and self.store is not None and ranks[0][0].replica_id.unique_id != fresh[1]:
            await self.wait_for_store(ids, fresh[0])
        return ranks

    async def wait_for_store(self, ids: list[int], wanted: int) -> None:
        """Poll the store until it can restore `wanted` tokens of `ids`, at most `wait_s`."""
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline and self.store.available():
            await asyncio.sleep(POLL_S)
            if (await asyncio.to_thread(self.stored, ids))[0] >= wanted:
                return
        log.info("prefix router: a store write did not land within %.1f s", self.wait_s)

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        rid = pending_request.metadata.internal_request_id
        self.turn += 1
        ids = self.prompts.pop(rid, None)
        self.routed[rid] = Routed(np.asarray(ids or [], dtype=np.int64), replica_id.unique_id)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        routed = self.routed.pop(internal_request_id, None)
        if routed is not None and len(routed.tokens):
            routed.done = time.monotonic()
            self.recent.append(routed)


class HybridReplica:
    """One engine (with the store tier when the spec has one), answering through hybridlm's own
    app called in-process over ASGI."""

    def __init__(self, spec: RayCluster) -> None:
        import torch

        from hybridlm.server.app import create_app
        from hybridlm.settings import Settings, load, make_engine

        torch.set_num_threads(spec.threads)
        self.me = serve.get_replica_context().replica_id.unique_id
        flags = ["--model", spec.model]
        if spec.store_url:
            flags += ["--cache-store", spec.store_url, "--replica", self.me]
        settings = Settings.parse([*flags, *spec.serve_args])
        self.engine = make_engine(load(settings), settings)
        self.app = create_app(self.engine, settings.model_name or "hybridlm")
        self.tasks: set[asyncio.Task] = set()

    async def __call__(self, path: str, raw: bytes, method: str = "POST"):
        """Yields (status, headers) first, then the body's chunks as the app sends them."""
        messages: asyncio.Queue = asyncio.Queue()
        disconnected = asyncio.Event()
        received = False

        async def receive() -> dict:
            nonlocal received
            if not received:
                received = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await disconnected.wait()  # the app watches for the client leaving a stream
            return {"type": "http.disconnect"}

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
            "client": ("127.0.0.1", 0),
            "server": ("replica", 80),
        }
        def ended(task: asyncio.Task) -> None:
            self.tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:  # the app sent its 500 first
                log.error("replica: the app failed", exc_info=task.exception())
            messages.put_nowait(None)

        task = asyncio.create_task(self.app(scope, receive, messages.put))
        self.tasks.add(task)  # held until it ends (the loop keeps only weak references)
        task.add_done_callback(ended)
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    headers = {k.decode(): v.decode() for k, v in message.get("headers", [])}
                    headers.pop("content-length", None)
                    headers.update({"x-hybridlm-replica": self.me, "x-hybridlm-pid": str(os.getpid())})
                    yield message["status"], headers
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        break
        finally:
            # the answer is complete, or the caller went away (Ray cancels this generator): either
            # way the app sees the client gone and cancels what it still runs
            disconnected.set()


http = FastAPI()


@serve.ingress(http)
class Frontend:
    """HTTP ingress: forwards the generation routes to a replica chosen by the router and streams
    its answer back; the answer names the replica (headers x-hybridlm-replica, x-hybridlm-pid). A
    replica that dies before answering fails its requests with 503; one that dies mid-stream
    breaks the stream (the only requests a crash may fail)."""

    def __init__(self, replica) -> None:
        self.replica = replica.options(stream=True)

    @http.get("/v1/responses/{response_id}")
    async def retrieve(self, response_id: str):
        """A stored response, from any replica: they share them through the store (`--cache-store`)."""
        return await self._answer(self.replica.remote(f"/v1/responses/{response_id}", b"", method="GET"))

    @http.delete("/v1/responses/{response_id}")
    async def delete(self, response_id: str):
        return await self._answer(self.replica.remote(f"/v1/responses/{response_id}", b"", method="DELETE"))

    @http.post("/{route:path}")
    async def forward(self, route: str, request: Request):
        path = "/" + route
        if path not in ROUTES:
            routes = ", ".join(ROUTES)
            error = {"message": f"no route {path} here (routed: {routes})", "type": "not_found_error"}
            return JSONResponse({"error": error}, status_code=404)
        return await self._answer(self.replica.remote(path, await request.body()))

    async def _answer(self, answer):
        """The replica's answer streamed back with its status and headers; 503 if it failed first."""
        try:
            status, headers = await answer.__anext__()
        except (RayError, StopAsyncIteration) as e:
            answer.cancel()
            error = {"message": f"the replica failed: {type(e).__name__}", "type": "server_error"}
            return JSONResponse({"error": error}, status_code=503)
        media = headers.pop("content-type", None)
        return StreamingResponse(answer, status_code=status, headers=headers, media_type=media)


def build(spec: RayCluster):
    """The Ray Serve application: Frontend -> HybridReplica × spec.replicas (PrefixAwareRouter)."""
    if spec.policy not in POLICIES:
        raise ValueError(f"routing policy {spec.policy!r}: choose one of {', '.join(POLICIES)}")
    router = RequestRouterConfig(
        request_router_class=PrefixAwareRouter,
        request_router_kwargs={
            "model": spec.model,
            "store_url": spec.store_url,
            "fingerprint": spec.fingerprint,
            "policy": spec.policy,
            "wait_s": spec.wait_s,
        },
    )
    replica = serve.deployment(
        HybridReplica,
        num_replicas=spec.replicas,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=4,
        request_router_config=router,
    )
    frontend = serve.deployment(Frontend, ray_actor_options={"num_cpus": 0})
    return frontend.bind(replica.bind(spec))
