"""Real `hybridlm serve` processes on free loopback ports, shared by the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from hybridlm.demo import write_demo_model
from hybridlm.models.tokenizer import Tokenizer

API_KEY = "sk-test-key"
MODEL = "demo"
CONTEXT = 4096


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m hybridlm.cli serve ...` with its output in a log file."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDLM_LOG_LEVEL": "WARNING", **env}
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hybridlm.cli", "serve", "--port", str(self.port), *args],
                env=full_env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self._ready = False

    def ready(self, timeout: float = 240.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while not self._ready:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                self._ready = httpx.get(self.url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not ready:\n{self.log.read_text()}") from None
                time.sleep(0.1)
        return self

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then the exit code (the graceful path); None if it had to be killed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None

    def metrics(self, headers: dict[str, str] | None = None) -> dict[str, float]:
        """Prometheus samples by `name{labels}`."""
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def tokenizer(demo_dir) -> Tokenizer:
    return Tokenizer.from_dir(demo_dir)


@pytest.fixture(scope="session")
def processes(demo_dir, tmp_path_factory):
    """Both servers start at once (they load in parallel); each fixture below waits for its own."""
    logs = tmp_path_factory.mktemp("logs")
    main = ServerProcess(
        [
            "--model",
            str(demo_dir),
            "--model-name",
            MODEL,
            "--api-key",
            API_KEY,
            "--context-length",
            str(CONTEXT),
        ],
        {},
        logs / "main.log",
    )
    # The README path: no --model (the demo model is written into HYBRIDLM_DEMO_DIR), settings from the
    # environment, no API key.
    small = ServerProcess(
        [],
        {
            "HYBRIDLM_DEMO_DIR": str(tmp_path_factory.mktemp("cache") / "demo"),
            "HYBRIDLM_MAX_QUEUE": "1",
            "HYBRIDLM_MAX_RUNNING": "1",  # one running, one waiting: the queue bound is what is tested
            "HYBRIDLM_CONTEXT_LENGTH": "256",
        },
        logs / "small.log",
    )
    # Tight limits, for the hardening tests and the fuzzing (a short context keeps generations short).
    guarded = ServerProcess(
        [
            "--model",
            str(demo_dir),
            "--model-name",
            MODEL,
            "--max-body",
            "64K",
            "--read-timeout",
            "2",
            "--max-connections",
            "4",
            "--context-length",
            "64",
        ],
        {},
        logs / "guarded.log",
    )
    yield {"main": main, "small": small, "guarded": guarded}
    # Stop every server before checking any, so a failing check never leaves a process behind.
    codes = {p.log: p.stop() for p in (main, small, guarded)}
    for log, code in codes.items():
        assert code == 0, log.read_text()


@pytest.fixture(scope="session")
def server(processes) -> ServerProcess:
    return processes["main"].ready()


@pytest.fixture(scope="session")
def small_server(processes) -> ServerProcess:
    return processes["small"].ready()


@pytest.fixture(scope="session")
def guarded(processes) -> ServerProcess:
    return processes["guarded"].ready()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="session")
def demo_engine(demo_dir):
    """An engine on the demo model in this process, for tests that inject faults (monkeypatching)."""
    import hybridlm
    from hybridlm.engine import Engine

    model = hybridlm.load_model(demo_dir)
    with Engine(model.lm, model.tokenizer, context_length=256) as engine:
        yield engine
