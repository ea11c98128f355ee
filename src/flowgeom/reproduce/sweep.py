"""Sweeps: a grid of configs, one run folder per config, resumable, on a backend.

Layout under ``out``::

    out/runs/<claim id>/<run id>/   one RunFolder per config (config.json,
                                    metrics.jsonl, checkpoint.safetensors,
                                    timing.json, summary.json written last =
                                    finished)
    out/manifest.json               sha256 of each finished run's result files
    out/rejected/<claim>/<run id>/  a finished run whose files no longer
                                    matched the manifest, moved aside

Run ids are deterministic functions of the config
(:func:`flowgeom.reproduce.registry.run_id`), so a second invocation finds
the same folders. With ``resume`` a finished run (``summary.json`` present) is
skipped and an interrupted one is handed to its run function with
``resume=True`` to continue from its checkpoint. Without ``resume`` a sweep
refuses an ``out`` that already holds runs.

Tamper evidence: when a run finishes, its worker hashes the run's result
files (every ``*.json`` and ``*.jsonl`` in the run folder, at any depth:
summary, config, metrics, timing and those of nested runs, which is what the
verdicts read) and the sweep driver, the manifest's only writer, records the
digests in ``out/manifest.json``. Before a sweep reuses a finished run it
checks that the files are exactly the recorded ones and that
``summary.json`` is a JSON object. A run that fails the check (edited,
truncated, missing or added file, no manifest entry, unreadable manifest) is
redone from scratch, with one ``flowgeom: warning:`` line on stderr naming
the run and the file; its old folder is moved to ``out/rejected/``. When it
cannot be moved it is refused: the run is reported failed, never reused.

Backends: ``local`` runs sequentially in this process (``jobs=1``) or in a
spawn-context process pool (``jobs>1``); ``ray`` submits one Ray task per run
(``ray`` is imported only then; run folders must lie on a path every node
sees).

Cores: a local sweep never asks for more threads than the cores this process
may use (``os.sched_getaffinity``): ``jobs`` is capped at the cores and each
run gets ``cores // jobs`` torch/BLAS threads (:func:`thread_budget`).
Oversubscribed, the quick tour's tiny models spend their time in OpenMP
barriers: each parallel region waits for a thread the kernel has
descheduled, and libgomp's waiting threads spin meanwhile (beside two
busy-loop processes the tour took 7.7× its idle time on 2 cores, where a
fair share is 2×; benchmarks/tour_load.py, docs/benchmarks.md). Pool workers
are therefore started with ``OMP_WAIT_POLICY=PASSIVE`` and the thread counts
in their environment (:func:`worker_env`), read by libgomp and OpenBLAS when
torch and scipy load, before any run; a variable the user set is kept. A run that raises, a write that fails (disk full, unwritable folder)
or a worker that dies is recorded as a failed :class:`Outcome` with the
reason; every other run still finishes and keeps its result.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowgeom.errors import FlowgeomError, RefusedInput, choice_error, positive_int
from flowgeom.files import read_text, regular_file
from flowgeom.reproduce.registry import Claim, RunFn, run_id
from flowgeom.runs import RunFolder, atomic_write_bytes, atomic_write_json, confined

BACKENDS = ("local", "ray")
TIMING = "timing.json"
ERROR = "error.txt"
MANIFEST = "manifest.json"
REJECTED = "rejected"


@dataclass(frozen=True)
class RunSpec:
    """One config of one claim, bound to its folder."""

    claim_id: str
    run_id: str
    config: dict[str, Any]
    path: Path
    run: RunFn
    size: float | None = None  # the run's cost in the ETA's unit (Claim.size), None if unknown

    @property
    def key(self) -> str:
        return f"{self.claim_id}/{self.run_id}"


@dataclass(frozen=True)
class Outcome:
    """What happened to one run: ``finished``, ``skipped`` (already finished) or ``failed``.

    ``refused``: it failed on a refused input (:class:`~flowgeom.errors.RefusedInput`: a FIFO in its folder, a
    link out of the sweep), not in a computation.
    """

    key: str
    status: str
    seconds: float = 0.0
    error: str = ""
    resumed: bool = False
    refused: bool = False
    files: dict[str, str] = field(default_factory=dict, compare=False)  # sha256 of the result files (finished)

    def as_dict(self) -> dict[str, Any]:
        return {"run": self.key, "status": self.status, "seconds": round(self.seconds, 3),
                "error": self.error, "resumed": self.resumed, "refused": self.refused}


def plan(claims: Sequence[Claim], *, scale: str, out: str | os.PathLike) -> list[RunSpec]:
    """Every run of every runnable claim at ``scale`` ("quick" or "full")."""
    root = Path(out).resolve() / "runs"
    specs = []
    for claim in claims:
        if claim.unavailable:
            continue
        seen = set()
        for config in claim.grid(scale):
            rid = run_id(config)
            if rid in seen:
                raise FlowgeomError(f"claim {claim.id}: its {scale} grid repeats the config {dict(config)}")
            seen.add(rid)
            specs.append(RunSpec(claim.id, rid, dict(config), root / claim.id / rid, claim.run,
                                 claim.run_size(config)))
    return specs


def check_out(out: str | os.PathLike, specs: Sequence[RunSpec], *, resume: bool) -> None:
    """Validate ``out`` before any run starts: writable, and not holding runs unless resuming."""
    out = Path(out)
    probe = out / ".flowgeom-write-probe"
    try:
        atomic_write_bytes(probe, b"ok\n")
        probe.unlink()
    except (FlowgeomError, OSError) as exc:
        raise FlowgeomError(f"output folder {out} is not writable ({exc}); choose a writable --out") from exc
    if not resume:
        existing = [s.key for s in specs if (s.path / RunFolder.CONFIG).exists()]
        if existing:
            raise FlowgeomError(
                f"{out} already holds {len(existing)} of these runs (e.g. {existing[0]}); "
                "pass --resume to continue them or choose another --out"
            )


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS, Windows)
        return max(1, os.cpu_count() or 1)


def thread_budget(jobs: int, cores: int | None = None) -> tuple[int, int]:
    """``(jobs, threads per run)`` with ``jobs × threads ≤ cores``: ``jobs`` capped at the cores, the rest as threads.

    >>> thread_budget(1, 2), thread_budget(2, 2), thread_budget(8, 2), thread_budget(3, 8)
    ((1, 2), (2, 1), (2, 1), (3, 2))
    """
    cores = available_cores() if cores is None else max(1, cores)
    jobs = min(max(1, jobs), cores)
    return jobs, cores // jobs


# What a pool worker's environment sets before torch, libgomp, MKL and OpenBLAS load (they read it once, at load).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def worker_env(threads: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables a worker process starts with: ``threads`` for OpenMP, MKL and OpenBLAS, and OpenMP threads
    that sleep instead of spinning while they wait (``OMP_WAIT_POLICY=PASSIVE``). Variables already set in
    ``environ`` (default ``os.environ``) are the user's choice and are left out."""
    environ = os.environ if environ is None else environ
    wanted = {name: str(threads) for name in THREAD_VARIABLES} | {"OMP_WAIT_POLICY": "PASSIVE"}
    return {k: v for k, v in wanted.items() if k not in environ}


@contextmanager
def _environment(variables: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``variables`` added while the block runs (spawned workers inherit it), then as before."""
    added = [k for k in variables if k not in os.environ]
    os.environ.update({k: variables[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


@contextmanager
def run_threads(threads: int | None) -> Iterator[None]:
    """torch and the BLAS/OpenMP libraries at ``threads`` threads inside the block (None: unchanged), then as before."""
    if not threads:
        yield
        return
    import torch
    from threadpoolctl import threadpool_limits

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with threadpool_limits(limits=threads):
            yield
    finally:
        torch.set_num_threads(before)


def execute(spec: RunSpec, resume: bool, threads: int | None = None) -> Outcome:
    """Run one spec into its folder (module-level: pools and Ray pickle it), at ``threads`` threads (None: as set).

    Never raises for a failing run: the exception becomes a failed Outcome
    (and, when the folder is writable, ``error.txt`` with the traceback).
    """
    with run_threads(threads):
        return _execute(spec, resume)


def _execute(spec: RunSpec, resume: bool) -> Outcome:
    try:  # a run folder (or a folder above it) planted as a link would carry every write outside the sweep
        confined(_root(spec), spec.path, "run folder")
    except FlowgeomError as exc:
        return Outcome(spec.key, "failed", error=str(exc), refused=isinstance(exc, RefusedInput))
    folder = RunFolder(spec.path)
    if folder.finished:
        return Outcome(spec.key, "skipped")
    start, cpu = time.perf_counter(), time.process_time()
    resuming = False
    try:
        resuming = resume and (folder.path / RunFolder.CONFIG).exists()
        folder.start(spec.config, resume=resume)
        (folder.path / ERROR).unlink(missing_ok=True)
        summary = spec.run(spec.config, folder, resuming)
        if not isinstance(summary, dict):
            raise FlowgeomError(f"run function of {spec.claim_id} returned {type(summary).__name__}, not a dict")
        seconds = time.perf_counter() - start
        atomic_write_json(folder.path / TIMING, {"seconds": seconds, "cpu_seconds": time.process_time() - cpu,
                                                 "resumed": resuming, "pid": os.getpid()}, root=folder.path)
        folder.finish(summary)
        return Outcome(spec.key, "finished", seconds, resumed=resuming, files=result_files(folder.path))
    except Exception as exc:  # noqa: BLE001 - every failure is reported, the sweep goes on
        reason = _reason(exc)
        try:
            atomic_write_bytes(folder.path / ERROR, (reason + "\n\n" + traceback.format_exc()).encode(),
                               root=folder.path)
        except Exception:  # noqa: BLE001 - the folder itself may be what failed
            pass
        return Outcome(spec.key, "failed", time.perf_counter() - start, error=reason, resumed=resuming,
                       refused=isinstance(exc, RefusedInput))


def result_files(path: str | os.PathLike) -> dict[str, str]:
    """sha256 of every ``*.json``/``*.jsonl`` file in the run folder ``path`` (any depth), by relative path."""
    path = Path(path)
    files = {}
    for p in sorted(path.rglob("*")):
        if p.suffix in (".json", ".jsonl") and not p.name.startswith(".") and p.is_file():
            files[p.relative_to(path).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return files


class Manifest:
    """``out/manifest.json``: ``{"format", "version", "runs": {"<claim>/<run>": {"files": {name: sha256}}}}``.

    Written only by the sweep driver (one writer, atomic rewrites); read
    before finished runs are reused. See the module docstring.
    """

    FORMAT = "flowgeom-sweep-manifest"

    def __init__(self, root: Path):
        self.path = root / MANIFEST
        self.runs: dict[str, dict[str, Any]] = {}
        self.problem = ""  # why no entry can be trusted (no or unreadable manifest)
        if not self.path.exists():
            self.problem = f"the sweep has no {MANIFEST} recording its files"
            return
        regular_file(self.path, MANIFEST, fix=f"remove {self.path}; the sweep reruns what it cannot verify")
        try:
            data = json.loads(read_text(self.path, MANIFEST, fix="it is rewritten"))
        except (FlowgeomError, ValueError, RecursionError) as exc:
            self.problem = f"{self.path} is unreadable ({type(exc).__name__})"
            return
        runs = data.get("runs") if isinstance(data, dict) and data.get("format") == self.FORMAT else None
        if not isinstance(runs, dict) or not all(
                isinstance(e, dict) and isinstance(e.get("files"), dict)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in e["files"].items())
                for e in runs.values()):
            self.problem = f"{self.path} is not a flowgeom sweep manifest"
            return
        self.runs = runs

    def mismatch(self, spec: RunSpec) -> str | None:
        """Why the finished run of ``spec`` cannot be reused (naming the file), or ``None`` if it can."""
        entry = self.runs.get(spec.key)
        if entry is None:
            return self.problem or f"it is not recorded in {self.path} (finished before a kill, or by an older flowgeom)"
        want, have = entry["files"], result_files(spec.path)
        for name in sorted(set(want) | set(have)):
            if name not in have:
                return f"{name} is missing"
            if name not in want:
                return f"{name} appeared after the run finished"
            if have[name] != want[name]:
                return f"{name} changed after the run finished"
        try:
            RunFolder(spec.path).summary()
        except FlowgeomError:
            return f"{RunFolder.SUMMARY} is not a JSON object"
        return None

    def record(self, key: str, files: dict[str, str]) -> None:
        self.runs[key] = {"files": dict(files)}
        self._write()

    def forget(self, key: str) -> None:
        if self.runs.pop(key, None) is not None:
            self._write()

    def _write(self) -> None:
        atomic_write_json(self.path, {"format": self.FORMAT, "version": 1, "runs": self.runs})


def _root(spec: RunSpec) -> Path:
    """The sweep's ``out`` folder (``spec.path`` is ``out/runs/<claim>/<run>``)."""
    return spec.path.parent.parent.parent


def warn(message: str) -> None:
    print(f"flowgeom: warning: {message}", file=sys.stderr, flush=True)


def vet(spec: RunSpec, manifest: Manifest) -> Outcome | None:
    """Make a finished run safe to reuse: keep it, or move it aside to be redone; a failed Outcome if neither."""
    if not RunFolder(spec.path).finished:
        return None
    reason = manifest.mismatch(spec)
    if reason is None:
        return None
    aside = _root(spec) / REJECTED / spec.claim_id / spec.run_id
    try:
        confined(_root(spec), aside, "rejected folder")  # rmtree/replace through a planted link would leave the sweep
        confined(_root(spec), spec.path, "run folder")
    except FlowgeomError as exc:
        return Outcome(spec.key, "failed", error=f"its results cannot be trusted ({reason}) and it cannot be moved "
                       f"aside: {exc}", refused=isinstance(exc, RefusedInput))
    try:
        if aside.exists():
            shutil.rmtree(aside)
        aside.parent.mkdir(parents=True, exist_ok=True)
        os.replace(spec.path, aside)
    except OSError as exc:
        return Outcome(spec.key, "failed", error=f"its results cannot be trusted ({reason}) and the folder could not "
                       f"be moved aside ({exc.strerror}); delete {spec.path} and rerun with --resume")
    warn(f"run {spec.key} is redone: {reason}; its old folder is kept in {aside}")
    manifest.forget(spec.key)
    return None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno == 28:
        return f"disk full while writing ({exc}); free space, then rerun with --resume"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else '(no message)'}"


Callback = Callable[[RunSpec, Outcome], None]


@dataclass(frozen=True)
class SweepResult:
    outcomes: tuple[Outcome, ...]
    seconds: float
    backend: str

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "failed"]

    @property
    def ok(self) -> bool:
        return not self.failed

    def as_dict(self) -> dict[str, Any]:
        counts = {s: sum(o.status == s for o in self.outcomes) for s in ("finished", "skipped", "failed")}
        counts["refused"] = sum(o.refused for o in self.failed)  # of the failed: on a refused input
        return {"backend": self.backend, "seconds": round(self.seconds, 3), **counts,
                "runs": [o.as_dict() for o in self.outcomes]}


def run_sweep(specs: Sequence[RunSpec], *, backend: str = "local", jobs: int = 1, resume: bool = False,
              on_start: Callable[[RunSpec], None] | None = None, on_done: Callback | None = None) -> SweepResult:
    """Execute every spec on ``backend``; see the module docstring.

    ``on_start``/``on_done`` are called in this process (progress display).
    Results come back in ``specs`` order whatever the completion order.
    A local sweep runs at most as many runs at once as this process has cores,
    each at ``cores // jobs`` threads (:func:`thread_budget`).
    """
    if backend not in BACKENDS:
        raise choice_error("backend", backend, BACKENDS)
    positive_int(jobs, "--jobs")
    threads = 1
    if backend == "local":
        jobs, threads = thread_budget(jobs)
    start = time.perf_counter()
    on_start = on_start or (lambda spec: None)
    user_done = on_done or (lambda spec, outcome: None)
    manifests: dict[Path, Manifest] = {}
    for spec in specs:
        manifests.setdefault(_root(spec), Manifest(_root(spec)))
    refused = {}
    for spec in specs:
        outcome = vet(spec, manifests[_root(spec)])
        if outcome is not None:
            refused[spec.key] = outcome
    todo = [spec for spec in specs if spec.key not in refused]

    def on_done(spec: RunSpec, outcome: Outcome) -> None:
        if outcome.status == "finished":
            try:
                manifests[_root(spec)].record(spec.key, outcome.files)
            except FlowgeomError as exc:
                warn(f"run {spec.key} finished but is not recorded in the sweep manifest ({exc}); "
                     "a --resume will redo it")
        user_done(spec, outcome)

    if not todo:
        done = {}
    elif backend == "ray":
        done = _run_ray(todo, resume=resume, jobs=jobs, on_start=on_start, on_done=on_done)
    elif jobs == 1:
        done = {}
        for spec in todo:
            on_start(spec)
            done[spec.key] = execute(spec, resume, threads)
            on_done(spec, done[spec.key])
    else:
        with _environment(worker_env(threads)):  # the workers read it when they start, before torch loads
            done = _run_pool(todo, resume=resume, jobs=jobs, threads=threads, on_start=on_start, on_done=on_done)
    for spec in specs:
        if spec.key in refused:
            done[spec.key] = refused[spec.key]
            user_done(spec, refused[spec.key])
    return SweepResult(tuple(done[s.key] for s in specs), time.perf_counter() - start, backend)


def _run_pool(specs, *, resume, jobs, threads, on_start, on_done) -> dict[str, Outcome]:
    """A spawn process pool with at most ``jobs`` runs in flight, each at ``threads`` threads.

    If a worker dies (killed, segfault, out of memory) the pool breaks and
    every run in flight dies with it. Those runs become suspects: each is
    retried alone in a fresh pool (resuming from its checkpoint), so the one
    that kills its worker again is reported failed and the others finish.
    """
    ctx = multiprocessing.get_context("spawn")
    queue = [(spec, resume) for spec in specs]
    suspects: list[RunSpec] = []
    done: dict[str, Outcome] = {}
    while queue or suspects:
        alone = bool(suspects)
        batch = [(suspects.pop(0), True)] if alone else queue
        with cf.ProcessPoolExecutor(max_workers=1 if alone else jobs, mp_context=ctx) as pool:
            flying: dict[cf.Future, RunSpec] = {}
            broken = False
            while (batch or flying) and not broken:
                while batch and len(flying) < (1 if alone else jobs):
                    spec, res = batch[0]
                    try:
                        future = pool.submit(execute, spec, res, threads)
                    except cf.process.BrokenProcessPool:  # a worker died between two submissions
                        broken = True
                        break
                    batch.pop(0)
                    if not alone:
                        on_start(spec)
                    flying[future] = spec
                if broken:
                    break
                finished, _ = cf.wait(flying, return_when=cf.FIRST_COMPLETED)
                for fut in finished:
                    if isinstance(fut.exception(), cf.process.BrokenProcessPool):
                        broken = True
                        continue
                    spec = flying.pop(fut)
                    done[spec.key] = fut.result()
                    on_done(spec, done[spec.key])
            for fut, spec in flying.items():  # the pool broke under these runs
                if fut.done() and fut.exception() is None:
                    done[spec.key] = fut.result()
                elif alone:
                    done[spec.key] = Outcome(spec.key, "failed", error="its worker process died (killed or crashed) "
                                             "while running it, also when run alone; rerun with --resume")
                else:
                    suspects.append(spec)
                    continue
                on_done(spec, done[spec.key])
    return done


def _run_ray(specs, *, resume, jobs, on_start, on_done) -> dict[str, Outcome]:
    """One Ray task per run (``max_retries=0``: a dead worker is reported, not silently rerun).

    Uses the Ray instance already initialised in this process if any, else
    the cluster named by ``RAY_ADDRESS``, else starts a local one with
    ``jobs`` CPUs (or all of them when ``jobs == 1``) and shuts it down after.
    """
    try:
        import ray
    except ImportError as exc:
        raise FlowgeomError("--backend ray needs Ray: pip install 'ray==2.60.0' (or use --backend local)") from exc
    started = False
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
        if address:
            ray.init(address=address, **kwargs)
        else:
            ray.init(num_cpus=jobs if jobs > 1 else os.cpu_count(),
                     runtime_env={"env_vars": {"PYTHONPATH": python_path()}}, **kwargs)
        started = True
    try:
        task = ray.remote(max_retries=0, num_cpus=1)(execute)
        refs = {}
        for spec in specs:
            on_start(spec)
            refs[task.remote(spec, resume, 1)] = spec  # num_cpus=1: one thread
        done: dict[str, Outcome] = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            spec = refs[ready[0]]
            try:
                outcome = ray.get(ready[0])
            except ray.exceptions.RayError as exc:
                first = (str(exc).strip().splitlines() or [""])[0]
                outcome = Outcome(spec.key, "failed", error=f"Ray worker failed ({type(exc).__name__}: {first}); "
                                  "rerun with --resume")
            done[spec.key] = outcome
            on_done(spec, outcome)
        return done
    finally:
        if started:
            ray.shutdown()


def python_path() -> str:
    """This interpreter's import path as a PYTHONPATH value (for workers started elsewhere)."""
    return os.pathsep.join(p for p in sys.path if p)
