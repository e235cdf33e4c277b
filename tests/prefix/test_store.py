"""The shared store tier against a real redis-server: replicas restore each other's prefixes with
the reuse of an oracle that knows everything any replica stored and the logits of recomputation;
an unreachable, stopped, full or poisoned store costs reuse, never a wrong answer."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from hybridlm.cluster import free_port
from hybridlm.prefix.cache import CapturePlan, PrefixCache
from hybridlm.prefix.disk import model_fingerprint
from hybridlm.prefix.store import StoreTier
from tests.prefix.test_cache import Oracle, scenario, serve, tokens
from tests.prefix.test_disk import KINDS, assert_recomputed, load, warnings_of

PLAN = CapturePlan(cadence=16, tail=(1, 4))


def replica(model, url: str, name: str = "") -> PrefixCache:
    store = StoreTier(url, model_fingerprint(model), replica=name, retry_s=0.0)
    return PrefixCache(model, plan=PLAN, store=store)


def run(pc: PrefixCache, model, prompt, oracle=None, generate=5):
    """Serve one request and wait until the replica's writes reached the store."""
    session, first = serve(pc, model, prompt, generate=generate, oracle=oracle)
    assert pc.store.flush()
    return session, first


@pytest.mark.parametrize("name", KINDS)
def test_replicas_reuse_each_others_prefixes_exactly(checkpoints, name, redis_server):
    """Requests alternate between two replicas at random: every restore reuses what the oracle says
    either replica stored (the other's state comes from the store), with the logits of
    recomputation (recurrent layers restored mid-edge by replaying logs read from the store)."""
    model = load(checkpoints, name)
    replicas = [replica(model, redis_server.url, "a"), replica(model, redis_server.url, "b")]
    oracle = Oracle()
    rng = random.Random(3)
    for k, prompt in enumerate(scenario(random.Random(7))):
        pc = replicas[k % 2 if k < 2 else rng.randrange(2)]
        best = oracle.best(prompt)
        session, first = run(pc, model, prompt, oracle)
        assert session.cached == best, f"request {k}: reused {session.cached}, oracle {best}"
        assert_recomputed(model, prompt, first)
    assert all(pc.store.stats.fetched_nodes > 0 for pc in replicas)
    assert all(pc.store.stats.rejected_entries == pc.store.stats.errors == 0 for pc in replicas)


def test_a_fresh_replica_restores_a_conversation_mid_edge(checkpoints, redis_server):
    """Replica B, which never saw the conversation, restores to a point inside a stored edge."""
    model = load(checkpoints, "qwen3_5_text")
    a, b = replica(model, redis_server.url), replica(model, redis_server.url)
    rng = random.Random(1)
    first = tokens(rng, 45)
    session, _ = run(a, model, first)
    fed = list(session.fed)
    prompt = fed[:37] + tokens(rng, 9)  # 37 is inside an edge (captures at 16, 32, 41, 44, 45...)
    session, logits = run(b, model, prompt)
    assert session.cached == 37 and session.replayed > 0
    assert_recomputed(model, prompt, logits)


def test_a_store_down_at_start_costs_reuse_only(checkpoints, caplog):
    model = load(checkpoints, "qwen3_5_text")
    pc = replica(model, f"redis://127.0.0.1:{free_port()}/0")
    pc.store.retry_s = 60.0
    oracle = Oracle()
    with caplog.at_level(logging.WARNING):
        for prompt in scenario(random.Random(7)):
            best = oracle.best(prompt)  # local reuse still works
            session, first = run(pc, model, prompt, oracle)
            assert session.cached == best
            assert_recomputed(model, prompt, first)
    assert pc.store.stats.errors >= 1 and pc.store.stats.dropped_writes > 0
    # Rate-limited: one warning that the store is down, however many calls failed (a loaded machine
    # may add one of another kind: the write queue filling while the writer waits on the dead store).
    assert len([w for w in warnings_of(caplog) if "reuse from the store is off" in w]) == 1


def test_a_store_stopped_mid_run_costs_reuse_only(checkpoints, redis_server, caplog):
    model = load(checkpoints, "lfm2")
    a, b = replica(model, redis_server.url), replica(model, redis_server.url)
    rng = random.Random(2)
    conversation = tokens(rng, 40)
    session, _ = run(a, model, conversation)
    redis_server.stop()
    prompt = list(session.fed) + tokens(rng, 10)
    with caplog.at_level(logging.WARNING):
        session, logits = run(b, model, prompt)
        assert session.cached == 0
        assert_recomputed(model, prompt, logits)
        session, logits = run(b, model, prompt + tokens(rng, 5))  # its own reuse is intact
        assert session.cached == len(prompt)
    assert b.store.stats.errors >= 1
    assert any("prefix store" in w for w in warnings_of(caplog))
    redis_server.start()  # back again (an empty server): writes and lookups resume
    session, _ = run(b, model, prompt + tokens(rng, 7))
    assert b.store.stats.writes > 0


def poison(client, how: str, other_fingerprint: str | None = None) -> int:
    """Damage every entry of the store in place; returns how many."""
    keys = client.keys("hybridlm:*:node:*")
    for key in keys:
        raw = client.get(key)
        if how == "corrupt":
            raw = raw[:-64] + bytes(b ^ 0x55 for b in raw[-64:])
        elif how == "truncate":
            raw = raw[: len(raw) // 2]
        client.set(key, raw)
    return len(keys)


@pytest.mark.parametrize("how", ["corrupt", "truncate", "foreign"])
def test_damaged_or_foreign_entries_are_never_used(checkpoints, redis_server, how, caplog):
    """Corrupted, truncated and another model's entries (placed under this model's keys) fail their
    checks: replica B recomputes (exactly), counts them, warns once, and its entries replace them."""
    model = load(checkpoints, "qwen3_5_text")
    a, b = replica(model, redis_server.url), replica(model, redis_server.url)
    rng = random.Random(4)
    conversation = tokens(rng, 40)
    client = redis_server.client()
    if how == "foreign":
        other = load(checkpoints, "qwen3_5_text")
        with torch.no_grad():
            next(other.parameters()).add_(1.0)
        run(replica(other, redis_server.url), other, conversation)
        run(a, model, conversation)
        theirs = client.get(client.keys(f"hybridlm:{model_fingerprint(other)}:node:*")[0])
        ours = client.keys(f"{a.store.ns}:node:*")
        for key in ours:  # another model's entry under each of this model's keys
            client.set(key, theirs)
        damaged = len(ours)
    else:
        run(a, model, conversation)
        damaged = poison(client, how)
    prompt = conversation + tokens(rng, 8)
    with caplog.at_level(logging.WARNING):
        session, logits = run(b, model, prompt)
    assert session.cached == 0
    assert_recomputed(model, prompt, logits)
    assert b.store.stats.rejected_entries >= 1 and damaged >= 1
    assert len([w for w in warnings_of(caplog) if "unusable" in w]) == 1
    # The unusable entries were deleted and B's recomputed ones took their keys: a fresh replica
    # reuses everything B stored.
    fed = list(session.fed)
    session, logits = run(replica(model, redis_server.url), model, fed + [7])
    assert session.cached == len(fed)


def test_a_full_store_refuses_writes_and_answers_stay_exact(checkpoints, tmp_path, caplog):
    from hybridlm.cluster import StoreServer

    server = StoreServer(tmp_path, maxmemory="1mb", maxmemory_policy="noeviction").start()
    try:
        model = load(checkpoints, "qwen3_5_text")
        a, b = replica(model, server.url), replica(model, server.url)
        rng = random.Random(5)
        conversation = tokens(rng, 200)
        with caplog.at_level(logging.WARNING):
            session, _ = run(a, model, conversation)
            prompt = list(session.fed) + tokens(rng, 6)
            session, logits = run(b, model, prompt)
        assert a.store.stats.dropped_writes > 0 and a.store.stats.errors > 0
        assert 0 <= session.cached < len(prompt)  # what fit is reused, the rest recomputed
        assert_recomputed(model, prompt, logits)
        assert any("write refused" in w for w in warnings_of(caplog))
    finally:
        server.stop()


@pytest.mark.parametrize("url", ["foo://x", "redis://localhost:notaport/0", "redis://h:1/zz", "redis:///0"])
def test_cache_store_flag_rejects_a_bad_url(url, capsys):
    from hybridlm.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--cache-store", url])
    assert e.value.code == 2 and "--cache-store" in capsys.readouterr().err
    assert (
        build_parser().parse_args(["serve", "--cache-store", "redis://h:1/3"]).cache_store == "redis://h:1/3"
    )
