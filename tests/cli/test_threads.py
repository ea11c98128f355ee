"""--threads has one meaning on every command: default None (torch's own count), N for the command, then restored."""

from __future__ import annotations

import argparse

import torch

from flowgeom.cli import build_parser, main
from flowgeom.cli._common import THREADS_HELP, _cpus, threads_for


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                for inner, leaf in _subparsers(sub):
                    yield f"{name} {inner}", leaf


def test_every_threads_flag_means_the_same():
    seen = {}
    for name, sub in _subparsers(build_parser()):
        flag = next((a for a in sub._actions if "--threads" in a.option_strings), None)
        if flag is not None:
            seen[name] = flag
    assert {"continuity analyze", "compress run", "compress evaluate", "continuity train", "conserve run",
            "langevin villani", "langevin darcy"} <= set(seen), sorted(seen)
    common = THREADS_HELP.format(cpus=_cpus())
    for name, flag in seen.items():
        assert flag.default is None, name
        assert flag.help.startswith(common), (name, flag.help)
        assert flag.type("1") == 1, name


def test_threads_for_sets_and_restores():
    before = torch.get_num_threads()
    with threads_for(None):
        assert torch.get_num_threads() == before
    n = 2 if _cpus() >= 2 and before != 2 else 1
    with threads_for(n):
        assert torch.get_num_threads() == n
    assert torch.get_num_threads() == before


def test_main_restores_the_threads_after_a_command(capsys, monkeypatch):
    import flowgeom.langevin as langevin

    before = torch.get_num_threads()
    n = 2 if _cpus() >= 2 and before != 2 else 1
    seen, real = [], langevin.probe

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(langevin, "probe", spy)
    assert main(["langevin", "villani", "--loss", "norm2", "--rays", "2", "--points", "6", "--json",
                 "--threads", str(n)]) == 0
    capsys.readouterr()
    assert seen == [n] and torch.get_num_threads() == before
