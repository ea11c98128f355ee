"""Progress of a sweep that a person can follow: runs done / total, the current run, elapsed time, ETA.

A sweep's runs take from a fraction of a second to minutes, so a line per
finished run is not enough: a long run would leave the terminal silent. The
:class:`Ticker` prints

    done [12/36] conservation.drift 3f2a9c1e 12.3s · elapsed 2m10s · ETA ~3m40s

when a run ends, and while one runs, a heartbeat at least every ``every``
seconds (10 by default):

    ...  [12/36] running continuity.lm-projection 8c01d2aa for 40s · elapsed 2m50s · ETA ~3m10s

Lines, not a redrawn bar, so that the same output reads well in a terminal, a
``make demo | tee log`` and a CI log. The ETA is the mean duration of the runs
finished in this sweep (runs kept from an earlier sweep take no time and are
not counted) times the runs left, divided by the parallel workers, minus what
the running ones have already spent; "ETA ?" until one run has finished. Given
each run's claim (``groups``), a run is expected to cost what the finished runs
of its own claim cost (a claim's runs are alike; claims are not), else the mean;
while a run takes longer than that, the ETA is "?" rather than a wrong "~0s".
"""

from __future__ import annotations

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
                 groups: dict[str, str] | None = None, clock: Callable[[], float] = time.monotonic):
        if every <= 0:
            raise ValueError(f"every must be > 0 seconds, got {every}")
        self.total, self.emit, self.every, self.jobs, self.clock = total, emit, every, max(1, jobs), clock
        # run key -> group (its claim): runs of one claim cost alike, runs of different claims do not
        self.groups = dict(groups or {})
        self.pending = set(self.groups)  # keys not yet ended
        self.by_group: dict[str, list[float]] = {}
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
        """Seconds left, or None before the first run that really ran has finished."""
        if not self.durations:
            return None
        mean = sum(self.durations) / len(self.durations)
        now = self.clock()
        if not self.groups:
            left = (self.total - self.finished) * mean / self.jobs
            spent = sum(now - since for _, since in self.running.values()) / self.jobs
            return max(0.0, left - min(spent, left))

        def expected(key: str) -> float:  # the mean of its claim's finished runs, else of all runs
            seen = self.by_group.get(self.groups.get(key, ""), [])
            return sum(seen) / len(seen) if seen else mean

        over = [k for k, (_, since) in self.running.items() if now - since > expected(k)]
        if over:  # a run past what its claim's runs took: any number would be a guess
            return None
        left = sum(expected(k) for k in self.pending if k not in self.running)
        left += sum(expected(k) - (now - since) for k, (_, since) in self.running.items())
        return left / self.jobs

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def _times(self) -> str:
        eta = self.eta()
        return f"elapsed {duration(self.elapsed())} · ETA " + (f"~{duration(eta)}" if eta is not None else "?")

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
