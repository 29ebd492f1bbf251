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
