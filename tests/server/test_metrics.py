"""`/metrics` through prometheus-client: bucket values, every response counted."""

from __future__ import annotations

import http.client
import json
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hybridlm.engine.stats import EngineStats
from hybridlm.server import create_app
from hybridlm.server.metrics import Metrics
from tests.server.inprocess import running


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, parsed by prometheus-client's own parser."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_histogram_buckets_hold_the_observed_values():
    stats = EngineStats()
    for seconds in (0.003, 0.02, 0.02, 7.0, 500.0):
        stats.e2e_seconds.observe(seconds)
    engine = SimpleNamespace(
        stats=stats,
        queue_depth=0,
        num_running=0,
        scheduler=SimpleNamespace(max_running=1),
        memory_occupancy=0.0,
        max_queue=4,
        context_length=64,
        prefix=None,
        speculative=None,
    )
    m = samples(Metrics(engine, "demo").render().decode())
    name = "hybridlm_e2e_request_latency_seconds"
    bucket = lambda le: m[(name + "_bucket", (("le", le),))]
    assert [bucket(le) for le in ("0.0025", "0.005", "0.025", "5.0", "10.0", "120.0", "+Inf")] == [
        0,
        1,
        3,
        3,
        4,
        4,
        5,
    ]
    assert m[(name + "_count", ())] == 5 and m[(name + "_sum", ())] == pytest.approx(507.043)
    # A second scrape reads the same totals (rendering never resets them).
    assert samples(Metrics(engine, "demo").render().decode()) == m


def test_served_histograms_count_every_request(server, client, auth):
    import httpx

    for _ in range(2):
        client.completions.create(model="demo", prompt="Hello", max_tokens=3)
    m = samples(httpx.get(server.url + "/metrics", headers=auth).text)
    name = "hybridlm_e2e_request_latency_seconds"
    count = m[(name + "_count", ())]
    buckets = sorted((float(dict(k[1])["le"]), v) for k, v in m.items() if k[0] == name + "_bucket")
    assert count >= 2 and buckets[-1] == (float("inf"), count)
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative


def test_unhandled_error_is_counted_and_keeps_the_connection(demo_engine, monkeypatch):
    """A bug in a handler answers 500 in OpenAI's shape, is counted, and the keep-alive connection
    serves the next request."""
    engine = demo_engine
    real = engine.tokenizer.encode

    def encode(text, *args, **kwargs):
        if text == "boom":
            raise ZeroDivisionError("injected")
        return real(text, *args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", encode)
    with running(create_app(engine, "demo")) as url:
        conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
        body = json.dumps({"prompt": "boom", "max_tokens": 2})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        error = json.loads(r.read())["error"]
        assert r.status == 500 and error["type"] == "server_error" and "ZeroDivisionError" in error["message"]
        conn.request("GET", "/metrics")  # the same connection
        r = conn.getresponse()
        assert r.status == 200
        m = samples(r.read().decode())
        conn.close()
    key = ("hybridlm_http_requests_total", (("endpoint", "/v1/completions"), ("status", "500")))
    assert m[key] == 1
