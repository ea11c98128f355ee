"""Progress of a sweep that a person can follow: runs done / total, the current run, elapsed time, ETA.

A sweep's runs take from a fraction of a second to minutes, so a line per
finished run is not enough: a long run would leave the terminal silent. The
:class:`Ticker` prints

    done [12/36] conservation.drift 3f2a9c1e 12.3s · elapsed 2m10s · ETA ~3m40s

when a run ends, and while one runs, a heartbeat at least every ``every``
seconds (10 by default):

    ...  [12/36] running continuity.lm-projection 8c01d2aa for 40s · elapsed 2m50s · ETA ~3m10s

Lines, not a redrawn bar, so that the same output reads well in a terminal, a
``make demo | tee log`` and a CI log.

The ETA. Each run comes with its size (``sizes``: optimiser steps × trained
parameters, plus a per-step overhead; :mod:`flowgeom.reproduce.cost`), so
the first run of a claim is predicted before any run of it has finished:

    expected(run) = rate × size(run) × factor(claim of the run)

``rate`` (seconds per unit of size, this machine at its present load) is
calibrated by the runs finished so far: the median over claims of each
claim's Σ seconds / Σ size; ``factor`` is
how far the finished runs of the run's own claim were from that prediction
(Σ seconds / Σ rate × size; 1 before one has finished), since a claim's runs
are alike and claims are not. The ETA is the expected seconds of the runs
not yet ended, minus what the running ones have spent, divided by the
parallel workers (and never less than the longest of those runs alone). Runs kept from an earlier sweep take no time and are not
counted; a run without a size is expected to take the mean of its claim's
finished runs, else of all finished runs.

"ETA ?" is shown only until the first run ends (in the tour, seconds: the
law checks come first), and even then not while a sized run of a claim with
more runs to come is running: a run of size S that has run t seconds costs
at least t / S per unit, which bounds what its claim's other runs will take.
A run already past its expected time has an unknown remainder (≥ 0). In
both cases the ETA is a lower bound, shown as "ETA >3m10s" instead of
"ETA ~3m10s"; a bound is never carried across claims (a slow first law
check says nothing about the LM run).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any


def duration(seconds: float) -> str:
    """``75.2`` -> ``"1m15s"``; ``3725`` -> ``"1h02m"``; under a minute ``"42s"``."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


class Ticker:
    """Progress lines for ``total`` runs, printed through ``emit`` (one string per line).

    Call :meth:`start` / :meth:`done` from the sweep's ``on_start`` / ``on_done``
    hooks and use the ticker as a context manager: inside it a daemon thread
    prints the heartbeat. ``clock`` is injectable for tests.
    """

    def __init__(self, total: int, emit: Callable[[str], None], *, every: float = 10.0, jobs: int = 1,
                 groups: dict[str, str] | None = None, sizes: dict[str, float | None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if every <= 0:
            raise ValueError(f"every must be > 0 seconds, got {every}")
        self.total, self.emit, self.every, self.jobs, self.clock = total, emit, every, max(1, jobs), clock
        # run key -> group (its claim): runs of one claim cost alike, runs of different claims do not
        self.groups = dict(groups or {})
        # run key -> size (steps x parameters + overhead); runs without a finite positive size have none
        self.sizes = {k: float(v) for k, v in (sizes or {}).items()
                      if isinstance(v, (int, float)) and math.isfinite(v) and v > 0}
        self.pending = set(self.groups) | set(self.sizes)  # keys not yet ended
        self.by_group: dict[str, list[float]] = {}
        self.ran: dict[str, float] = {}  # key -> seconds, of the runs that really ran
        self.t0 = clock()
        self.last = self.t0  # time of the last line printed
        self.finished = 0  # runs that ended (finished, kept or failed)
        self.durations: list[float] = []  # seconds of the runs that really ran
        self.running: dict[str, tuple[str, float]] = {}  # key -> (label, start time)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- hooks -------------------------------------------------------------------------------------------
    def start(self, key: str, label: str) -> None:
        with self._lock:
            self.running[key] = (label, self.clock())

    def done(self, key: str, label: str, status: str, seconds: float, note: str = "") -> None:
        with self._lock:
            self.running.pop(key, None)
            self.pending.discard(key)
            self.finished += 1
            if status == "finished":
                self.durations.append(seconds)
                self.ran[key] = seconds
                if key in self.groups:
                    self.by_group.setdefault(self.groups[key], []).append(seconds)
            mark = {"finished": "done", "skipped": "kept", "failed": "FAILED"}.get(status, status)
            tail = f" ({note})" if note else ""
            self._line(f"{mark} [{self.finished}/{self.total}] {label} {seconds:.1f}s{tail} · {self._times()}")

    def heartbeat(self) -> str | None:
        """The heartbeat line when ``every`` seconds have passed since the last line, else None (and print it)."""
        with self._lock:
            now = self.clock()
            if now - self.last < self.every:
                return None
            if self.running:
                label, since = min(self.running.values(), key=lambda v: v[1])
                what = f"running {label} for {duration(now - since)}"
            else:
                what = "between runs"
            line = f"...  [{self.finished}/{self.total}] {what} · {self._times()}"
            self._line(line)
            return line

    # -- numbers -----------------------------------------------------------------------------------------
    def eta(self) -> float | None:
        """Seconds left (a lower bound when :meth:`estimate` says so), or None when nothing is known yet."""
        found = self.estimate()
        return None if found is None else found[0]

    def estimate(self) -> tuple[float, bool] | None:
        """``(seconds left, is a lower bound)``, or None before any basis for a number (module docstring)."""
        now = self.clock()
        rate, bounded = self._rate(), False
        if rate is None and not self.durations:
            return self._early_bound(now)
        left, longest = 0.0, 0.0
        keys = self.pending | set(self.running)
        unnamed = max(0, self.total - self.finished - len(keys))  # runs the ticker knows only by their count
        if unnamed:
            if not self.durations:
                return None
            left += unnamed * sum(self.durations) / len(self.durations)
        for key in keys:
            expected = self._expected(key, rate)
            if expected is None:
                if rate is None and not self.durations:
                    return None
                bounded = True  # a run nothing predicts: counted as 0 s
                continue
            if key in self.running:
                spent = now - self.running[key][1]
                if spent > expected:  # past its prediction: what remains is unknown, at least 0
                    bounded = True
                    continue
                expected -= spent
            left += expected
            longest = max(longest, expected)
        return max(left / self.jobs, longest), bounded  # parallel workers cannot split one run

    def _early_bound(self, now: float) -> tuple[float, bool] | None:
        """Before any run has finished: a sized run that has run ``t`` s costs at least ``t / size`` per unit of
        size, a bound for the runs of its own claim only (claims differ too much to bound each other; theirs
        count 0). ``(seconds, True)``, or None when that bounds nothing."""
        lower: dict[str, float] = {}
        for key, (_, since) in self.running.items():
            if key in self.sizes:
                group = self.groups.get(key, key)
                lower[group] = max(lower.get(group, 0.0), (now - since) / self.sizes[key])
        left = sum(lower[self.groups[k]] * self.sizes[k] for k in self.pending - set(self.running)
                   if k in self.sizes and self.groups.get(k) in lower)
        return (left / self.jobs, True) if left > 0 else None

    def _rate(self) -> float | None:
        """Seconds per unit of size on this machine now: the median over claims of each claim's Σ seconds / Σ size
        (its sized runs that finished), or None. A median, because a claim's first run may carry one-off costs
        (the first law check of a worker imports ``torch._dynamo``: 11 s where its mates take 2 s)."""
        seconds: dict[str, float] = {}
        size: dict[str, float] = {}
        for key, took in self.ran.items():
            if key in self.sizes:
                group = self.groups.get(key, key)
                seconds[group] = seconds.get(group, 0.0) + took
                size[group] = size.get(group, 0.0) + self.sizes[key]
        rates = sorted(seconds[g] / size[g] for g in size if size[g] > 0)
        if not rates:
            return None
        middle = len(rates) // 2
        return rates[middle] if len(rates) % 2 else (rates[middle - 1] + rates[middle]) / 2

    def _expected(self, key: str, rate: float | None) -> float | None:
        """Seconds the run ``key`` is expected to take (module docstring), or None when nothing predicts it."""
        group = self.groups.get(key)
        mates = [k for k in self.ran if self.groups.get(k) == group] if group is not None else []
        if key in self.sizes and rate is not None:
            sized = [k for k in mates if k in self.sizes]
            predicted = sum(rate * self.sizes[k] for k in sized)
            factor = sum(self.ran[k] for k in sized) / predicted if predicted > 0 else 1.0
            return rate * self.sizes[key] * factor
        if mates:
            return sum(self.ran[k] for k in mates) / len(mates)
        if self.durations:
            return sum(self.durations) / len(self.durations)
        return None

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def _times(self) -> str:
        found = self.estimate()
        eta = "?" if found is None else (">" if found[1] else "~") + duration(found[0])
        return f"elapsed {duration(self.elapsed())} · ETA {eta}"

    def _line(self, text: str) -> None:
        self.last = self.clock()
        self.emit(text)

    # -- heartbeat thread --------------------------------------------------------------------------------
    def __enter__(self) -> Ticker:
        def beat() -> None:
            while not self._stop.wait(min(1.0, self.every / 4)):
                self.heartbeat()

        self._thread = threading.Thread(target=beat, name="flowgeom-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
