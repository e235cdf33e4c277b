"""`GET /metrics`: Prometheus exposition of HTTP and engine counters, through `prometheus-client`.

HTTP responses are a library `Counter` (incremented by the response-counting middleware). Engine,
prefix-cache and speculative figures live in the engine's own stats; a collector reads them at
scrape time, so a scrape always shows the totals of that instant.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from hybridlm.engine import Engine
from hybridlm.engine.stats import Histogram

CONTENT_TYPE = CONTENT_TYPE_LATEST
PREFIX = "hybridlm_"

_HISTOGRAM_HELP = {
    "queue_seconds": "Seconds requests waited in the queue.",
    "time_to_first_token_seconds": "Seconds from arrival to the first generated token.",
    "prefill_seconds": "Seconds spent prefilling prompts.",
    "time_per_output_token_seconds": "Mean seconds per generated token after the first, per request.",
    "e2e_request_latency_seconds": "Seconds from arrival to finish.",
    "step_seconds": "Seconds per engine step (one unit of work for every running sequence).",
    "batch_rows": "Tokens run per engine step (decode and verify rows plus prefill chunks).",
}


class Metrics:
    """One app's registry: `responses` counts HTTP responses by endpoint and status; `render()` is
    the exposition text of everything."""

    def __init__(self, engine: Engine, model_name: str):
        self.registry = CollectorRegistry(auto_describe=False)
        self.responses = Counter(
            PREFIX + "http_requests",
            "HTTP responses by endpoint and status code.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.registry.register(EngineCollector(engine, model_name))

    def count(self, endpoint: str, status: int) -> None:
        self.responses.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _histogram(name: str, h: Histogram) -> HistogramMetricFamily:
    bounds = [*(repr(float(b)) for b in h.buckets), "+Inf"]
    buckets = list(zip(bounds, h.cumulative(), strict=True))
    return HistogramMetricFamily(PREFIX + name, _HISTOGRAM_HELP[name], buckets=buckets, sum_value=h.sum)


def _counter(name: str, help_text: str, samples, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
    family = CounterMetricFamily(PREFIX + name, help_text, labels=list(labels))
    for values, value in samples:
        family.add_metric(list(values), value)
    return family


def _gauge(name: str, help_text: str, samples, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    family = GaugeMetricFamily(PREFIX + name, help_text, labels=list(labels))
    for values, value in samples:
        family.add_metric(list(values), value)
    return family


class EngineCollector(Collector):
    """Engine, prefix-cache and speculative figures, read when scraped."""

    def __init__(self, engine: Engine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        engine = self.engine
        stats = engine.stats
        with stats.lock:
            finished = dict(stats.finished)
            tokens = {
                "prompt_tokens": ("Prompt tokens of finished requests.", stats.prompt_tokens),
                "prefilled_tokens": ("Prompt tokens run through the model.", stats.prefilled_tokens),
                "cached_tokens": ("Prompt tokens restored from the prefix cache.", stats.cached_tokens),
                "generation_tokens": (
                    "Tokens generated (cancelled requests included).",
                    stats.generation_tokens,
                ),
            }
            histograms = {name: h.copy() for name, h in stats.histograms().items()}
        reasons = sorted(set(finished) | {"stop", "length", "cancelled", "error"})
        yield _counter(
            "requests_finished",
            "Engine requests by finish reason.",
            [((r,), finished.get(r, 0)) for r in reasons],
            ("reason",),
        )
        for name, (help_text, value) in tokens.items():
            yield _counter(name, help_text, [((), value)])
        gauges = {
            "queue_depth": ("Requests waiting to be scheduled.", engine.queue_depth),
            "requests_running": ("Requests being prefilled or decoded.", engine.num_running),
            "running_limit": (
                "Most sequences advanced together (--max-running).", engine.scheduler.max_running
            ),
            "slot_occupancy": (
                "Fraction of the memory for running sequences' caches their admission reserved.",
                engine.memory_occupancy,
            ),
            "queue_limit": ("Most requests allowed to wait.", engine.max_queue),
            "context_length": ("Most tokens per request.", engine.context_length),
        }
        for name, (help_text, value) in gauges.items():
            yield _gauge(name, help_text, [((), value)])
        for name, h in histograms.items():
            yield _histogram(name, h)
        if engine.prefix is not None:
            yield from _prefix_cache(engine.prefix)
        if engine.speculative is not None:
            yield from _speculative(engine.speculative)
        yield _gauge("model_info", "The served model.", [((self.model_name,), 1)], ("model",))


def _prefix_cache(prefix):
    """Prefix-cache gauges and counters. Bytes and nodes are read under the cache's lock (the trie is
    consistent: the RAM figure is the budgeted total at that instant); counters without it."""
    stats = prefix.stats
    tiers = ("tier",)
    with prefix.lock:
        ram, disk, pinned = prefix.ram_bytes, prefix.disk_bytes, prefix.pinned_bytes
        nodes = [(("ram",), prefix.ram_nodes), (("disk",), prefix.disk_nodes)]
    yield _gauge(
        "prefix_cache_bytes",
        "Prefix-cache bytes by tier: ram (what --cache-ram covers), disk, pinned (the running requests' "
        "live caches, working restore points and hidden logs, outside the budget).",
        [(("ram",), ram), (("disk",), disk), (("pinned",), pinned)],
        tiers,
    )
    yield _gauge("prefix_cache_nodes", "Nodes in the prefix trie, by tier.", nodes, tiers)
    yield _counter("prefix_cache_hits", "Requests that reused a cached prefix.", [((), stats.hits)])
    yield _counter(
        "prefix_cache_misses",
        "Requests that reused nothing: no shared prefix, or a shared prefix that could not be restored.",
        [(("no_shared_prefix",), stats.misses_no_prefix), (("not_restorable",), stats.misses_unrestorable)],
        ("reason",),
    )
    counters = {
        "prefix_cache_evicted_nodes": ("Trie nodes deleted to keep the budget.", stats.evicted_nodes),
        "prefix_cache_disk_writes": ("Nodes demoted to the disk tier.", stats.disk_writes),
        "prefix_cache_disk_reads": ("Nodes loaded back from the disk tier.", stats.disk_reads),
        "prefix_cache_disk_errors": ("Disk-tier files found unusable.", stats.disk_errors),
        "prefix_cache_compacted_snapshots": (
            "Snapshots whose scan-input logs were dropped to keep the budget.",
            stats.compacted_snapshots,
        ),
    }
    for name, (help_text, value) in counters.items():
        yield _counter(name, help_text, [((), value)])
    if prefix.store is not None:
        yield from _store(prefix.store.stats)


def _store(stats):
    """The shared store tier's counters (`StoreStats`)."""
    counters = {
        "prefix_store_lookups": ("Lookups of a prompt in the shared store.", stats.lookups),
        "prefix_store_fetched_nodes": ("Nodes read from the store and used.", stats.fetched_nodes),
        "prefix_store_fetched_bytes": ("Bytes of entries read and used.", stats.fetched_bytes),
        "prefix_store_writes": ("Nodes written to the shared store.", stats.writes),
        "prefix_store_written_bytes": ("Bytes of entries written.", stats.written_bytes),
        "prefix_store_dropped_writes": (
            "Node writes dropped (queue full, store unreachable or full).",
            stats.dropped_writes,
        ),
        "prefix_store_rejected_entries": (
            "Entries found corrupted, truncated, another model's or evicted (deleted).",
            stats.rejected_entries,
        ),
        "prefix_store_errors": ("Failed calls to the store server.", stats.errors),
    }
    for name, (help_text, value) in counters.items():
        yield _counter(name, help_text, [((), value)])


def _speculative(speculator):
    """Speculative decoding counters and the controller's acceptance estimate (read unlocked, like
    the prefix cache's)."""
    totals = speculator.totals
    counters = {
        "speculative_drafted_tokens": ("Draft tokens verified by the target.", totals.drafted_tokens),
        "speculative_accepted_tokens": ("Draft tokens accepted.", totals.accepted_tokens),
        "speculative_verify_passes": ("Target forwards that verified a draft.", totals.verify_passes),
    }
    for name, (help_text, value) in counters.items():
        yield _counter(name, help_text, [((), value)])
    yield _gauge(
        "speculative_acceptance_rate",
        "Recent per-position draft acceptance rate across requests (controller estimate).",
        [((), speculator.controller.acceptance)],
    )
