"""A fake registry of tiny deterministic experiments for the sweep/report tests.

Importable by name (``_sweep_fakes``) from spawn workers and Ray workers, so
that the run functions pickle by reference. Also a driver:
``python _sweep_fakes.py reproduce ARGS...`` runs the real CLI handler on
these claims (used for the kill -9 test).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from flowgeom.reproduce.registry import Claim, Verdict, grid
from flowgeom.runs import RunFolder


def counter_run(config, folder: RunFolder, resume: bool) -> dict:
    """A checkpoint per step: acc_{k+1} = (31·acc_k + 7·seed + k) mod 1000003."""
    start, acc = 0, config["seed"]
    ckpt = folder.load_checkpoint() if resume else None
    if ckpt is not None:
        start, acc = ckpt["step"] + 1, ckpt["acc"]
        folder.truncate_metrics(after_step=ckpt["step"])
    elif resume:
        folder.truncate_metrics(after_step=-1)
    for step in range(start, config["n"]):
        acc = (31 * acc + 7 * config["seed"] + step) % 1000003
        folder.log({"step": step, "acc": acc})
        time.sleep(config["sleep"])
        folder.save_checkpoint({"step": step, "acc": acc})
    metrics = folder.metrics()
    return {"acc": acc, "steps": [m["step"] for m in metrics], "accs": [m["acc"] for m in metrics]}


def boom_run(config, folder: RunFolder, resume: bool) -> dict:
    if config["x"] == 1:
        raise ValueError("planted failure in run x=1")
    if config["x"] == 2:
        raise OSError(28, "No space left on device")
    return {"x": config["x"], "square": config["x"] ** 2}


def die_run(config, folder: RunFolder, resume: bool) -> dict:
    """Kills its own process when ``die`` (a worker that dies, not an exception)."""
    if config["die"]:
        os._exit(17)
    return {"ok": config["k"]}


def counter_verdict(runs, figures_dir: Path) -> Verdict:
    from flowgeom.report.figures import curves

    fig = curves(figures_dir / "acc.png", {f"seed {r.config['seed']}": (r.summary["steps"], r.summary["accs"])
                                           for r in runs}, title="fake counter <&>", xlabel="step", ylabel="acc")
    total = sum(r.summary["acc"] for r in runs)
    return Verdict(f"sum of final acc = {total}", "reproduced", figures=(fig,),
                   table=tuple({"seed": r.config["seed"], "acc": r.summary["acc"]} for r in runs))


def boom_verdict(runs, figures_dir: Path) -> Verdict:
    return Verdict(f"{len(runs)} runs ok | with a pipe", "differs", how="fake <b>claim</b> differs")


def counter_claim(*, n: int = 12, sleep: float = 0.0, seeds=(0, 1, 2)) -> Claim:
    return Claim(area="laws", id="fake.counter", seed="000", text="A counter <counts> & checkpoints.",
                 quick=grid(n=[n], seed=list(seeds), sleep=[sleep]), run=counter_run, verdict=counter_verdict)


def boom_claim() -> Claim:
    return Claim(area="conservation", id="fake.boom", seed="000", text="Some runs raise.",
                 quick=grid(x=[0, 1, 2, 3]), run=boom_run, verdict=boom_verdict)


def die_claim() -> Claim:
    return Claim(area="langevin", id="fake.die", seed="004", text="A worker dies.",
                 quick=({"k": 0, "die": False}, {"k": 1, "die": True}, {"k": 2, "die": False}),
                 run=die_run, verdict=boom_verdict)


def unavailable_claim() -> Claim:
    return Claim(area="continuity", id="fake.missing", seed="001", text="Needs an API that is not here.",
                 unavailable="flowgeom.continuity.nothing is not importable")


def main(argv: list[str]) -> int:
    """Driver: ``reproduce ...`` on the counter claim (sleep from $FAKE_SLEEP)."""
    from flowgeom.cli import build_parser
    from flowgeom.cli.reproduce import run_reproduce
    from flowgeom.errors import FlowgeomError

    args = build_parser().parse_args(argv)
    try:
        return run_reproduce(args, claims=[counter_claim(sleep=float(os.environ.get("FAKE_SLEEP", "0")))])
    except FlowgeomError as exc:
        print(f"flowgeom: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def fill_run(config, folder: RunFolder, resume: bool) -> dict:
    """With $FAKE_FILL set, write into the run folder until the disk is full (the OSError propagates)."""
    if config["fill"] and os.environ.get("FAKE_FILL"):
        with open(folder.path / "blob.bin", "wb") as fh:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
                os.fsync(fh.fileno())
    return {"fill": config["fill"]}


def fill_claim() -> Claim:
    return Claim(area="laws", id="fake.fill", seed="000", text="Fills the disk.",
                 quick=({"fill": True}, {"fill": False}), run=fill_run, verdict=boom_verdict)
