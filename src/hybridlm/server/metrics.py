"""`GET /metrics`: Prometheus text exposition (format 0.0.4) of HTTP and engine counters."""

from __future__ import annotations

import threading
from collections import Counter

from hybridlm.engine import Engine
from hybridlm.engine.stats import Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "hybridlm_"


class HTTPStats:
    """HTTP responses by (endpoint, status code), counted when a response starts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._responses: Counter = Counter()

    def count(self, endpoint: str, status: int) -> None:
        with self._lock:
            self._responses[(endpoint, status)] += 1

    def snapshot(self) -> dict[tuple[str, int], int]:
        with self._lock:
            return dict(self._responses)


def _escape(value) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _series(lines: list[str], kind: str, name: str, help_text: str, samples) -> None:
    """One metric family: its HELP and TYPE lines, then a line per (labels dict, value) sample."""
    lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}"]
    lines += [f"{PREFIX}{name}{_labels(**labels)} {value}" for labels, value in samples]


def _histogram(lines: list[str], name: str, help_text: str, h: Histogram) -> None:
    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
    for bound, count in zip((*h.buckets, float("inf")), h.cumulative(), strict=True):
        le = "+Inf" if bound == float("inf") else repr(bound)
        lines.append(f"{name}_bucket{_labels(le=le)} {count}")
    lines += [f"{name}_sum {h.sum!r}", f"{name}_count {h.count}"]


_HISTOGRAM_HELP = {
    "queue_seconds": "Seconds requests waited in the queue.",
    "time_to_first_token_seconds": "Seconds from arrival to the first generated token.",
    "prefill_seconds": "Seconds spent prefilling prompts.",
    "time_per_output_token_seconds": "Mean seconds per generated token after the first, per request.",
    "e2e_request_latency_seconds": "Seconds from arrival to finish.",
    "step_seconds": "Seconds per engine step (one unit of work for every running sequence).",
    "batch_rows": "Tokens run per engine step (decode and verify rows plus prefill chunks).",
}


def render(engine: Engine, http: HTTPStats, model_name: str) -> str:
    """The whole exposition text."""
    stats = engine.stats
    with stats.lock:
        finished = dict(stats.finished)
        tokens = {
            "prompt_tokens_total": ("Prompt tokens of finished requests.", stats.prompt_tokens),
            "prefilled_tokens_total": ("Prompt tokens run through the model.", stats.prefilled_tokens),
            "cached_tokens_total": ("Prompt tokens restored from the prefix cache.", stats.cached_tokens),
            "generation_tokens_total": (
                "Tokens generated (cancelled requests included).",
                stats.generation_tokens,
            ),
        }
        histograms = {
            name: Histogram(h.buckets, list(h.counts), h.sum, h.count)
            for name, h in stats.histograms().items()
        }
    lines = [
        f"# HELP {PREFIX}http_requests_total HTTP responses by endpoint and status code.",
        f"# TYPE {PREFIX}http_requests_total counter",
    ]
    for (endpoint, status), n in sorted(http.snapshot().items()):
        lines.append(f"{PREFIX}http_requests_total{_labels(endpoint=endpoint, status=status)} {n}")
    lines += [
        f"# HELP {PREFIX}requests_finished_total Engine requests by finish reason.",
        f"# TYPE {PREFIX}requests_finished_total counter",
    ]
    for reason in sorted(set(finished) | {"stop", "length", "cancelled", "error"}):
        lines.append(f"{PREFIX}requests_finished_total{_labels(reason=reason)} {finished.get(reason, 0)}")
    for name, (help_text, value) in tokens.items():
        _series(lines, "counter", name, help_text, [({}, value)])
    gauges = {
        "queue_depth": ("Requests waiting to be scheduled.", engine.queue_depth),
        "requests_running": ("Requests being prefilled or decoded.", engine.num_running),
        "running_limit": ("Most sequences advanced together (--max-running).", engine.max_running),
        "slot_occupancy": (
            "Fraction of the memory for running sequences' caches their admission reserved.",
            engine.memory_occupancy,
        ),
        "queue_limit": ("Most requests allowed to wait.", engine.max_queue),
        "context_length": ("Most tokens per request.", engine.context_length),
    }
    for name, (help_text, value) in gauges.items():
        _series(lines, "gauge", name, help_text, [({}, value)])
    for name, h in histograms.items():
        _histogram(lines, PREFIX + name, _HISTOGRAM_HELP[name], h)
    if engine.prefix is not None:
        _prefix_cache(lines, engine.prefix)
    if engine.speculative is not None:
        _speculative(lines, engine.speculative)
    lines += [
        f"# HELP {PREFIX}model_info The served model.",
        f"# TYPE {PREFIX}model_info gauge",
        f"{PREFIX}model_info{_labels(model=model_name)} 1",
    ]
    return "\n".join(lines) + "\n"


def _prefix_cache(lines: list[str], prefix) -> None:
    """Prefix-cache gauges and counters (read without the engine lock: a scrape may see one request's
    update half done, which Prometheus tolerates)."""
    stats = prefix.stats
    gauges = {
        "prefix_cache_bytes": (
            "Bytes held by prefix-cache snapshots, by tier.",
            [({"tier": "ram"}, prefix.ram_bytes), ({"tier": "disk"}, prefix.disk_bytes)],
        ),
        "prefix_cache_nodes": (
            "Nodes in the prefix trie, by tier.",
            [({"tier": "ram"}, prefix.ram_nodes), ({"tier": "disk"}, prefix.disk_nodes)],
        ),
    }
    counters = {
        "prefix_cache_hits_total": ("Requests that reused a cached prefix.", [({}, stats.hits)]),
        "prefix_cache_misses_total": (
            "Requests that reused nothing: no shared prefix, or a shared prefix that could not be restored.",
            [
                ({"reason": "no_shared_prefix"}, stats.misses_no_prefix),
                ({"reason": "not_restorable"}, stats.misses_unrestorable),
            ],
        ),
        "prefix_cache_evicted_nodes_total": (
            "Trie nodes deleted to keep the budget.",
            [({}, stats.evicted_nodes)],
        ),
        "prefix_cache_disk_writes_total": ("Nodes demoted to the disk tier.", [({}, stats.disk_writes)]),
        "prefix_cache_disk_reads_total": ("Nodes loaded back from the disk tier.", [({}, stats.disk_reads)]),
        "prefix_cache_disk_errors_total": ("Disk-tier files found unusable.", [({}, stats.disk_errors)]),
        "prefix_cache_compacted_snapshots_total": (
            "Snapshots whose scan-input logs were dropped to keep the budget.",
            [({}, stats.compacted_snapshots)],
        ),
    }
    for kind, table in (("gauge", gauges), ("counter", counters)):
        for name, (help_text, samples) in table.items():
            _series(lines, kind, name, help_text, samples)


def _speculative(lines: list[str], speculator) -> None:
    """Speculative decoding counters and the controller's acceptance estimate (read unlocked, like
    the prefix cache's)."""
    totals = speculator.totals
    counters = {
        "speculative_drafted_tokens_total": ("Draft tokens verified by the target.", totals.drafted_tokens),
        "speculative_accepted_tokens_total": ("Draft tokens accepted.", totals.accepted_tokens),
        "speculative_verify_passes_total": ("Target forwards that verified a draft.", totals.verify_passes),
    }
    for name, (help_text, value) in counters.items():
        _series(lines, "counter", name, help_text, [({}, value)])
    help_text = "Recent per-position draft acceptance rate across requests (controller estimate)."
    rate = repr(speculator.controller.acceptance)
    _series(lines, "gauge", "speculative_acceptance_rate", help_text, [({}, rate)])
