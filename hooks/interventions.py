"""The Depth Control Protocol's interventions as TransformerLens hook sets (docs/design.md §3).

Each intervention is a small object whose `fwd_hooks(model)` returns ``[(hook_name, fn), …]`` on
the iteration-level hook points, for ``model.run_with_hooks(tokens, fwd_hooks=…)`` or
``with model.hooks(fwd_hooks=…):``. The model runs its full depth r; the hooks change which
state reaches the readout. Nothing is stored on the model, so it is left exactly as it was.

=====================  =====================================================  ===  ===  =========
condition              what reaches the readout                               B    D    S
=====================  =====================================================  ===  ===  =========
``full``               s_r                                                    r    r    0
``truncate(k)``        s_k                                                    k    k    S_trunc
``replay(k)``          s_k + (r - k) Delta_k, Delta_k = s_k - s_{k-1}          r    k    S_replay
``calibrate(c, map)``  map(readout input of c), an affine moment-matching map  c    c    ~0
``shift(k, map)``      map^-1(s_r), map = the calibration of truncate(k)      r    r    ~S_trunc
=====================  =====================================================  ===  ===  =========

On a dense model an iteration is a layer (the state after layer t is
``blocks.{t-1}.hook_resid_post``) and the readout is the final norm and unembedding. `replay`
still runs there, but a dense model repeating a layer's update is not the same model in another
configuration: `Intervention.realizable` says so and reports label it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

HookList = list[tuple[str, Callable[..., Any]]]


@runtime_checkable
class StateMap(Protocol):
    """An invertible map of readout inputs, such as `dcp_lens.calibration.AffineCalibration`."""

    def __call__(self, h: Tensor) -> Tensor: ...

    def inverse(self) -> StateMap: ...


@runtime_checkable
class IterationModel(Protocol):
    """What the interventions need of a model: iteration hook names and the active depth."""

    @property
    def n_iterations(self) -> int: ...

    @property
    def is_dense(self) -> bool: ...

    @property
    def readout_hook_name(self) -> str: ...

    def state_hook_name(self, t: int) -> str: ...


@dataclass(frozen=True)
class Intervention:
    """A named condition of the protocol; `fwd_hooks` builds its hooks for one model."""

    name: str
    k: int | None = None
    inner: Intervention | None = None
    state_map: Any = field(default=None, compare=False)

    @property
    def label(self) -> str:
        if self.name == "full":
            return "full"
        if self.name == "calibrate":
            assert self.inner is not None
            return f"calibrate({self.inner.label})"
        return f"{self.name}({self.k})"

    def realizable(self, model: IterationModel) -> bool:
        """False for replay on a dense model: it is not that model in another configuration."""
        uses_replay = self.name == "replay" or (
            self.inner is not None and self.inner.name == "replay"
        )
        return not (uses_replay and model.is_dense)

    def fwd_hooks(self, model: IterationModel) -> HookList:
        """The ``(hook_name, hook_fn)`` pairs that realise this condition on ``model``."""
        r = model.n_iterations
        if self.k is not None:
            _check_depth(self.k, r, self.name)
        if self.name == "full":
            return []
        if self.name == "truncate":
            return _truncate_hooks(model, self.k)
        if self.name == "replay":
            return _replay_hooks(model, self.k)
        if self.name == "calibrate":
            assert self.inner is not None
            return self.inner.fwd_hooks(model) + [
                (model.readout_hook_name, _map_hook(self.state_map))
            ]
        if self.name == "shift":
            return [(model.readout_hook_name, _map_hook(self.state_map.inverse()))]
        raise ValueError(f"unknown intervention {self.name!r}.")

    def __repr__(self) -> str:
        return f"Intervention({self.label})"


def full() -> Intervention:
    """The unmodified model at its full depth r (no hooks)."""
    return Intervention("full")


def truncate(k: int) -> Intervention:
    """Read out after k iterations: the readout sees s_k (B = D = k).

    On a recurrent model this equals ``model.iterations(k)``; the hook form runs all r iterations
    and swaps the readout input, so it composes with other hooks at full depth."""
    return Intervention("truncate", _positive(k, "truncate"))


def replay(k: int) -> Intervention:
    """k distinct iterations, then the k-th update repeated: s_t = s_{t-1} + Delta_k for t > k.

    The linchpin control: ``replay(1)`` spends the full budget of r block applications with a
    single distinct iteration (B = r, D = k)."""
    return Intervention("replay", _positive(k, "replay"))


def calibrate(condition: Intervention, state_map: StateMap) -> Intervention:
    """``condition`` with its readout input mapped by ``state_map`` (fitted by the protocol on a
    calibration split: `dcp_lens.calibration.fit_calibration(condition_states, full_states)`)."""
    if not isinstance(condition, Intervention):
        raise TypeError(f"calibrate wraps an Intervention, got {type(condition).__name__}.")
    if condition.name in ("calibrate", "shift"):
        raise ValueError(f"calibrate({condition.label}) would map the readout twice.")
    _check_map(state_map)
    return Intervention("calibrate", condition.k, inner=condition, state_map=state_map)


def shift(k: int, truncate_calibration: StateMap) -> Intervention:
    """Full depth with the readout input mapped by the *inverse* of calibrate(truncate(k)):
    full information in a truncated-looking frame (the positive control for S)."""
    _check_map(truncate_calibration)
    return Intervention("shift", _positive(k, "shift"), state_map=truncate_calibration)


def _truncate_hooks(model: IterationModel, k: int | None) -> HookList:
    assert k is not None
    captured: dict[str, Tensor] = {}

    def keep(state: Tensor, hook: Any) -> None:
        captured["state"] = state

    def swap(readout_input: Tensor, hook: Any) -> Tensor:
        return captured.pop("state")

    return [(model.state_hook_name(k), keep), (model.readout_hook_name, swap)]


def _replay_hooks(model: IterationModel, k: int | None) -> HookList:
    assert k is not None
    r = model.n_iterations
    captured: dict[str, Tensor] = {}

    def keep_previous(state: Tensor, hook: Any) -> None:
        captured["previous"] = state

    def keep_update(state: Tensor, hook: Any) -> None:
        captured["state"], captured["update"] = state, state - captured.pop("previous")

    def replayed(t: int) -> Callable[..., Tensor]:
        def hook(state: Tensor, hook: Any) -> Tensor:
            return captured["state"] + (t - k) * captured["update"]

        return hook

    hooks: HookList = [
        (model.state_hook_name(k - 1), keep_previous),
        (model.state_hook_name(k), keep_update),
    ]
    hooks += [(model.state_hook_name(t), replayed(t)) for t in range(k + 1, r + 1)]
    return hooks


def _map_hook(state_map: StateMap) -> Callable[..., Tensor]:
    def hook(readout_input: Tensor, hook: Any) -> Tensor:
        return state_map(readout_input)

    return hook


def _positive(k: object, name: str) -> int:
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"{name}(k) needs an int number of iterations, got {k!r}.")
    if k < 1:
        raise ValueError(f"{name}(k={k}): k must be >= 1.")
    return k


def _check_depth(k: int, r: int, name: str) -> None:
    if not 1 <= k <= r:
        raise ValueError(
            f"{name}(k={k}) needs 1 <= k <= r = {r} (the model's active depth); "
            "use `with model.iterations(k):` to run beyond r."
        )


def _check_map(state_map: object) -> None:
    if not callable(state_map) or not hasattr(state_map, "inverse"):
        raise TypeError(
            "a state map must be callable with an .inverse() method (an AffineCalibration), "
            f"got {type(state_map).__name__}."
        )
