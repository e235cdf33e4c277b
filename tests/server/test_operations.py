"""Operating the server: read deadlines and the connection bound, start-up lines, bind failures
(issue 11, points 7, 16, 18) against real server processes."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx

from tests.server.test_errors import COMPLETIONS, assert_openai_error


def closed_within(sock: socket.socket, seconds: float, trickle: bytes | None = None) -> bool:
    """Whether the server closes `sock` within `seconds`, while we send `trickle` every 0.3 s."""
    sock.settimeout(0.3)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if trickle is not None:
            try:
                sock.sendall(trickle)
            except OSError:
                return True
        try:
            if sock.recv(4096) == b"":
                return True
        except TimeoutError:
            continue
        except OSError:
            return True
    return False


def test_a_trickled_request_head_is_cut_off(guarded):
    """--read-timeout 2: a head still incomplete after 2 s (one header line every 0.3 s) is closed."""
    with socket.create_connection(("127.0.0.1", guarded.port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        assert closed_within(s, 15, trickle=b"X-Slow: 1\r\n")
    assert httpx.get(guarded.url + "/health").status_code == 200


def test_a_stalled_body_gets_408(guarded):
    with socket.create_connection(("127.0.0.1", guarded.port)) as s:
        s.sendall(f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{{".encode())
        s.settimeout(15)
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 408"), head


def test_connections_beyond_the_bound_get_a_counted_json_503(guarded):
    """--max-connections 4: with four other connections open, a fifth's request is refused with a 503
    in OpenAI's error shape, which /metrics counts; once they close, requests are served again."""
    key = 'hybridlm_http_requests_total{endpoint="%s",status="503"}'
    before = guarded.metrics()
    idle = [socket.create_connection(("127.0.0.1", guarded.port)) for _ in range(4)]
    try:
        deadline = time.monotonic() + 10
        while (refused := httpx.get(guarded.url + "/v1/models")).status_code != 503:
            assert time.monotonic() < deadline  # until the server has accepted all four
            time.sleep(0.05)
        assert_openai_error(refused, 503, code="too_many_connections")
        assert refused.headers["retry-after"] == "1"
        health = httpx.get(guarded.url + "/health")
        assert (health.status_code, health.json()["error"]["code"]) == (503, "too_many_connections")
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 10
    while httpx.get(guarded.url + "/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    after = guarded.metrics()
    assert after[key % "/v1/models"] - before.get(key % "/v1/models", 0) >= 1
    assert after[key % "/health"] - before.get(key % "/health", 0) >= 1


def test_start_up_summary_then_serving_once_listening(guarded):
    lines = guarded.log.read_text().splitlines()
    loaded = next(i for i, line in enumerate(lines) if line.startswith("hybridlm: loaded "))
    serving = next(i for i, line in enumerate(lines) if line.startswith("hybridlm: serving "))
    assert loaded < serving
    for part in ("qwen3_5", "M parameters", "bfloat16", "cpu", "threads", "kernels", "prefix cache ram"):
        assert part in lines[loaded], lines[loaded]
    assert "speculative off" in lines[loaded]


def test_serving_is_announced_only_once_the_port_accepts(tmp_path, demo_dir):
    """The line comes after the bind: whoever reads it can connect at once."""
    from tests.server.conftest import ServerProcess

    server = ServerProcess(["--model", str(demo_dir)], {}, tmp_path / "log")
    try:
        deadline = time.monotonic() + 90
        while "hybridlm: serving" not in server.log.read_text():
            assert server.proc.poll() is None and time.monotonic() < deadline, server.log.read_text()
            time.sleep(0.02)
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    finally:
        assert server.stop() == 0


def test_a_port_in_use_is_one_line_and_a_nonzero_exit(guarded):
    r = subprocess.run(
        [sys.executable, "-m", "hybridlm.cli", "serve", "--port", str(guarded.port)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "cannot listen" in r.stderr, r.stderr
    assert "serving" not in r.stderr


def test_a_body_over_max_body_is_413_before_it_is_read(guarded):
    r = httpx.post(guarded.url + COMPLETIONS, content=b"x" * (65 << 10))
    assert_openai_error(r, 413, None, "body_too_large")
