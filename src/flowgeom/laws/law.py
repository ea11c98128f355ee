"""What a conservation law is: :class:`Law`, the :class:`CatalogueEntry` of a model, and the helpers
every law family shares (upper triangles, parameter names under a prefix, norm controls).

The catalogue (zoo blocks), the attention laws (zoo and Hugging Face), the MoE and
LoRA laws all build these; nothing here knows any architecture.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import Tensor

from flowgeom.laws import batched
from flowgeom.laws.batched import Batch, sq_norm

Params = Mapping[str, Tensor]


@dataclass(frozen=True)
class Law:
    """One family of conserved (or claimed/control) quantities of a block.

    ``evaluate(params)`` returns a vector of ``count`` scalars; ``params``
    maps full parameter names (with the block prefix) to tensors. ``batch``
    (optional) is the same law in vectorised form, used by the monitor to
    evaluate all same-shaped laws at once (:mod:`flowgeom.laws.batched`).
    """

    family: str
    name: str
    formula: str
    count: int
    params: tuple[str, ...]
    fn: Callable[[Params], Tensor] = field(repr=False, compare=False)
    status: str = "law"  # "law" | "control" (not conserved) | "refuted" (claimed, measured false)
    note: str = ""
    batch: Batch | None = field(default=None, repr=False, compare=False)
    block: str = ""  # module path of the block the law belongs to (set by locate; "" = from the parameter names)
    degree: int = 2  # h(sθ) = s^degree·h(θ); 1: a *linear* law, kept exactly by every discrete GD step

    def evaluate(self, params: Params) -> Tensor:
        return self.fn(params)


@dataclass(frozen=True)
class CatalogueEntry:
    """Everything the catalogue says about one model: laws, controls, refuted claims."""

    laws: tuple[Law, ...]
    controls: tuple[Law, ...]
    refuted: tuple[Law, ...]
    notes: tuple[str, ...] = ()

    @property
    def count(self) -> int:
        return sum(law.count for law in self.laws)


def upper(m: Tensor) -> Tensor:
    """Upper triangles (diagonal included) of (..., n, n) matrices, flattened: (... · n(n+1)/2,)."""
    return batched.upper(m).reshape(-1)


def join(prefix: str, name: str) -> str:
    """``prefix.name`` (``name`` alone at the top level)."""
    return f"{prefix}.{name}" if prefix else name


def norm_control(prefix: str, pname: str, label: str) -> Law:
    """‖prefix.pname‖²_F as a *control*: a quantity that is not conserved, so the check can be seen failing."""
    full = join(prefix, pname)
    return Law(
        family="control", name=f"‖{full}‖²_F", formula=f"‖{label}‖²_F (not conserved)", count=1, params=(full,),
        fn=lambda p: (p[full] ** 2).sum().reshape(1), status="control",
        batch=Batch(sq_norm, lambda p: (p[full][None],)),
    )
