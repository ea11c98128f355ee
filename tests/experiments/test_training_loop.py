"""The shared training loop on tiny step functions: tick order, kill-and-resume equality, divergence, hooks."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowgeom.errors import FlowgeomError
from flowgeom.experiments.training import (Diverged, Step, checkpoint_state, loss_hook, restore_checkpoint,
                                           train_loop)
from flowgeom.runs import RunFolder


class Regression:
    """A real tiny training problem: y = x·w* + noise, a Linear(3, 1) trained by SGD with momentum.

    Batches come from an explicit generator, so the run depends on its
    checkpointable state only (model, optimiser, generator).
    """

    def __init__(self, seed: int = 0, nan_at: int | None = None):
        with torch.random.fork_rng(devices=[]):  # Linear's init draws from the global RNG: seed it locally
            torch.manual_seed(seed)
            self.model = torch.nn.Linear(3, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.w_star = torch.tensor([[1.0], [-2.0], [0.5]])
        self.nan_at = nan_at
        self.calls: list[tuple[str, int]] = []

    def forward(self, k: int) -> float:
        self.calls.append(("forward", k))
        x = torch.randn(8, 3, generator=self.gen)  # (B, 3)
        y = x @ self.w_star + 0.1 * torch.randn(8, 1, generator=self.gen)  # (B, 1)
        self.opt.zero_grad(set_to_none=True)
        loss = (self.model(x) - y).pow(2).mean()
        if self.nan_at == k:
            loss = loss * math.nan
        value = float(loss.detach())
        if math.isfinite(value):
            loss.backward()
        return value

    def update(self, k: int) -> None:
        self.calls.append(("update", k))
        self.opt.step()

    def step(self) -> Step:
        return Step(forward=self.forward, update=self.update)

    def hook(self, tick) -> dict:
        self.calls.append(("hook", tick.step))
        weight = self.model.weight.detach()
        return {"w0": float(weight[0, 0]), "grad_norm": float(self.model.weight.grad.norm())}

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def _run(problem: Regression, folder: RunFolder, *, steps: int, log_every: int, checkpoint_every: int,
         final_tick: bool, start: int = 0, stop_after: int | None = None):
    def save(k: int) -> None:
        folder.save_checkpoint(checkpoint_state(k, model=problem.model, optimizer=problem.opt, generator=problem.gen))

    return train_loop(problem.step(), steps=steps, start=start, log=folder.log, log_every=log_every,
                      hooks=(loss_hook, problem.hook), checkpoint=save, checkpoint_every=checkpoint_every,
                      stop_after=stop_after, final_tick=final_tick)


@settings(max_examples=25, deadline=None)
@given(steps=st.integers(1, 12), log_every=st.integers(1, 5), final_tick=st.booleans())
def test_hooks_run_on_the_log_ticks_after_the_forward_and_before_the_update(steps, log_every, final_tick):
    problem = Regression()
    lines: list[dict] = []
    end = train_loop(problem.step(), steps=steps, log=lines.append, log_every=log_every,
                     hooks=(loss_hook, problem.hook), final_tick=final_tick)
    last = steps if final_tick else steps - 1
    expected = sorted({k for k in range(last + 1) if k % log_every == 0} | {last})
    assert end.status == "finished" and end.step == steps
    assert [line["step"] for line in lines] == expected
    assert end.last == lines[-1]
    # per tick: forward, then the hook (log ticks only), then the update (never on the final tick)
    for k in range(last + 1):
        tick_calls = [c for c in problem.calls if c[1] == k]
        want = [("forward", k)] + ([("hook", k)] if k in expected else []) + ([("update", k)] if k < steps else [])
        assert tick_calls == want
    assert sum(c[0] == "update" for c in problem.calls) == steps
    # the logged loss is the loss that forward returned at that tick (the hook sees θ_k, before its update)
    assert all(math.isfinite(line["loss"]) for line in lines)
    assert end.loss == lines[-1]["loss"]


@settings(max_examples=25, deadline=None)
@given(steps=st.integers(2, 14), every=st.integers(1, 5), data=st.data(), final_tick=st.booleans())
def test_kill_and_resume_gives_the_uninterrupted_run(tmp_path_factory, steps, every, data, final_tick):
    stop = data.draw(st.integers(1, steps - 1 if not final_tick else steps))
    root = tmp_path_factory.mktemp("resume")
    ref_folder, cut_folder = RunFolder(root / "ref"), RunFolder(root / "cut")
    for folder in (ref_folder, cut_folder):
        folder.start({"steps": steps}, resume=False)
    ref = Regression()
    ref_end = _run(ref, ref_folder, steps=steps, log_every=2, checkpoint_every=every, final_tick=final_tick)

    killed = Regression()
    end = _run(killed, cut_folder, steps=steps, log_every=2, checkpoint_every=every, final_tick=final_tick,
               stop_after=stop)
    assert end.status == "stopped" and end.step == stop
    assert sum(c[0] == "update" for c in killed.calls) == stop

    fresh = Regression()  # a new process: everything re-built, then restored from the folder
    ckpt = cut_folder.load_checkpoint()
    start = 0
    if ckpt is not None:
        start = restore_checkpoint(ckpt, model=fresh.model, optimizer=fresh.opt, generator=fresh.gen)
        assert 0 < start < stop and start % every == 0  # the stop tick's own checkpoint is never written
    else:
        assert stop <= every or stop == 1
    cut_folder.truncate_metrics(after_step=start - 1)
    resumed = _run(fresh, cut_folder, steps=steps, log_every=2, checkpoint_every=every, final_tick=final_tick,
                   start=start)
    assert resumed.status == "finished" and resumed.last == ref_end.last and resumed.loss == ref_end.loss
    assert cut_folder.metrics() == ref_folder.metrics()  # every line, every key, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(fresh.params(), ref.params()))


def test_checkpoints_are_written_strictly_inside_the_run_and_not_at_the_kill_tick():
    seen: list[int] = []
    step = Step(forward=lambda k: 1.0, update=lambda k: None)
    train_loop(step, steps=10, log=lambda line: None, log_every=3, checkpoint=seen.append, checkpoint_every=5)
    assert seen == [5]  # not 0 (nothing to save), not 10 (the final tick only measures)
    seen.clear()
    train_loop(step, steps=10, start=5, log=lambda line: None, log_every=3, checkpoint=seen.append,
               checkpoint_every=2)
    assert seen == [6, 8]  # the tick resumed from is not rewritten
    seen.clear()
    end = train_loop(step, steps=10, log=lambda line: None, log_every=3, checkpoint=seen.append,
                     checkpoint_every=4, stop_after=8)
    assert end.status == "stopped" and seen == [4]  # killed right after 8 updates: checkpoint 8 never written


@pytest.mark.parametrize("final_tick", [True, False])
def test_a_non_finite_loss_ends_the_run_with_one_divergence_line(tmp_path, final_tick):
    problem = Regression(nan_at=3)
    folder = RunFolder(tmp_path / "r")
    folder.start({}, resume=False)
    end = train_loop(problem.step(), steps=8, log=folder.log, log_every=1, hooks=(loss_hook, problem.hook),
                     context=lambda k: {"step": k, "phase": "test"}, final_tick=final_tick,
                     diverged_extra={"event": "blew_up"})
    assert end.status == "diverged" and end.step == 3 and math.isnan(end.loss)
    assert end.message == "loss became nan at step 3"
    lines = folder.metrics()
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    assert lines[-1] == {"step": 3, "phase": "test", "event": "blew_up", "loss": None, "diverged": True,
                         "message": "loss became nan at step 3"}  # NaN is written as null
    assert end.last == lines[2] and "diverged" not in lines[2]
    assert ("update", 3) not in problem.calls and ("hook", 3) not in problem.calls


@pytest.mark.parametrize("where", ["update", "hook", "log"])
def test_diverged_raised_inside_a_tick_is_the_same_policy(where):
    lines: list[dict] = []

    def update(k):
        if where == "update" and k == 2:
            raise Diverged("chain blew up at step 2")

    def hook(tick):
        if where == "hook" and tick.step == 2:
            raise Diverged("metrics became non-finite at step 2")
        return {"m": tick.step}

    def log(line):
        lines.append(line)
        if where == "log" and line.get("step") == 2 and not line.get("diverged"):
            raise Diverged("metrics became non-finite at step 2")

    end = train_loop(Step(update=update), steps=5, log=log, log_every=1, hooks=(hook,))
    assert end.status == "diverged" and end.step == 2
    assert lines[-1]["diverged"] is True and lines[-1]["step"] == 2 and "loss" not in lines[-1]  # no batch loss
    assert lines[-1]["message"] == end.message
    # a log that raised still kept its line: the metrics of the diverged tick stay on record
    assert [line["step"] for line in lines] == ([0, 1, 2, 2] if where in ("update", "log") else [0, 1, 2])


def test_an_update_may_report_the_loss_it_found():
    def update(k):
        if k == 1:
            raise Diverged("loss became inf at step 1", loss=math.inf)

    lines: list[dict] = []
    end = train_loop(Step(update=update), steps=4, log=lines.append, log_every=2)
    assert end.status == "diverged" and end.loss == math.inf and lines[-1]["loss"] == math.inf


def test_other_errors_are_not_divergence():
    def update(k):
        raise FlowgeomError("a bad config found late")

    with pytest.raises(FlowgeomError, match="bad config"):
        train_loop(Step(update=update), steps=3, log=lambda line: None, log_every=1)


@pytest.mark.parametrize("kwargs, match", [(dict(log_every=0), "log_every"),
                                           (dict(checkpoint_every=-1), "checkpoint_every"),
                                           (dict(start=12), "start"), (dict(start=-1), "start")])
def test_bad_arguments_name_the_value(kwargs, match):
    with pytest.raises(FlowgeomError, match=match):
        train_loop(Step(update=lambda k: None), steps=10, log=lambda line: None, **{"log_every": 1, **kwargs})


def test_restore_refuses_a_checkpoint_of_another_schema():
    problem = Regression()
    state = checkpoint_state(3, model=problem.model, optimizer=problem.opt, generator=problem.gen)
    assert set(state) == {"step", "model", "optimizer", "generator"}
    bad = {k: v for k, v in state.items() if k != "generator"}
    bad["batch_gen"] = state["generator"]
    with pytest.raises(FlowgeomError, match="'generator'"):
        restore_checkpoint(bad, model=problem.model, optimizer=problem.opt, generator=problem.gen)
    other = Regression(seed=5)
    assert restore_checkpoint(state, model=other.model, optimizer=other.opt, generator=other.gen) == 3
    assert all(torch.equal(a, b) for a, b in zip(other.params(), problem.params()))
    assert torch.equal(other.gen.get_state(), problem.gen.get_state())


def test_continuity_and_conservation_mark_divergence_the_same_way(tmp_path):
    """The two experiments that stop on a non-finite loss write the same divergence line."""
    from flowgeom.experiments.conservation import ConservationConfig, run_conservation
    from flowgeom.experiments.continuity_loop import make_optimizer, train_tracked

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 3, bias=False))
    summary = train_tracked(RunFolder(tmp_path / "c"), config={}, model=model,
                            optimizer=make_optimizer("sgd", model.parameters(), lr=1e30),
                            next_batch=lambda g: (torch.randn(4, 3, generator=g),),
                            loss_fn=lambda m, b: m(b[0]).pow(2).mean() * 1e30,
                            roles={"w": [model[0].weight, model[1].weight]}, steps=10, log_every=1, ckpt_every=5,
                            seed=0)
    assert summary["status"] == "nan"
    cfg = ConservationConfig.for_arch("mha-none-swiglu", d_model=8, heads=2, d_k=4, d_hidden=8, n_layers=1,
                                      seq_len=8, batch=4, corpus_chars=5000, steps=12, log_every=1, lr=1e4)
    with pytest.raises(FlowgeomError, match="diverged"):
        run_conservation(cfg, tmp_path / "d")
    for folder in ("c", "d"):
        line = RunFolder(tmp_path / folder).metrics()[-1]
        assert line["diverged"] is True and line["loss"] is None
        assert re.fullmatch(rf"loss became (nan|inf) at step {line['step']}", line["message"])
