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


def test_eta_is_a_lower_bound_while_a_run_is_past_its_estimate():
    clock = Clock()
    t = Ticker(3, lambda line: None, every=10, groups={"a": "c", "b": "c", "c": "c"}, clock=clock)
    t.done("a", "run a", "finished", 10.0)
    t.start("b", "run b")
    clock.t += 5
    assert t.estimate() == (pytest.approx(5.0 + 10.0), False)
    clock.t += 20  # 25 s into a run whose claim's runs took 10 s: its remainder is unknown (>= 0), run c's is 10 s
    assert t.estimate() == (pytest.approx(10.0), True) and t._times().endswith("ETA >10s")


# --- sizes: the ETA from steps x parameters ------------------------------------------------------------------------

def test_the_first_run_of_a_claim_is_predicted_from_its_size():
    clock = Clock()
    sizes = {"a1": 10.0, "a2": 10.0, "b1": 1000.0}
    t = Ticker(3, lambda line: None, groups={"a1": "a", "a2": "a", "b1": "b"}, sizes=sizes, clock=clock)
    t.done("a1", "a 1", "finished", 2.0)  # rate 0.2 s per unit of size
    assert t.eta() == pytest.approx(0.2 * 10 + 0.2 * 1000)  # not 2 runs x the mean of 2 s
    t.done("a2", "a 2", "finished", 3.0)  # claim a: 5 s for 20 units, rate 0.25
    t.start("b1", "b 1")
    clock.t += 50
    assert t.eta() == pytest.approx(0.25 * 1000 - 50)


def test_a_claim_is_corrected_by_its_own_finished_runs():
    t = Ticker(4, lambda line: None, groups={"a1": "a", "b1": "b", "b2": "b", "a2": "a"},
               sizes={"a1": 100.0, "b1": 100.0, "b2": 300.0, "a2": 100.0}, clock=Clock())
    t.done("a1", "a 1", "finished", 10.0)
    t.done("b1", "b 1", "finished", 30.0)  # rate 40/200 = 0.2; b took 1.5x its prediction, a 0.5x
    assert t.eta() == pytest.approx(0.2 * 300 * 1.5 + 0.2 * 100 * 0.5)


def test_before_any_run_finishes_a_running_run_bounds_its_own_claim_from_below():
    clock, lines = Clock(), []
    t = Ticker(3, lines.append, every=10, groups={"a": "x", "b": "x", "c": "y"},
               sizes={"a": 100.0, "b": 300.0, "c": 300.0}, clock=clock)
    t.start("a", "run a")
    clock.t += 10  # 10 s into a run of size 100: its claim costs at least 0.1 s per unit; claim y is not bounded
    assert t.heartbeat() == "...  [0/3] running run a for 10s · elapsed 10s · ETA >30s"
    t.done("a", "run a", "finished", 10.0)
    t.start("b", "run b")
    t.start("c", "run c")
    assert t.estimate() == (pytest.approx(60.0), False)  # rate 0.1: b and c expected 30 s each, one worker


def test_a_lone_first_run_gives_no_bound_for_other_claims():
    clock = Clock()
    t = Ticker(2, lambda line: None, groups={"a": "x", "b": "y"}, sizes={"a": 1.0, "b": 1e6}, clock=clock)
    t.start("a", "run a")
    clock.t += 10
    assert t.eta() is None


def test_eta_over_a_tour_never_unknown_after_the_first_heartbeat_and_within_30_percent_at_halfway():
    """A fake tour (sizes spanning four orders of magnitude, claims off the size model by 0.5x-2x, one run of a
    claim 3x slower than its mates), run on a fake clock by the sweep's own hooks with a heartbeat every 10 s."""
    clock, lines = Clock(), []
    rate = 0.01
    claims = {"laws": (0.5, [20.0] * 8), "drift": (2.0, [200.0, 250.0]), "mlp": (1.0, [3000.0, 3000.0, 9000.0, 3000.0]),
              "lm": (1.5, [8000.0]), "villani": (0.7, [100.0] * 4), "darcy": (0.8, [5000.0])}
    runs = [(f"{c}/{i}", c, size, rate * size * factor * (3.0 if (c, i) == ("mlp", 2) else 1.0))
            for c, (factor, sizes) in claims.items() for i, size in enumerate(sizes)]
    sizes = {key: size for key, _, size, _ in runs}
    t = Ticker(len(runs), lines.append, every=10, groups={key: c for key, c, _, _ in runs}, sizes=sizes, clock=clock)
    total = sum(seconds for *_, seconds in runs)
    errors = {}
    for i, (key, claim, _, seconds) in enumerate(runs):
        t.start(key, key)
        end = clock.t + seconds
        while clock.t + 1 < end:  # the heartbeat thread's polls, one a second
            clock.t += 1
            t.heartbeat()
        clock.t = end
        t.done(key, key, "finished", seconds)
        left = total - sum(s for *_, s in runs[:i + 1])
        errors[i + 1] = abs(t.eta() - left) / left if left else 0.0
    etas = [line.rsplit("ETA ", 1)[1] for line in lines]
    assert "?" not in etas[1:] and len(lines) > 3 * len(runs)
    halfway = len(runs) // 2
    assert errors[halfway] <= 0.30, errors


def test_parallel_workers_cannot_split_one_run():
    t = Ticker(3, lambda line: None, jobs=2, groups={"a": "a", "b": "b", "c": "c"},
               sizes={"a": 1.0, "b": 100.0, "c": 10.0}, clock=Clock())
    t.done("a", "a", "finished", 1.0)  # rate 1 s per unit: b 100 s, c 10 s
    assert t.eta() == pytest.approx(100.0)  # not (100 + 10) / 2
