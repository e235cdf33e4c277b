"""A read-only cache directory, with a leftover temporary file in it, against a real server process
(issue 11, points 11 and 12): the server starts, serves every request, says so once, and stays
healthy. Needs a read-only mount (the tests run as root, which file permissions do not stop);
skipped where mounting is not allowed."""

from __future__ import annotations

import subprocess

import httpx
import pytest

import hybridlm
from hybridlm.prefix.disk import model_fingerprint
from tests.server.conftest import ServerProcess


@pytest.fixture
def read_only_dir(tmp_path, demo_dir):
    directory = tmp_path / "cache"
    directory.mkdir()
    fingerprint = model_fingerprint(hybridlm.load_model(demo_dir).lm)
    (directory / f".{fingerprint}.node-x.safetensors.tmp").write_bytes(b"torn by a crash")
    mount = subprocess.run(
        ["mount", "--bind", "-o", "ro", str(directory), str(directory)], capture_output=True
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount read-only here: {mount.stderr.decode().strip()}")
    try:
        with pytest.raises(OSError):
            (directory / "probe").write_bytes(b"")
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def test_a_read_only_cache_dir_never_stalls_the_engine(demo_dir, read_only_dir, tmp_path):
    server = ServerProcess(
        # A RAM budget that holds about one node (one smaller than any restore point stores nothing).
        ["--model", str(demo_dir), "--cache-dir", str(read_only_dir), "--cache-ram", "1M"],
        {},
        tmp_path / "log",
    )
    try:
        server.ready()
        for i in range(6):  # a tiny RAM budget: every request demotes nodes, and every write fails
            body = {"prompt": f"request {i} " + "cache " * 200, "max_tokens": 4}
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    finally:
        assert server.stop() == 0
    log = server.log.read_text()
    assert "Traceback" not in log, log
    assert log.count("leftover temporary file") == 1 and log.count("failed") == 1, log
