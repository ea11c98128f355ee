"""Small matplotlib helpers shared by the claim adapters (Agg backend, PNG out).

Every helper takes the target path, writes the PNG atomically and returns the
path, so a verdict function can list its figures directly.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from flowgeom.errors import FlowgeomError
from flowgeom.runs import atomic_write_figure


def figure_formats() -> dict[str, str]:
    """``{extension: description}`` of the file types matplotlib can write (png, pdf, svg, ...)."""
    from matplotlib.backend_bases import FigureCanvasBase

    # pgf needs a LaTeX installation to be written, so it is not offered.
    return {ext: desc for ext, desc in sorted(FigureCanvasBase.get_supported_filetypes().items()) if ext != "pgf"}


def check_figure_path(path: str | os.PathLike) -> Path:
    """``path`` as a Path if a figure can be written there, else :class:`FlowgeomError` (before any work).

    Refused: an extension matplotlib cannot write (the error lists those it
    can), a path that is an existing directory, and what
    :func:`flowgeom.files.check_out_file` refuses (a symlink, a parent that is
    a file or a folder that is not writable, an existing checkpoint).
    """
    raw = os.fspath(path)
    path = Path(raw)
    formats = figure_formats()
    listed = ", ".join("." + ext for ext in formats)
    if path.is_dir() or raw.endswith(("/", os.sep)):
        raise FlowgeomError(f"figure path {raw!r} is a directory; give a file name ending in one of: {listed}")
    ext = path.suffix.lstrip(".").lower()
    if ext not in formats:
        raise FlowgeomError(f"figure path {str(path)!r}: unknown extension {('.' + ext) if ext else '(none)'!r}; "
                            f"use one of: {listed}")
    from flowgeom.files import check_out_file

    check_out_file(path, "--figure")  # a link, a parent that is a file or not writable: the one output rule
    return path


def new_figure(figsize: tuple[float, float]):
    """A bare :class:`matplotlib.figure.Figure` (object API: no pyplot state, no global backend switch)."""
    from matplotlib.figure import Figure

    return Figure(figsize=figsize)


def save(fig, path: str | os.PathLike) -> Path:
    """Write ``fig`` as PNG to ``path`` (atomic)."""
    return atomic_write_figure(path, fig, format="png", dpi=110, bbox_inches="tight")


def log_bars(path: str | os.PathLike, groups: Mapping[str, Mapping[str, float]], *, title: str, ylabel: str,
             threshold: float | None = None, threshold_label: str = "") -> Path:
    """Grouped bars on a log axis: ``groups[label][series] = value`` (zeros drawn at 1e-18).

    Used for violations (a real law at round-off ~1e-16 vs an O(1) control).
    """
    labels = list(groups)
    series = sorted({s for g in groups.values() for s in g})
    fig = new_figure((max(5.0, 0.9 * len(labels) + 2), 3.4))
    ax = fig.subplots()
    width = 0.8 / max(1, len(series))
    for k, name in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))]
        ys = [max(abs(groups[lab].get(name, float("nan"))), 1e-18) for lab in labels]
        ax.bar(xs, ys, width=width, label=name)
    if threshold is not None:
        ax.axhline(threshold, color="k", ls="--", lw=1, label=threshold_label or f"{threshold:g}")
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    return save(fig, path)


def paired_bars(path: str | os.PathLike, labels: Sequence[str], left: Sequence[float], right: Sequence[float], *,
                names: tuple[str, str], title: str, ylabel: str) -> Path:
    """Two bars per label (e.g. the seed's count vs our count)."""
    fig = new_figure((max(5.0, 0.9 * len(labels) + 2), 3.4))
    ax = fig.subplots()
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], left, width=0.4, label=names[0])
    ax.bar([x + 0.2 for x in xs], right, width=0.4, label=names[1])
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    return save(fig, path)


def curves(path: str | os.PathLike, series: Mapping[str, tuple[Sequence[float], Sequence[float]]], *, title: str,
           xlabel: str, ylabel: str, logx: bool = False, logy: bool = False) -> Path:
    """One line per named ``(x, y)`` series."""
    fig = new_figure((5.5, 3.4))
    ax = fig.subplots()
    for name, (x, y) in series.items():
        ax.plot(list(x), list(y), marker="o", ms=3, label=name)
    if logx:
        ax.set_xscale("log")
        _log_labels(ax.xaxis, [v for x, _ in series.values() for v in x])
    if logy:
        ax.set_yscale("log")
        _log_labels(ax.yaxis, [v for _, y in series.values() for v in y])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if series:
        ax.legend(fontsize=7)
    return save(fig, path)


def _log_labels(axis, values: Sequence[float]) -> None:
    """Readable labels on a log axis whose data span under two decades.

    matplotlib then labels the minor ticks too (2, 3, 4, 6 × 10ⁿ), which run
    into each other (``3×10⁻³4×10⁻³`` on the τ axis of the O(τ²k) figure);
    labels go on 1, 2 and 5 × 10ⁿ only, when at least two of those lie in the
    data's range (``tests/report/test_figure_labels.py`` checks every figure).
    """
    import math

    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    positive = [float(v) for v in values if v is not None and math.isfinite(v) and v > 0]
    if not positive:
        return
    low, high = min(positive), max(positive)
    if math.log10(high / low) >= 2:
        return
    marks = [m * 10.0 ** e for e in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
             for m in (1, 2, 5)]
    if sum(low <= m <= high for m in marks) < 2:
        return
    def label(value: float, _pos=None) -> str:  # 0.005 -> 5×10⁻³, 0.01 -> 10⁻² (mathtext, as matplotlib writes them)
        exponent = math.floor(math.log10(value) + 1e-9)
        mantissa = round(value / 10.0 ** exponent)
        return f"$10^{{{exponent}}}$" if mantissa == 1 else f"${mantissa}\\times10^{{{exponent}}}$"

    axis.set_major_locator(FixedLocator(marks))  # the view keeps its autoscaled limits; marks outside are not drawn
    axis.set_major_formatter(FuncFormatter(label))
    axis.set_minor_formatter(NullFormatter())
