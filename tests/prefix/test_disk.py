"""The prefix cache's disk tier: restores from files give the logits of recomputation, a restart
reuses the directory, another model's or a damaged file is never used, and both budgets hold."""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from hybridlm.models import load_model
from hybridlm.prefix.cache import CapturePlan, PrefixCache
from hybridlm.prefix.disk import DISK_FULL, DiskTier, StoredSnapshot, model_fingerprint
from tests.prefix.test_cache import Oracle, PrefixMachine, full_logits_last, scenario, serve, tokens

# GDN + attention, sliding window, short conv, KDA + MLA, Mamba-2 + attention, and GDN / short conv
# with routed experts
KINDS = ["qwen3_5_text", "gemma3_text", "lfm2", "kimi_linear", "bamba", "qwen3_5_moe_text", "lfm2_moe"]


def load(checkpoints, name: str, dtype=torch.float32):
    return load_model(checkpoints(name).path, dtype=dtype, device="cpu")


def tier(model, directory, budget: int = 1 << 30) -> DiskTier:
    return DiskTier(directory, budget, model_fingerprint(model))


def assert_recomputed(model, prompt, logits):
    expected = full_logits_last(model, prompt)
    assert (logits - expected).abs().max().item() <= 2e-5 * expected.abs().max().item()


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def check_tiers(pc: PrefixCache) -> None:
    """Each node lives in exactly one tier, and the byte and node counts agree with the trie and
    with the files on disk."""
    stored = [n for n in pc.trie.nodes() if n.on_disk]
    assert {n.file for n in stored} == set(pc.disk.sizes)
    for node in pc.trie.nodes():
        stand_ins = [isinstance(s, StoredSnapshot) for s in node.snaps if s is not None]
        assert all(stand_ins) if node.on_disk else not any(stand_ins)
    for node in stored:
        assert node.nbytes == 0 and (pc.disk.directory / node.file).stat().st_size == node.file_bytes
    assert pc.disk_bytes == sum(n.file_bytes for n in stored)
    assert (pc.ram_nodes, pc.disk_nodes) == (pc.node_count - len(stored), len(stored))


def shape(pc: PrefixCache) -> list[tuple[int, int, tuple[int, ...]]]:
    return sorted((n.start, n.end, tuple(n.tokens)) for n in pc.trie.nodes())


@pytest.mark.parametrize("name", KINDS)
def test_restores_from_disk_equal_recompute(checkpoints, name, tmp_path):
    """Every node goes to disk after each request, so every restore beyond the live path reads
    files (recurrent layers replaying logs read from them); reuse is still the oracle's best."""
    model = load(checkpoints, name)
    pc = PrefixCache(model, plan=CapturePlan(cadence=16, tail=(1, 4)), disk=tier(model, tmp_path))
    oracle = Oracle()
    for prompt in scenario(random.Random(7)):
        best = oracle.best(prompt)
        session, first = serve(pc, model, prompt, generate=5, oracle=oracle)
        assert session.cached == best, f"reused {session.cached}, oracle {best}"
        assert_recomputed(model, prompt, first)
        pc.persist()
        assert pc.ram_nodes == 0 and pc.ram_bytes == 0
        check_tiers(pc)
    assert pc.stats.disk_reads > 0


@pytest.mark.parametrize("name", KINDS)
def test_mid_edge_restore_from_a_file(checkpoints, name, tmp_path):
    """One file holds one long edge; a fresh cache (nothing live) restores to a point inside it:
    rows for attention, replay of the logged scan inputs for recurrent and conv layers."""
    model = load(checkpoints, name)
    plan = CapturePlan(cadence=1000, tail=())
    rng = random.Random(5)
    base = tokens(rng, 70)
    first_run = PrefixCache(model, plan=plan, disk=tier(model, tmp_path))
    serve(first_run, model, base, generate=1)
    assert first_run.persist() == 1
    pc = PrefixCache(model, plan=plan, disk=tier(model, tmp_path))
    assert (pc.disk_nodes, pc.ram_nodes) == (1, 0)
    edited = base[:37] + tokens(rng, 10)
    session, first = serve(pc, model, edited, generate=1)
    assert session.cached == 37 and pc.stats.disk_reads == 1
    assert session.replayed == (0 if name == "gemma3_text" else 37)
    assert_recomputed(model, edited, first)


@pytest.mark.parametrize("name", KINDS)
def test_restart_reuses_the_directory(checkpoints, name, tmp_path):
    model = load(checkpoints, name)
    plan = CapturePlan(cadence=16, tail=(1, 4))
    prompts = list(scenario(random.Random(11)))
    oracle = Oracle()
    before = PrefixCache(model, plan=plan, disk=tier(model, tmp_path))
    for prompt in prompts[:5]:
        serve(before, model, prompt, generate=5, oracle=oracle)
    before.persist()
    after = PrefixCache(model, plan=plan, disk=tier(model, tmp_path))
    assert shape(after) == shape(before) and after.ram_nodes == 0
    check_tiers(after)
    for prompt in [*prompts[5:], prompts[1]]:
        best = oracle.best(prompt)
        session, first = serve(after, model, prompt, generate=5, oracle=oracle)
        assert session.cached == best > 0
        assert_recomputed(model, prompt, first)


def test_another_model_never_reuses_the_directory(checkpoints, tmp_path, caplog):
    qwen = load(checkpoints, "qwen3_5_text")
    prompt = tokens(random.Random(3), 40)
    pc = PrefixCache(qwen, disk=tier(qwen, tmp_path))
    serve(pc, qwen, prompt, generate=3)
    pc.persist()
    files = set(tmp_path.iterdir())
    # Another family, and the same checkpoint at another dtype: both are other models.
    for other in (load(checkpoints, "gemma3_text"), load(checkpoints, "qwen3_5_text", torch.bfloat16)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            fresh = PrefixCache(other, disk=tier(other, tmp_path))
        (message,) = warnings_of(caplog)
        assert f"ignored {len(files)} file(s)" in message and "another model" in message
        assert fresh.node_count == 0 and fresh.disk_bytes == 0
        session, first = serve(fresh, other, prompt + [5], generate=1)
        assert session.cached == 0
        if other.dtype == torch.float32:
            assert_recomputed(other, prompt + [5], first)
    assert set(tmp_path.iterdir()) == files  # not ours to delete


def test_damaged_files_are_ignored(checkpoints, tmp_path, caplog):
    model = load(checkpoints, "qwen3_5_text")
    plan = CapturePlan(cadence=1000, tail=())
    rng = random.Random(13)
    prompts = [tokens(rng, 40) for _ in range(4)]
    pc = PrefixCache(model, plan=plan, disk=tier(model, tmp_path))
    for prompt in prompts:
        serve(pc, model, prompt, generate=1)
    pc.persist()
    nodes = [pc.trie.match(p)[0] for p in prompts]
    assert all(len(path) == 1 and path[0].end == 40 for path in nodes)  # one file per prompt
    truncated, garbled_header, garbled_data, intact = (tmp_path / path[0].file for path in nodes)
    truncated.write_bytes(truncated.read_bytes()[:-100])
    raw = bytearray(garbled_header.read_bytes())
    raw[8:72] = bytes(rng.randrange(256) for _ in range(64))
    garbled_header.write_bytes(bytes(raw))
    raw = bytearray(garbled_data.read_bytes())
    raw[-64:] = bytes(b ^ 0x5A for b in raw[-64:])
    garbled_data.write_bytes(bytes(raw))
    junk = tmp_path / "notes.safetensors"
    junk.write_bytes(b"\x07" * 5)

    with caplog.at_level(logging.WARNING):
        pc = PrefixCache(model, plan=plan, disk=tier(model, tmp_path))
    (message,) = warnings_of(caplog)
    assert "ignored 3 file(s)" in message
    # Cut short but provably ours: deleted. Unreadable headers: not provably ours, kept.
    assert not truncated.exists() and garbled_header.exists() and junk.exists()
    assert pc.disk_nodes == 2  # the garbled data is only found when the file is read

    caplog.clear()
    for prompt, expect in zip(prompts, [0, 0, 0, 40], strict=True):
        session, first = serve(pc, model, [*prompt, 7], generate=1)
        assert session.cached == expect
        assert_recomputed(model, [*prompt, 7], first)
    (message,) = warnings_of(caplog)
    assert garbled_data.name in message and "digest" in message
    assert not garbled_data.exists() and not intact.exists()  # dropped; promoted to RAM
    assert pc.stats.disk_errors == 4 and pc.stats.disk_reads == 1
    check_tiers(pc)


def test_budgets_hold_after_every_begin_and_close(checkpoints, tmp_path):
    model = load(checkpoints, "qwen3_5_text")
    ram, disk = 150_000, 600_000
    plan = CapturePlan(cadence=16, tail=(1,))
    pc = PrefixCache(model, ram_budget=ram, plan=plan, disk=tier(model, tmp_path, disk))

    def within_budgets():
        assert pc.ram_bytes <= ram and pc.disk_bytes <= disk
        check_tiers(pc)

    begin = pc.begin

    def checked_begin(prompt):
        session = begin(prompt)
        within_budgets()
        return session

    pc.begin = checked_begin
    oracle = Oracle()
    reused = best = 0
    for prompt in list(scenario(random.Random(9))) * 2:
        best += oracle.best(prompt)
        session, first = serve(pc, model, prompt, generate=4, oracle=oracle)
        reused += session.cached
        within_budgets()
        assert_recomputed(model, prompt, first)
    stats = pc.stats
    assert stats.disk_writes and stats.disk_reads and stats.disk_evicted_nodes
    # The RAM budget alone holds about six nodes; demoted nodes keep most of the reuse. (The budget
    # holds during requests too, so a prefill's restore points compete for those six places as they
    # are taken: 84% of the oracle's best here, where letting them overshoot until the close kept 94%.)
    assert reused >= 0.8 * best


def test_a_vanished_directory_degrades_to_ram(checkpoints, tmp_path, caplog):
    """Reads and writes fail (logged): nodes on disk are dropped, demotions become deletions."""
    model = load(checkpoints, "qwen3_5_text")
    directory, ram = tmp_path / "cache", 150_000
    pc = PrefixCache(
        model, ram_budget=ram, plan=CapturePlan(cadence=16, tail=(1,)), disk=tier(model, directory)
    )
    prompts = list(scenario(random.Random(9)))
    for prompt in prompts[:4]:
        serve(pc, model, prompt, generate=4)
    assert pc.disk_nodes
    shutil.rmtree(directory)
    with caplog.at_level(logging.WARNING):
        for prompt in prompts[4:]:
            _, first = serve(pc, model, prompt, generate=4)
            assert pc.ram_bytes <= ram
            assert_recomputed(model, prompt, first)
    assert sum("failed" in m for m in warnings_of(caplog)) == 1


def fail_writes(monkeypatch, directory: Path, code: int) -> None:
    """Writes (and, unless the disk is merely full, deletions) under `directory` fail with OSError
    `code`, as on a full or read-only file system. (Patched at the calls the tier makes: the tests
    run as root, which file permissions do not stop.)"""
    real_open, real_unlink = Path.open, Path.unlink

    def check(path: Path) -> None:
        if path.resolve().is_relative_to(directory.resolve()):
            raise OSError(code, os.strerror(code), str(path))

    def open_(self, mode="r", *args, **kwargs):
        if set(mode) & set("wax+"):
            check(self)
        return real_open(self, mode, *args, **kwargs)

    def unlink(self, missing_ok=False):
        if code not in DISK_FULL:
            check(self)
        return real_unlink(self, missing_ok)

    monkeypatch.setattr(Path, "open", open_)
    monkeypatch.setattr(Path, "unlink", unlink)


def test_a_read_only_directory_stops_writes_with_one_warning(checkpoints, tmp_path, caplog, monkeypatch):
    """Once writes fail for good, the cache goes on in RAM (its budget holding, restores exact) and
    says so once; the files already there are still read (and left behind, as they cannot be deleted)."""
    model = load(checkpoints, "qwen3_5_text")
    directory, ram = tmp_path / "cache", 150_000
    pc = PrefixCache(
        model, ram_budget=ram, plan=CapturePlan(cadence=16, tail=(1,)), disk=tier(model, directory)
    )
    prompts = list(scenario(random.Random(9)))
    for prompt in prompts[:4]:
        serve(pc, model, prompt, generate=4)
    assert pc.disk_nodes
    fail_writes(monkeypatch, directory, errno.EROFS)
    with caplog.at_level(logging.WARNING):
        for prompt in prompts[4:]:
            _, first = serve(pc, model, prompt, generate=4)
            assert pc.ram_bytes <= ram
            assert_recomputed(model, prompt, first)
        assert pc.persist() == 0
    messages = warnings_of(caplog)
    assert sum("failed" in m for m in messages) == 1, messages
    assert sum("could not delete" in m for m in messages) <= 1, messages
    assert pc.disk.failed is not None and pc.stats.disk_reads > 0


def test_a_full_disk_warns_once_a_minute(checkpoints, tmp_path, caplog, monkeypatch):
    model = load(checkpoints, "qwen3_5_text")
    directory, ram = tmp_path / "cache", 150_000
    pc = PrefixCache(
        model, ram_budget=ram, plan=CapturePlan(cadence=16, tail=(1,)), disk=tier(model, directory)
    )
    fail_writes(monkeypatch, directory, errno.ENOSPC)
    with caplog.at_level(logging.WARNING):
        for prompt in scenario(random.Random(9)):
            serve(pc, model, prompt, generate=4)
            assert pc.ram_bytes <= ram
    messages = warnings_of(caplog)
    assert pc.stats.evicted_nodes > 1 and pc.disk_nodes == 0
    assert [m for m in messages if "full" in m] == messages and len(messages) == 1, messages
    assert pc.disk.failed is None  # a full disk may get room again: writes go on being tried


def test_a_leftover_temp_file_in_a_read_only_directory(checkpoints, tmp_path, caplog, monkeypatch):
    model = load(checkpoints, "qwen3_5_text")
    directory = tmp_path / "cache"
    directory.mkdir()
    leftover = directory / f".{model_fingerprint(model)}.node-x.safetensors.tmp"
    leftover.write_bytes(b"torn")
    fail_writes(monkeypatch, directory, errno.EROFS)
    with caplog.at_level(logging.WARNING):
        pc = PrefixCache(model, ram_budget=1 << 20, disk=tier(model, directory))
    (message,) = warnings_of(caplog)
    assert "leftover temporary file" in message and leftover.exists()
    serve(pc, model, tokens(random.Random(1), 40), generate=2)


class DiskMachine(PrefixMachine):
    """test_cache's random request / cancel / squeeze sequences with a disk tier under small
    budgets, plus restarts over the same directory."""

    fingerprint = ""

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="hybridlm-disk-")
        self.pc = self._open(ram_budget=40_000, disk_budget=150_000)

    def _open(self, ram_budget, disk_budget):
        disk = DiskTier(self.dir, disk_budget, self.fingerprint)
        return PrefixCache(
            self.model, ram_budget=ram_budget, plan=CapturePlan(cadence=8, tail=(1, 3)), disk=disk
        )

    @rule()
    def restart(self):
        self.pc.persist()
        self.pc = self._open(self.pc.ram_budget, self.pc.disk.budget)

    @rule(fraction=st.floats(0.1, 0.9))
    def squeeze_disk(self, fraction):
        self.pc.disk.budget = int(self.pc.disk_bytes * fraction)
        self.pc.enforce_budget()

    @invariant()
    def tiers(self):
        check_tiers(self.pc)
        assert self.pc.disk_bytes <= self.pc.disk.budget
        assert {p.name for p in Path(self.dir).iterdir()} == set(self.pc.disk.sizes)

    def teardown(self):
        shutil.rmtree(self.dir, ignore_errors=True)


def test_prefix_cache_with_disk_state_machine(tiny_model):
    DiskMachine.model = tiny_model
    DiskMachine.fingerprint = model_fingerprint(tiny_model)
    run = DiskMachine.TestCase
    run.settings = settings(
        max_examples=15, stateful_step_count=12, deadline=None, suppress_health_check=list(HealthCheck)
    )
    run().runTest()
