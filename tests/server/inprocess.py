"""A uvicorn server on a free loopback port, in a thread of the test process: for tests that inject
faults into the engine (monkeypatching) yet need a real HTTP server (keep-alive, sockets)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from tests.server.conftest import free_port


@contextmanager
def running(app, **config) -> Iterator[str]:
    """Serve `app` (extra `uvicorn.Config` arguments in `config`) and yield its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    thread = threading.Thread(target=server.run, name="test-uvicorn")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
