"""Shutdown past --graceful-timeout (issue 11, point 17): /health turns 503 at once, running streams
end with a final chunk and [DONE], the process exits within the timeout, and the log stays quiet."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from tests.server.conftest import ServerProcess

GRACE = 3.0


def test_drain_past_the_graceful_timeout(demo_dir, tmp_path):
    server = ServerProcess(["--model", str(demo_dir), "--graceful-timeout", str(GRACE)], {}, tmp_path / "log")
    try:
        server.ready()
        body = {"prompt": "Once", "max_tokens": 30000, "ignore_eos": True, "stream": True}
        lines: list[str] = []
        started = threading.Event()

        def stream(url):
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()

        reader = threading.Thread(target=stream, args=(server.url,))
        reader.start()
        assert started.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        time.sleep(0.3)
        health = httpx.get(server.url + "/health", timeout=5)
        assert (health.status_code, health.json()) == (503, {"status": "draining"})
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}, timeout=5)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert server.proc.wait(GRACE + 10) == 0
        took = time.monotonic() - t0
        reader.join(10)
    finally:
        server.stop()
    assert took < GRACE + 3, took
    assert lines[-1] == "data: [DONE]"
    final = json.loads(lines[-2].removeprefix("data: "))
    assert final["choices"][0]["finish_reason"] == "cancelled"
    log = server.log.read_text()
    assert "Traceback" not in log and len(log.splitlines()) <= 4, log
