"""The sweep's progress lines: counter, current run, elapsed, ETA, and a heartbeat that breaks any silence."""

from __future__ import annotations

import time

import pytest

from flowgeom.reproduce.progress import Ticker, duration


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_duration_formats():
    assert [duration(s) for s in (0, 42.4, 75.2, 3725)] == ["0s", "42s", "1m15s", "1h02m"]


def test_counter_eta_and_heartbeat_with_a_fake_clock():
    clock, lines = Clock(), []
    t = Ticker(4, lines.append, every=10, clock=clock)
    t.start("a", "claim.a run-a")
    clock.t += 5
    assert t.heartbeat() is None  # 5 s of silence: nothing yet
    clock.t += 6
    beat = t.heartbeat()  # 11 s of silence: one line naming the run and how long it has run
    assert beat == "...  [0/4] running claim.a run-a for 11s · elapsed 11s · ETA ?"
    clock.t += 9
    t.done("a", "claim.a run-a", "finished", 20.0)
    assert lines[-1] == "done [1/4] claim.a run-a 20.0s · elapsed 20s · ETA ~1m00s"  # 3 runs left × 20 s
    t.done("b", "claim.b run-b", "skipped", 0.0)  # a run kept from before: no time, not in the mean
    assert lines[-1].startswith("kept [2/4] claim.b run-b 0.0s") and lines[-1].endswith("ETA ~40s")
    t.start("c", "claim.c run-c")
    clock.t += 15  # 15 s into a run of expected 20 s: 2 runs × 20 s − 15 s = 25 s left
    assert t.eta() == pytest.approx(25.0)
    t.done("c", "claim.c run-c", "failed", 15.0, "boom")
    assert lines[-1].startswith("FAILED [3/4] claim.c run-c 15.0s (boom)")


def test_heartbeat_thread_prints_during_a_silent_run():
    lines = []
    with Ticker(1, lines.append, every=0.2) as t:
        t.start("a", "slow run")
        time.sleep(0.7)
    assert sum("running slow run" in line for line in lines) >= 2


def test_every_must_be_positive():
    with pytest.raises(ValueError, match="every must be > 0"):
        Ticker(1, print, every=0)


def test_eta_expects_a_run_to_cost_what_its_own_claim_cost():
    clock = Clock()
    groups = {"a1": "fast", "a2": "fast", "b1": "slow", "b2": "slow"}
    t = Ticker(4, lambda line: None, every=10, groups=groups, clock=clock)
    t.done("a1", "fast 1", "finished", 1.0)
    t.done("b1", "slow 1", "finished", 99.0)
    assert t.eta() == pytest.approx(1.0 + 99.0)  # not 2 × the overall mean of 50
    t.start("b2", "slow 2")
    clock.t += 40
    assert t.eta() == pytest.approx(1.0 + 59.0)


def test_eta_unknown_while_a_run_is_past_its_estimate():
    clock = Clock()
    t = Ticker(3, lambda line: None, every=10, groups={"a": "c", "b": "c", "c": "c"}, clock=clock)
    t.done("a", "run a", "finished", 10.0)
    t.start("b", "run b")
    clock.t += 5
    assert t.eta() == pytest.approx(5.0 + 10.0)
    clock.t += 20  # 25 s into a run whose claim's runs took 10 s
    assert t.eta() is None and t._times().endswith("ETA ?")
