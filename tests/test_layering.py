"""The house's layers, read from the source with ``ast`` (nothing is imported).

DESIGN.md, "Layout": ``io``, ``data`` and ``nn`` sit at the bottom and import
nothing above them; no import circles between packages; the optional extras
(transformers, peft, lightning, wandb, tensorboard, ...) are never imported
when the core is. Every ``import`` counts, those inside functions too (a
lazy import is still a dependency); a string constant that names a flowgeom
module counts as a lazy import too (``importlib.import_module(NAME)``).

Nodes of the package graph are the first component below ``flowgeom``:
``flowgeom.laws.count`` is ``laws``, ``flowgeom.files`` is ``files``,
``flowgeom/__init__.py`` is ``flowgeom`` (the root: every import of a
flowgeom module runs it, so it belongs at the bottom too). Below packages,
no two modules import each other (directly or round a longer circle), and
the modules of ``flowgeom.compress`` stand in the order of its pipeline
(:data:`COMPRESS_ORDER`, the order its package docstring lists), each
importing only those before it.

The checks are plain functions over ``{module name: source}``, so the last
tests feed them fake modules that break each rule and see them fail.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "flowgeom"

# Modules under everything: they import only each other.
FOUNDATION = {"after_import", "errors", "files", "limits", "memory", "options", "runs"}
# What each bottom package may import (besides itself).
ALLOWED = {
    "io": {"errors", "files", "limits", "memory"},
    "nn": FOUNDATION | {"io"},
    "data": FOUNDATION | {"io"},
    **{name: FOUNDATION for name in FOUNDATION | {"flowgeom"}},
}
# Import circles between packages that are known and accepted, each with its reason: {frozenset(packages): why}.
# None today. A listed circle that no longer exists fails the test too, so the list stays true.
ALLOWED_CYCLES: dict[frozenset[str], str] = {}
# flowgeom.compress's modules, helpers first, then its stages in the order a compression runs them: each may import
# only those before it. Its package docstring lists them in this order.
COMPRESS = "flowgeom.compress"
COMPRESS_ORDER = ("factorize", "allocate", "write", "store", "arch", "source", "calibrate", "blocks", "plan", "lowrank",
                  "folder", "auto", "mixed", "run", "stream", "perplexity", "agreement", "evaluate", "heal", "sweep")
# Optional extras: imported only inside functions, or at module level only by these packages.
EXTRAS = {"transformers", "peft", "lightning", "pytorch_lightning", "wandb", "tensorboard", "tensorboardX", "mlflow",
          "ray", "accelerate"}
EXTRA_HOMES = {"integrations", "hf"}


@dataclass(frozen=True)
class Import:
    source: str  # importing module, e.g. flowgeom.nn.llama
    target: str  # imported module or top-level name, e.g. flowgeom.io.sources, transformers
    line: int
    module_level: bool  # runs when the importing module is imported


def read_tree(root: Path = SRC) -> dict[str, str]:
    """``{module name: source}`` of every ``.py`` under ``root`` (a package's ``__init__`` named as the package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path.read_text(encoding="utf-8")
    return out


def _packages(modules: dict[str, str]) -> set[str]:
    """Names that are packages: every proper prefix of a module name."""
    return {".".join(m.split(".")[:i]) for m in modules for i in range(1, m.count(".") + 1)}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(modules: dict[str, str]) -> list[Import]:
    """Every import of every module: absolute, relative, lazy (in functions) and by name (string constants)."""
    known, packages = set(modules), _packages(modules)
    found: list[Import] = []

    def visit(name: str, node: ast.AST, module_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            level = module_level and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.If) and _is_type_checking(child):
                level = False  # never runs
            if isinstance(child, ast.Import):
                found.extend(Import(name, a.name, child.lineno, module_level) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: resolve against the importing module's package
                    pkg = name.split(".") if name in packages else name.split(".")[:-1]
                    pkg = pkg[:len(pkg) - child.level + 1]
                    base = ".".join(pkg + ([child.module] if child.module else []))
                # `from flowgeom.x import y` of a submodule y imports y (x's __init__ runs, but none of its names
                # is used); any other name is x's own
                subs = [f"{base}.{a.name}" for a in child.names if f"{base}.{a.name}" in known]
                if len(subs) < len(child.names):
                    found.append(Import(name, base, child.lineno, module_level))
                found.extend(Import(name, sub, child.lineno, module_level) for sub in subs)
            elif isinstance(child, ast.Constant) and isinstance(child.value, str) and child.value in known \
                    and "." in child.value:  # "flowgeom.data.tokens", not the word "flowgeom"
                found.append(Import(name, child.value, child.lineno, False))  # imported by name, when called
            visit(name, child, level)

    for name, source in modules.items():
        visit(name, ast.parse(source, filename=name), True)
    return found


def package_of(module: str) -> str | None:
    """``laws`` for ``flowgeom.laws.count``, ``flowgeom`` for the root, ``None`` outside flowgeom."""
    parts = module.split(".")
    if parts[0] != "flowgeom":
        return None
    return parts[1] if len(parts) > 1 else "flowgeom"


def package_graph(found: list[Import]) -> dict[str, dict[str, list[Import]]]:
    """``{package: {package it imports: [the imports]}}`` between flowgeom packages (self-edges left out)."""
    graph: dict[str, dict[str, list[Import]]] = {}
    for imp in found:
        src, dst = package_of(imp.source), package_of(imp.target)
        graph.setdefault(src, {})
        if dst is not None and dst not in (src, "flowgeom"):  # the root runs first anyway
            graph[src].setdefault(dst, []).append(imp)
    return graph


def layer_violations(found: list[Import]) -> list[str]:
    """Imports from a bottom package (``ALLOWED``) to anything not allowed for it."""
    out = []
    for src, edges in package_graph(found).items():
        if src not in ALLOWED:
            continue
        for dst, imps in sorted(edges.items()):
            if dst not in ALLOWED[src]:
                out += [f"{i.source}:{i.line} imports {i.target} ({src} may import only "
                        f"{', '.join(sorted(ALLOWED[src]))})" for i in imps]
    return out


def cycles(found: list[Import]) -> list[frozenset[str]]:
    """The import circles between packages."""
    return strong_components({src: set(edges) for src, edges in package_graph(found).items()})


def module_cycles(found: list[Import]) -> list[frozenset[str]]:
    """The import circles between flowgeom modules (a package's ``__init__`` is a module of its own)."""
    modules = {i.source for i in found}
    graph: dict[str, set[str]] = {}
    for imp in found:
        if imp.target in modules and imp.target != imp.source:
            graph.setdefault(imp.source, set()).add(imp.target)
    return strong_components(graph)


def strong_components(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one node (Tarjan): the circles of ``graph``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def upward_imports(found: list[Import], order: tuple[str, ...] = COMPRESS_ORDER) -> list[str]:
    """Imports inside ``flowgeom.compress`` from a module to one not before it in ``order`` (the package's own
    ``__init__``, which imports the stages, counts as after every one), and its modules missing from ``order``."""
    rank = {f"{COMPRESS}.{name}": i for i, name in enumerate(order)}
    inside = {m for i in found for m in (i.source, i.target) if m.startswith(COMPRESS + ".")}
    out = [f"{m} is not in COMPRESS_ORDER: add it where it stands in the pipeline, and to the package docstring"
           for m in sorted(inside - set(rank))]
    for imp in found:
        if imp.source in rank and (imp.target == COMPRESS or rank.get(imp.target, -1) >= rank[imp.source]):
            out.append(f"{imp.source}:{imp.line} imports {imp.target}, which stands after it in COMPRESS_ORDER; "
                       "move the piece both need down into a module before them")
    return out


def docstring_order(source: str) -> tuple[str, ...]:
    """The module names a package docstring lists, one per indented line (``    name   what it does``)."""
    doc = ast.get_docstring(ast.parse(source), clean=False) or ""
    return tuple(m[1] for line in doc.splitlines() if (m := re.match(r"    ([a-z_]+)\s{2,}\S", line)))


def extra_violations(found: list[Import]) -> list[str]:
    """Core modules that import an optional extra when they are imported, directly or through other modules.

    A module outside ``EXTRA_HOMES`` may not name an extra in a module-level
    import; and following module-level imports from any core module (parent
    packages' ``__init__`` included, since importing ``a.b`` runs ``a``)
    must never reach an extra, even through ``flowgeom.hf`` or
    ``flowgeom.integrations``.
    """
    eager: dict[str, set[str]] = {}
    modules = {i.source for i in found}
    for imp in found:
        if imp.module_level:
            parts = imp.target.split(".")
            # importing a.b.c runs a, a.b and a.b.c
            eager.setdefault(imp.source, set()).update(".".join(parts[:k]) for k in range(1, len(parts) + 1))
    out = []
    for imp in found:
        pkg = package_of(imp.source)
        if imp.module_level and imp.target.split(".")[0] in EXTRAS and pkg not in EXTRA_HOMES:
            out.append(f"{imp.source}:{imp.line} imports {imp.target} at module level; import it inside the "
                       "function that needs it (the core must import without the extras)")
    for start in sorted(m for m in modules if package_of(m) not in EXTRA_HOMES):
        seen, todo, via = {start}, [start], {start: None}
        while todo:
            mod = todo.pop()
            for nxt in sorted(eager.get(mod, ())):
                if nxt in seen:
                    continue
                seen.add(nxt)
                via[nxt] = mod
                if nxt.split(".")[0] in EXTRAS:
                    chain, at = [nxt], mod
                    while at is not None:
                        chain.append(at)
                        at = via[at]
                    if len(chain) > 2:  # a direct import is reported above
                        out.append(f"importing {start} imports {nxt}: {' -> '.join(reversed(chain))}")
                elif nxt in modules:
                    todo.append(nxt)
    return out


# ---------------------------------------------------------------- the real tree

FOUND = imports(read_tree())


def test_the_tree_is_read():
    """The reader sees the house: the packages exist and a known lazy import is found."""
    graph = package_graph(FOUND)
    assert {"io", "nn", "data", "laws", "continuity", "cli"} <= set(graph)
    assert any(i.source == "flowgeom.nn.llama" and i.target.startswith("flowgeom.io") for i in FOUND)
    lazy = [i for i in FOUND if i.source == "flowgeom.data.tokens" and i.target == "flowgeom.io"]
    assert lazy and not any(i.module_level for i in lazy)  # imported inside load_tokenizer


def test_bottom_packages_import_nothing_above_them():
    assert layer_violations(FOUND) == []


def test_no_import_circles_between_packages():
    found = set(cycles(FOUND))
    unexpected = [sorted(c) for c in found if c not in ALLOWED_CYCLES]
    assert unexpected == [], f"import circles between packages: {unexpected}"
    stale = [sorted(c) for c in ALLOWED_CYCLES if c not in found]
    assert stale == [], f"ALLOWED_CYCLES lists circles that are gone, remove them: {stale}"


def test_no_import_circles_between_modules():
    assert [sorted(c) for c in module_cycles(FOUND)] == []


def test_compress_imports_follow_its_pipeline():
    assert upward_imports(FOUND) == []


def test_the_compress_docstring_lists_the_pipeline_order():
    assert docstring_order(read_tree()[COMPRESS]) == COMPRESS_ORDER


def test_core_imports_without_the_extras():
    assert extra_violations(FOUND) == []


# ---------------------------------------------------------------- the checks can fail

def _with(**fake: str) -> list[Import]:
    """The real tree plus fake modules (``flowgeom__nn__bad="..."`` is ``flowgeom.nn.bad``)."""
    return imports({**read_tree(), **{name.replace("__", "."): text for name, text in fake.items()}})


def test_an_upward_import_from_the_bottom_is_caught():
    bad = _with(flowgeom__nn__bad="def f():\n    from flowgeom.laws import catalogue\n")
    assert any("flowgeom.nn.bad:2 imports flowgeom.laws" in v for v in layer_violations(bad))
    bad = _with(flowgeom__data__bad="from flowgeom.nn.llama import LlamaConfig\n")
    assert any("flowgeom.data.bad:1" in v for v in layer_violations(bad))
    bad = _with(flowgeom__io__bad="from .. import continuity\n")  # relative imports resolve too
    assert any("flowgeom.io.bad:1 imports flowgeom.continuity" in v for v in layer_violations(bad))
    bad = _with(flowgeom__io__bad2="import importlib\nM = 'flowgeom.nn.llama'\n")  # imported by name
    assert any("flowgeom.io.bad2:2 imports flowgeom.nn.llama" in v for v in layer_violations(bad))


def test_an_import_circle_is_caught():
    assert frozenset({"hf", "laws"}) in cycles(_with(flowgeom__hf__bad="from flowgeom.laws import catalogue\n"))
    three = _with(flowgeom__langevin__bad="import flowgeom.report\n",
                  flowgeom__report__bad="def f():\n    import flowgeom.cli\n",
                  flowgeom__cli__bad="import flowgeom.langevin.bad\n")
    assert frozenset({"langevin", "report", "cli"}) <= {c for c in cycles(three) if "langevin" in c}.pop()


def test_a_circle_between_modules_is_caught():
    two = _with(flowgeom__nn__bad_a="from flowgeom.nn.bad_b import f\n",
                flowgeom__nn__bad_b="def f():\n    from flowgeom.nn import bad_a\n")  # lazy, and by submodule name
    assert frozenset({"flowgeom.nn.bad_a", "flowgeom.nn.bad_b"}) in module_cycles(two)
    init = _with(flowgeom__compress__bad="from flowgeom.compress import load\n",  # through the package's __init__
                 flowgeom__compress__run="from flowgeom.compress.bad import load\n")
    assert any({"flowgeom.compress", "flowgeom.compress.bad"} <= c for c in module_cycles(init))


def test_an_upward_import_in_compress_is_caught():
    lazy = _with(flowgeom__compress__factorize="def f():\n    from flowgeom.compress.plan import Plan\n")
    assert any(v.startswith("flowgeom.compress.factorize:2 imports flowgeom.compress.plan,")
               for v in upward_imports(lazy))
    by_name = _with(flowgeom__compress__arch="from flowgeom.compress import factorize, source\n")  # submodules
    assert [v.split(",")[0] for v in upward_imports(by_name)] == ["flowgeom.compress.arch:1 imports "
                                                                 "flowgeom.compress.source"]
    package = _with(flowgeom__compress__write="from flowgeom.compress import load\n")
    assert any(v.startswith("flowgeom.compress.write:1 imports flowgeom.compress,") for v in upward_imports(package))
    unlisted = _with(flowgeom__compress__extra="from flowgeom.compress.arch import ROLES\n")
    assert any(v.startswith("flowgeom.compress.extra is not in COMPRESS_ORDER") for v in upward_imports(unlisted))
    assert docstring_order('"""Stages::\n\n    source   the model\n    arch     its roles\n"""') == ("source", "arch")


def test_an_extra_at_module_level_is_caught():
    bad = _with(flowgeom__laws__bad="import transformers\n")
    assert any("flowgeom.laws.bad:1 imports transformers" in v for v in extra_violations(bad))
    ok = _with(flowgeom__laws__bad="def f():\n    import transformers\n",
               flowgeom__laws__bad2="from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import wandb\n")
    assert extra_violations(ok) == []
    # through a home of the extras: a core module importing it at module level pulls the extra in
    through = _with(flowgeom__hf__bad="from transformers import PreTrainedModel\n",
                    flowgeom__laws__bad="from flowgeom.hf.bad import PreTrainedModel\n")
    assert any(v.startswith("importing flowgeom.laws.bad imports transformers") for v in extra_violations(through))
