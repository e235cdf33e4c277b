"""hybridlm replicas as a Ray Serve deployment behind a prefix-aware request router.

`HybridReplica` runs one engine and hybridlm's own OpenAI app (called in-process through ASGI, so
validation and responses are the server's), with the shared store tier; it publishes, under its
Ray replica id, the store keys of the prefixes it holds (`StoreTier.publish`). `PrefixAwareRouter`
(a Ray Serve `RequestRouter`) tokenizes each request as the replica will, walks the store's index
for the longest exactly restorable prefix and ranks first the replica that last held the deepest
stored node of it, unless that replica is busier than another (load fallback: then all replicas
form one rank and Ray picks the least loaded, as it does when the holder is at
`max_ongoing_requests`). `Frontend` is the HTTP ingress (POST /v1/completions, /v1/chat/completions,
non-streaming). Needs `pip install "ray[serve]"` (not a dependency of hybridlm).

No `from __future__ import annotations` here: FastAPI reads the ingress methods' annotations at
run time, in Ray's copy of the class.
"""

import asyncio
import logging
import os
from dataclasses import dataclass

import valkey
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve
from ray.exceptions import RayError
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, RequestRouter

log = logging.getLogger(__name__)


@dataclass
class RayCluster:
    """What `build` needs: checkpoint directory, store URL, the model's fingerprint
    (`model_fingerprint`), replica count, torch threads per replica, more `hybridlm serve` flags."""

    model: str
    store_url: str
    fingerprint: str
    replicas: int = 3
    threads: int = 1
    serve_args: tuple[str, ...] = ()


def request_tokens(tokenizer, path: str, body: dict) -> list[int] | None:
    """The prompt's token ids as hybridlm's server makes them (None when it cannot be read)."""
    try:
        if path.endswith("/chat/completions"):
            from hybridlm.server.protocol import ChatCompletionRequest, render_chat

            return tokenizer.encode(render_chat(tokenizer, ChatCompletionRequest.model_validate(body)))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
    except Exception:  # a bad request is the replica's to answer (with its error body), not ours
        return None
    return None


class PrefixAwareRouter(FIFOMixin, RequestRouter):
    """Sends a request to the replica that last held the deepest stored node of its prompt, unless
    that replica has more requests in flight (from this router) than the least loaded one: then
    every replica is ranked together and Ray takes the least loaded. Any replica can restore any
    stored prefix from the store, so locality only saves reading entries: load wins ties' opposite."""

    def initialize_state(self, model: str, store_url: str, fingerprint: str) -> None:
        from hybridlm.models.tokenizer import Tokenizer
        from hybridlm.prefix.store import StoreTier

        self.tokenizer = Tokenizer.from_dir(model)
        self.store = StoreTier(store_url, fingerprint, retry_s=2.0)
        self.in_flight: dict[str, int] = {}

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        rid = replica_id.unique_id
        self.in_flight[rid] = self.in_flight.get(rid, 0) + 1
        result.add_done_callback(lambda *_: self.in_flight.__setitem__(rid, self.in_flight[rid] - 1))

    def holder(self, path: str, body: dict) -> str | None:
        """The Ray replica id published for the deepest stored node of the prompt, or None."""
        ids = request_tokens(self.tokenizer, path, body)
        if not ids:
            return None
        edges = self.store.find(ids[:-1])
        keys = [f"{self.store.ns}:at:{e.key}" for e in edges if e.end <= len(ids) - 1]
        if not keys:
            return None
        try:
            owners = self.store.client.mget(keys[::-1])
        except valkey.ValkeyError as e:  # the store is down: route by load
            log.warning("prefix router: store lookup failed (%s)", e)
            return None
        return next((o.decode() for o in owners if o is not None), None)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if pending_request is None or len(pending_request.args) != 2:
            return [candidate_replicas]
        owner = await asyncio.to_thread(self.holder, *pending_request.args)
        load = {
            r.replica_id.unique_id: self.in_flight.get(r.replica_id.unique_id, 0) for r in candidate_replicas
        }
        if owner not in load or load[owner] > min(load.values()):
            return [candidate_replicas]
        first = [r for r in candidate_replicas if r.replica_id.unique_id == owner]
        rest = [r for r in candidate_replicas if r.replica_id.unique_id != owner]
        return [first, rest] if rest else [first]


class HybridReplica:
    """One engine with the store tier, answering through hybridlm's own app (in-process ASGI)."""

    def __init__(self, spec: RayCluster) -> None:
        import httpx
        import torch

        from hybridlm.cli import build_parser, load, make_engine
        from hybridlm.server.app import create_app

        torch.set_num_threads(spec.threads)
        self.me = serve.get_replica_context().replica_id.unique_id
        args = ["serve", "--model", spec.model, "--cache-store", spec.store_url, "--replica", self.me]
        args = build_parser().parse_args([*args, *spec.serve_args])
        self.engine = make_engine(load(args), args)
        app = create_app(self.engine, args.model_name or "hybridlm")
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://replica")

    async def __call__(self, path: str, body: dict) -> tuple[int, dict, dict]:
        response = await self.client.post(path, json=body, timeout=600)
        return (
            response.status_code,
            response.json(),
            {"x-hybridlm-replica": self.me, "x-hybridlm-pid": str(os.getpid())},
        )


http = FastAPI()


@serve.ingress(http)
class Frontend:
    """HTTP ingress: forwards OpenAI requests (non-streaming) to a replica chosen by the router;
    the answer names the replica (headers x-hybridlm-replica, x-hybridlm-pid)."""

    def __init__(self, replica) -> None:
        self.replica = replica

    async def _forward(self, path: str, request: Request) -> JSONResponse:
        try:
            status, body, headers = await self.replica.remote(path, await request.json())
        except RayError as e:  # the replica died with the request (the only requests a crash may fail)
            error = {"message": f"the replica failed: {type(e).__name__}", "type": "server_error"}
            return JSONResponse({"error": error}, status_code=503)
        return JSONResponse(body, status_code=status, headers=headers)

    @http.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._forward("/v1/completions", request)

    @http.post("/v1/chat/completions")
    async def chat(self, request: Request):
        return await self._forward("/v1/chat/completions", request)


def build(spec: RayCluster):
    """The Ray Serve application: Frontend -> HybridReplica × spec.replicas (prefix-aware router)."""
    router = RequestRouterConfig(
        request_router_class=PrefixAwareRouter,
        request_router_kwargs={
            "model": spec.model,
            "store_url": spec.store_url,
            "fingerprint": spec.fingerprint,
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
