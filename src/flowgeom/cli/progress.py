"""Progress of multi-stage commands (compress run/sweep/evaluate/heal) on stderr.

The library reports ``update(stage, done, total)`` after each unit of work
(a calibrated block, a factored unit, a scored window). On a terminal that
drives a rich bar per stage; anywhere else (a pipe, a log, CI) a heartbeat
thread prints one plain line at least every ``every`` seconds while a stage
runs, so a slow unit (a block of a large model can take minutes) still shows
the command is alive. A stage that ends within ``quiet`` seconds prints
nothing in line mode.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Update = Callable[[str, int, int], None]


def clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class _Lines:
    """The line-mode reporter: the current stage, its count, elapsed time and ETA every ``every`` seconds."""

    def __init__(self, prefix: str, every: float, quiet: float, stream):
        self.prefix, self.every, self.quiet, self.stream = prefix, every, quiet, stream
        self.lock = threading.Lock()
        self.stage: str | None = None
        self.done = self.total = 0
        self.started = self.printed = time.monotonic()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def line(self, now: float) -> str:
        elapsed = now - self.started
        eta = f", ETA {clock(elapsed * (self.total - self.done) / self.done)}" if 0 < self.done < self.total else ""
        return f"{self.prefix}: {self.stage} {self.done}/{self.total}, {clock(elapsed)} elapsed{eta}"

    def _emit(self, text: str, now: float) -> None:
        print(text, file=self.stream, flush=True)
        self.printed = now

    def __call__(self, stage: str, done: int, total: int) -> None:
        with self.lock:
            now = time.monotonic()
            if stage != self.stage:
                self._finish(now)
                self.stage, self.started, self.printed = stage, now, now
            self.done, self.total = done, total
            if done >= total and now - self.started >= self.quiet:
                self._emit(f"{self.prefix}: {stage} {done}/{total} done in {clock(now - self.started)}", now)
                self.stage = None

    def _finish(self, now: float) -> None:
        if self.stage is not None and now - self.started >= self.quiet and self.done < self.total:
            self._emit(self.line(now), now)

    def _beat(self) -> None:
        while not self.stop.wait(min(1.0, self.every)):
            with self.lock:
                now = time.monotonic()
                if self.stage is not None and now - self.printed >= self.every:
                    self._emit(self.line(now), now)


@contextmanager
def stage_progress(enabled: bool, *, prefix: str = "flowgeom", every: float = 10.0, quiet: float = 2.0,
                   stream=None) -> Iterator[Update | None]:
    """``update(stage, done, total)`` for the duration of the block: a rich bar on a terminal, heartbeat lines
    elsewhere, ``None`` (no reporting) when not ``enabled`` (``--json``)."""
    stream = sys.stderr if stream is None else stream
    if not enabled:
        yield None
        return
    if stream.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                       TimeElapsedColumn(), TimeRemainingColumn(), console=Console(file=stream), transient=True)
        tasks: dict[str, int] = {}

        def update(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        with bar:
            yield update
        return
    lines = _Lines(prefix, every, quiet, stream)
    lines.thread.start()
    try:
        yield lines
    finally:
        lines.stop.set()
        lines.thread.join()
