"""How right the progress line's ETA is, replayed on the run times of a finished tour.

    python benchmarks/tour_eta.py runs/demo            # the folder of `make demo` (or any quick sweep)
    python benchmarks/tour_eta.py runs/demo --jobs 2
    python benchmarks/tour_eta.py runs/demo --cpu      # each run's CPU seconds instead (a machine without others' load)

Reads each run's measured seconds (``timing.json``) and replays the sweep, in
its plan order, through :class:`flowgeom.reproduce.progress.Ticker` on a fake
clock, with the sizes the claims give (:mod:`flowgeom.reproduce.cost`) and a
heartbeat poll every second. With ``--jobs J`` the runs are dealt to J
workers as a pool would (each next run to the first free worker). After each
run it prints the ETA against the time really left, and at the end the
error at the halfway run and the longest stretch of "ETA ?". ``--cpu`` replays
each run's CPU seconds instead of its wall time: for runs at one thread each
(the tour's default) that is the time the run takes on a core of its own,
which other people's load on a shared machine does not change.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from pathlib import Path

from flowgeom.reproduce.progress import Ticker
from flowgeom.reproduce.registry import AREAS, load_claims
from flowgeom.reproduce.sweep import plan


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep", help="a finished quick sweep folder (e.g. runs/demo)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--cpu", action="store_true", help="replay the runs' CPU seconds, not their wall seconds")
    args = ap.parse_args()

    claims = [c for c in load_claims(list(AREAS)) if not c.unavailable]
    specs = [s for s in plan(claims, scale="quick", out=args.sweep) if (s.path / "timing.json").exists()]
    if not specs:
        print(f"no finished runs under {args.sweep}/runs", file=sys.stderr)
        return 2
    field = "cpu_seconds" if args.cpu else "seconds"
    seconds = {s.key: float(json.loads((s.path / "timing.json").read_text())[field]) for s in specs}
    clock, lines = Clock(), []
    ticker = Ticker(len(specs), lines.append, jobs=args.jobs, groups={s.key: s.claim_id for s in specs},
                    sizes={s.key: s.size for s in specs}, clock=clock)
    # the pool: (time the worker is free, worker) and the runs in flight (end time, key)
    free = [(0.0, w) for w in range(args.jobs)]
    flying: list[tuple[float, str]] = []
    queue = list(specs)
    ends: dict[str, float] = {}
    for spec in queue:  # when each run would end (a worker takes the next run as soon as it is free)
        start, worker = heapq.heappop(free)
        ends[spec.key] = start + seconds[spec.key]
        heapq.heappush(free, (ends[spec.key], worker))
    starts = {s.key: ends[s.key] - seconds[s.key] for s in specs}
    finish = max(ends.values())
    events = sorted([(starts[k], 1, k) for k in starts] + [(ends[k], 0, k) for k in ends])
    done, rows, unknown_since, longest_unknown = 0, [], None, 0.0
    t = 0.0
    for when, kind, key in events:
        while t + 1 < when:  # the heartbeat thread's polls
            t += 1
            clock.t = t
            if ticker.heartbeat() is not None:
                if lines[-1].endswith("ETA ?"):
                    unknown_since = t if unknown_since is None else unknown_since
                    longest_unknown = max(longest_unknown, t - unknown_since)
                else:
                    unknown_since = None
        t = clock.t = when
        if kind == 1:
            ticker.start(key, key)
            continue
        ticker.done(key, key, "finished", seconds[key])
        done += 1
        found = ticker.estimate()
        left = finish - when
        error = abs(found[0] - left) / left if found is not None and left > 0 else None
        rows.append((done, key, found, left, error))
        mark = "?" if found is None else (">" if found[1] else "~") + f"{found[0]:.0f}s"
        print(f"[{done:2d}/{len(specs)}] {key[:60]:60s} ETA {mark:>8}  really left {left:6.0f}s  "
              + (f"error {error:6.1%}" if error is not None else ""))
    half = rows[len(rows) // 2 - 1]
    print(f"\n{len(specs)} runs, {finish:.0f} s replayed ({field}) at --jobs {args.jobs}; at the halfway run "
          f"({half[0]}/{len(specs)}) the ETA was off by "
          f"{'?' if half[4] is None else f'{half[4]:.0%}'}; longest 'ETA ?' stretch {longest_unknown:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
