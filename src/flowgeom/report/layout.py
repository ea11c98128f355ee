"""Whether a figure's text can be read: no two labels drawn over each other, none cut at the figure's edge.

:func:`label_problems` draws a matplotlib figure at the size and dpi it is
saved with and compares the bounding boxes (in pixels) of its text:

- the tick labels of one axis, pairwise (``3×10⁻³4×10⁻³`` on a log axis
  whose minor ticks are labelled too densely);
- every title, axis label, tick label and legend entry of the figure against
  those of *other* owners (an axes' title against its neighbour's tick labels,
  a y label against the x tick labels of the panel to its left, a legend
  drawn over the tick labels);
- each of them against the figure's edge, unless the figure is saved with
  ``bbox_inches="tight"`` (which grows the image to hold every text).

Only what is drawn counts: visible, non-empty texts, and tick labels whose
tick lies inside the axis' view interval. Overlaps of one pixel or less are
ignored (antialiased glyph edges touch).
"""

from __future__ import annotations

from collections.abc import Iterator

TOLERANCE = 1.0  # pixels


def _ticks(axis) -> list:
    """The visible, non-empty tick labels of ``axis`` whose tick is inside the view interval (major and minor)."""
    low, high = sorted(axis.get_view_interval())
    span = (high - low) or 1.0
    out = []
    for ticks in (axis.get_major_ticks(), axis.get_minor_ticks()):
        for tick in ticks:
            loc = tick.get_loc()
            if loc is None or not (low - 1e-9 * span <= loc <= high + 1e-9 * span):
                continue
            for label in (tick.label1, tick.label2):
                if label.get_visible() and label.get_text().strip():
                    out.append(label)
    return out


def _texts(fig) -> Iterator[tuple[str, str, object]]:
    """``(owner, what, text artist)`` of every text of ``fig`` that a reader has to read."""
    if fig._suptitle is not None and fig._suptitle.get_visible() and fig._suptitle.get_text():
        yield "figure", "suptitle", fig._suptitle
    for i, ax in enumerate(fig.axes):
        owner = f"axes {i}"
        for name, text in (("title", ax.title), ("left title", ax._left_title), ("right title", ax._right_title),
                           ("x label", ax.xaxis.label), ("y label", ax.yaxis.label)):
            if text.get_visible() and text.get_text().strip():
                yield owner, name, text
        for axis, name in ((ax.xaxis, "x tick"), (ax.yaxis, "y tick")):
            for label in _ticks(axis):
                yield owner, f"{name} {label.get_text()!r}", label
        legend = ax.get_legend()
        if legend is not None and legend.get_visible():
            for text in legend.get_texts():
                if text.get_visible() and text.get_text().strip():
                    yield f"{owner} legend", f"legend entry {text.get_text()!r}", text


def _box(text, renderer) -> tuple[tuple[float, float], float, float, float]:
    """The drawn rectangle of ``text``: ``(centre, width, height, angle in radians)``, in pixels.

    A rotated label's window extent is the axis-aligned box around it, much
    larger than the label (two labels at 20° overlap there while their glyphs
    do not); the rectangle is the unrotated extent turned about that box's centre.
    """
    import math

    outer = text.get_window_extent(renderer)
    angle = text.get_rotation()
    if angle % 180 == 0:
        return ((outer.x0 + outer.x1) / 2, (outer.y0 + outer.y1) / 2), outer.width, outer.height, 0.0
    text.set_rotation(0)
    try:
        flat = text.get_window_extent(renderer)
    finally:
        text.set_rotation(angle)
    return ((outer.x0 + outer.x1) / 2, (outer.y0 + outer.y1) / 2), flat.width, flat.height, math.radians(angle)


def _corners(box) -> list[tuple[float, float]]:
    import math

    (cx, cy), w, h, a = box
    c, s = math.cos(a), math.sin(a)
    return [(cx + dx * c - dy * s, cy + dx * s + dy * c) for dx, dy in
            ((-w / 2, -h / 2), (w / 2, -h / 2), (w / 2, h / 2), (-w / 2, h / 2))]


def _overlap(a, b) -> bool:
    """Whether two rectangles (:func:`_box`) overlap by more than :data:`TOLERANCE` (separating-axis test)."""
    import math

    ca, cb = _corners(a), _corners(b)
    for angle in (a[3], a[3] + math.pi / 2, b[3], b[3] + math.pi / 2):
        ux, uy = math.cos(angle), math.sin(angle)
        pa = [x * ux + y * uy for x, y in ca]
        pb = [x * ux + y * uy for x, y in cb]
        if min(max(pa), max(pb)) - max(min(pa), min(pb)) <= TOLERANCE:
            return False
    return True


def label_problems(fig, *, dpi: float | None = None, tight: bool = False) -> list[str]:
    """Overlapping or cut texts of ``fig`` drawn at ``dpi`` (default the figure's), one line each; [] if none.

    ``tight``: the figure is saved with ``bbox_inches="tight"``, so a text outside the canvas is not cut.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if dpi is not None:
        fig.set_dpi(dpi)
    canvas = FigureCanvasAgg(fig) if not isinstance(fig.canvas, FigureCanvasAgg) else fig.canvas
    canvas.draw()
    renderer = canvas.get_renderer()
    texts = [(owner, what, text, _box(text, renderer)) for owner, what, text in _texts(fig)]
    problems = []
    for i, ax in enumerate(fig.axes):  # tick labels of one axis, pairwise
        for axis, name in ((ax.xaxis, "x"), (ax.yaxis, "y")):
            boxes = [(label.get_text(), _box(label, renderer)) for label in _ticks(axis)]
            for j, (a, box_a) in enumerate(boxes):
                for b, box_b in boxes[j + 1:]:
                    if _overlap(box_a, box_b):
                        problems.append(f"axes {i}: {name} tick labels {a!r} and {b!r} overlap")
    for j, (owner_a, what_a, _, box_a) in enumerate(texts):  # texts of different owners
        for owner_b, what_b, _, box_b in texts[j + 1:]:
            if owner_a != owner_b and _overlap(box_a, box_b):
                problems.append(f"{owner_a} {what_a} overlaps {owner_b} {what_b}")
    if not tight:
        edge = fig.bbox
        for owner, what, text, _ in texts:
            box = text.get_window_extent(renderer)
            if (box.x0 < edge.x0 - TOLERANCE or box.y0 < edge.y0 - TOLERANCE or box.x1 > edge.x1 + TOLERANCE
                    or box.y1 > edge.y1 + TOLERANCE):
                problems.append(f"{owner} {what} is cut by the figure's edge")
    return problems
