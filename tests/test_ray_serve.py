"""hybridlm replicas under Ray Serve behind the prefix-aware router, with a real redis-server: a
conversation's next turn goes to the replica holding its prefix, a busy holder hands it to an idle
replica (which restores the prefix from the store), and a replica killed mid-request fails only
that request."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

ray = pytest.importorskip("ray")  # in the test extra; skipped only where it cannot be installed
from ray import serve  # noqa: E402

from hybridlm.cluster import Deployment, free_port  # noqa: E402
from hybridlm.demo import write_demo_model  # noqa: E402
from hybridlm.models import load_model  # noqa: E402
from hybridlm.prefix.disk import model_fingerprint  # noqa: E402
from hybridlm.ray_serve import RayCluster, build  # noqa: E402

MODEL = "hybridlm"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    demo = write_demo_model(tmp_path_factory.mktemp("demo"))
    fingerprint = model_fingerprint(load_model(demo, dtype=torch.bfloat16, device="cpu"))
    store = Deployment(0, store=True, policy=None).start()
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        spec = RayCluster(
            str(demo), store.store_url, fingerprint, replicas=2, serve_args=("--model-name", MODEL)
        )
        serve.run(build(spec), route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        store.stop()


def chat(url: str, messages: list[dict], max_tokens: int = 4, **extra) -> tuple[int, dict, dict]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), dict(e.headers)


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


class Background:
    """A long request (thousands of tokens) running in a thread; `result` = (status, body, headers)."""

    def __init__(self, url: str):
        self.result: tuple | None = None
        long = [{"role": "user", "content": "Write a very long story."}]
        self.thread = threading.Thread(
            target=lambda: setattr(self, "result", chat(url, long, 3000, ignore_eos=True))
        )
        self.thread.start()
        time.sleep(1.5)  # routed and decoding

    def join(self) -> tuple:
        self.thread.join(180)
        return self.result


def test_next_turn_goes_to_the_holder_unless_busy_and_survives_a_killed_replica(app):
    messages = [{"role": "user", "content": "Describe a harbour at dawn, with boats and gulls. " * 4}]
    status, first, where = chat(app, messages)
    assert status == 200
    holder = where["x-hybridlm-replica"]
    messages += [first["choices"][0]["message"], {"role": "user", "content": "And at noon?"}]
    time.sleep(0.5)  # store writes are asynchronous
    status, second, where = chat(app, messages)
    assert status == 200 and where["x-hybridlm-replica"] == holder and cached(second) > 0

    # The holder may be busy with a long request: then the next turn goes to the idle replica,
    # which restores the conversation from the store.
    long = Background(app)
    messages += [second["choices"][0]["message"], {"role": "user", "content": "And at dusk?"}]
    status, third, where = chat(app, messages)
    long_status, _, long_where = long.join()
    assert status == long_status == 200 and cached(third) > cached(second)
    assert where["x-hybridlm-replica"] != long_where["x-hybridlm-replica"]

    # Kill the replica serving a long request: that request fails (503), no later one does.
    long = Background(app)
    os.kill(int(long_where["x-hybridlm-pid"]), signal.SIGKILL)
    assert long.join()[0] == 503
    for _ in range(4):
        status, body, where = chat(app, messages)
        assert status == 200 and cached(body) > 0, body
