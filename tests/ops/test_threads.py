"""ops.threads: decode steps run on the cores other processes leave idle."""

import pytest
import torch

from hybridlm.ops import threads
from hybridlm.ops.threads import CoreShare, decode_team, decode_threads


class FakeProc:
    """/proc/stat and this process's CPU time, advanced by hand: `others` busy cores over `dt` seconds."""

    def __init__(self, monkeypatch, cpus=2, hz=100):
        self.cpus, self.hz, self.busy, self.total, self.own = cpus, hz, 0, 0, 0
        monkeypatch.setattr(threads, "allowed_cpus", lambda: set(range(cpus)))
        monkeypatch.setattr(threads, "_busy_and_total", lambda cpus: (self.busy, self.total))
        monkeypatch.setattr(threads, "_own_jiffies", lambda: self.own)

    def advance(self, others: float, own: float, dt: float = 1.0):
        self.total += round(self.cpus * dt * self.hz)
        self.busy += round((others + own) * dt * self.hz)
        self.own += round(own * dt * self.hz)


def test_a_core_busy_with_another_process_is_left_to_it(monkeypatch):
    proc = FakeProc(monkeypatch)
    share = CoreShare(interval=0.0)
    assert share.others() == 0.0  # one sample: nothing known yet
    proc.advance(others=1.0, own=1.0)
    assert share.others() == pytest.approx(1.0)
    assert decode_threads(2, share) == 1
    proc.advance(others=0.1, own=2.0)  # a mostly idle neighbour; our own use never counts
    assert decode_threads(2, share) == 2
    proc.advance(others=2.0, own=0.0)
    assert decode_threads(2, share) == 1  # never fewer than one thread


def test_steal_time_is_not_another_process(tmp_path):
    """A hypervisor's steal time (8th field) is not a process of this machine: neither busy nor total."""
    stat = tmp_path / "stat"
    #                      user nice sys idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  180 0 10 0 0 0 0 30 0 0\n"
                    "cpu0  90 0  5 0 0 0 0 15 0 0\n"
                    "cpu1  80 0  5 10 0 0 0 15 0 0\n"
                    "cpu2  10 0  0 90 0 0 0  0 0 0\n")
    assert threads._busy_and_total({0, 1}, str(stat)) == (180, 190)
    assert threads._busy_and_total({2}, str(stat)) == (10, 100)


def test_samples_are_reused_within_the_interval(monkeypatch):
    proc = FakeProc(monkeypatch)
    share = CoreShare(interval=3600.0)
    share.others()
    proc.advance(others=1.0, own=0.0)
    assert share.others() == 0.0


def test_turned_off_by_env_and_single_threaded_teams_stay(monkeypatch):
    proc = FakeProc(monkeypatch)
    share = CoreShare(interval=0.0)
    share.others()
    proc.advance(others=1.0, own=0.0)
    assert decode_threads(1, share) == 1
    monkeypatch.setenv("HYBRIDLM_ADAPT_THREADS", "0")
    assert decode_threads(2, share) == 2


def test_the_team_is_restored_after_the_step(monkeypatch):
    proc = FakeProc(monkeypatch)
    share = CoreShare(interval=0.0)
    share.others()
    proc.advance(others=1.0, own=0.0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with decode_team(share) as team:
            assert team == 1 and torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
