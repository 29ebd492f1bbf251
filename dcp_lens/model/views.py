"""The containers of an unrolled view: ``model.blocks`` and ``model.loop`` of the k-iteration view,
the state they share with the model, and the hook points of one loop iteration."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from dcp_lens.model.components.norms import make_norm
from dcp_lens.model.config import RecurrentConfig
from dcp_lens.model.names import DepthMismatchError


class IterationHooks(nn.Module):
    """Hook points of one loop iteration t (t = 0 holds only the initial state)."""

    def __init__(self, cfg: RecurrentConfig, t: int):
        super().__init__()
        self.t = t
        self.hook_inject = HookPoint()  # [batch, pos, d_model]
        self.ln_iter = make_norm(cfg) if t > 0 and cfg.iteration_norm != "none" else None
        self.hook_state = HookPoint()  # [batch, pos, d_model]


class ViewState:
    """The number of iterations of the model's active view, shared with its `ViewModuleList`s."""

    def __init__(self) -> None:
        self.active = -1


class ViewModuleList(nn.ModuleList):
    """``model.blocks`` or ``model.loop`` of the k-iteration view. Reaching an entry by attribute
    (``getattr(blocks, "6")``, as nnsight's wrappers do) while the model runs another view raises
    a `DepthMismatchError`: a wrapper built at one depth is traced at that depth."""

    def __init__(
        self, modules: Sequence[nn.Module] = (), view: ViewState | None = None, k: int = -1
    ) -> None:
        super().__init__(modules)  # a slice (blocks[:3]) is a list of no view: view None
        self.view_state = view
        self.view_iterations = k

    def __getattr__(self, name: str) -> nn.Module | Tensor:
        view = self.__dict__.get("view_state")
        if view is not None and name.isdigit() and view.active != self.view_iterations:
            k, active = self.view_iterations, view.active
            raise DepthMismatchError(
                f"entry {name} of model.blocks or model.loop of the k = {k} view, while the "
                f"model runs k = {active}: a wrapper (nnsight's NNsight(model), or a saved "
                "model.blocks) reaches the blocks of the view it was built in. Build it "
                f"inside `with model.iterations({active}):` and trace it there, or trace at "
                f"k = {k}."
            )
        return super().__getattr__(name)

    def __repr__(self) -> str:
        """The entries folded into one line per group (`folded_entries`), so that ``print(model)``
        names every block application without listing one layer r times;
        ``nn.ModuleList.__repr__(model.blocks)`` lists every entry."""
        lines = [f"  ({span}): {text}" for span, text in folded_entries(list(self))]
        if not lines:
            return f"{type(self).__name__}()"
        return f"{type(self).__name__}(\n" + "\n".join(lines) + "\n)"


def folded_entries(modules: Sequence[nn.Module]) -> list[tuple[str, str]]:
    """``(index span, description)`` per group of ``modules``: where entries repeat another's
    weights (the same parameter objects: the core's layers, applied once per iteration), the
    entries before the first repeat are the prelude, the repeating run the core (its layers times
    the iterations, weights shared) and the rest the coda; elsewhere consecutive entries of one
    structure are one group."""
    owners = [tuple(id(p) for p in module.parameters()) for module in modules]
    first = next((i for i, owner in enumerate(owners) if owner and owner in owners[:i]), None)
    if first is None:
        return _runs(modules, 0, len(modules), "")
    start = owners.index(owners[first])
    # The period is the one whose repetition runs furthest (the fewest layers among equals): a
    # core that repeats a layer inside one iteration (HRM-Text's inner passes) repeats with the
    # whole iteration's period too, and that one runs to the coda.
    periods = [j - start for j in range(first, len(modules)) if owners[j] == owners[start]]
    layers, end = max(
        ((period, _periodic_end(owners, start, period)) for period in periods),
        key=lambda candidate: (candidate[1], -candidate[0]),
    )
    iterations = (end - start) // layers
    core = (
        f"core, {layers} layer{'s' if layers > 1 else ''} x {iterations} iterations (weights "
        f"shared): {_describe(modules[start])}"
    )
    return [
        *_runs(modules, 0, start, "prelude, "),
        (_span(start, end), core),
        *_runs(modules, end, len(modules), "coda, "),
    ]


def _periodic_end(owners: Sequence[tuple[int, ...]], start: int, period: int) -> int:
    """Where the run of ``owners`` from ``start`` that repeats with ``period`` ends."""
    end = start + period
    while end < len(owners) and owners[end] == owners[start + (end - start) % period]:
        end += 1
    return end


def _runs(modules: Sequence[nn.Module], start: int, end: int, role: str) -> list[tuple[str, str]]:
    """Consecutive entries of ``modules[start:end]`` with one description, one group each."""
    groups: list[tuple[str, str]] = []
    i = start
    while i < end:
        text = _describe(modules[i])
        j = i + 1
        while j < end and _describe(modules[j]) == text:
            j += 1
        count = f"{j - i} x " if j - i > 1 else ""
        groups.append((_span(i, j), f"{role}{count}{text}"))
        i = j
    return groups


def _describe(module: nn.Module) -> str:
    """``Type(child=Type, ...)``, hook points left out."""
    children = [
        f"{name}={type(child).__name__}"
        for name, child in module.named_children()
        if not isinstance(child, HookPoint)
    ]
    return f"{type(module).__name__}({', '.join(children)})"


def _span(start: int, end: int) -> str:
    return str(start) if end - start == 1 else f"{start}-{end - 1}"
