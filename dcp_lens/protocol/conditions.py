"""The conditions of the Depth Control Protocol, one class each (public face: ``dcp_lens.hooks``).

A condition has two faces, kept side by side in its class:

- its **hook form**, `Condition.fwd_hooks(model)`: ``[(hook_name, fn), ...]`` on the
  iteration-level hook points, for ``model.run_with_hooks(tokens, fwd_hooks=...)`` or
  ``with model.hooks(fwd_hooks=...):``. The model runs its full depth r; the hooks change which
  state reaches the readout, and nothing is stored on the model;
- its **closed form**, `Condition.readout_input(states)`: the stream that reaches the readout,
  built from the cached states s_0..s_r of one full-depth pass (the protocol's fast path).

and its coordinates: block applications B and distinct iterations D (`Condition.coordinates`).

=====================  =====================================================  ===  ===  =========
condition              what reaches the readout                               B    D    S
=====================  =====================================================  ===  ===  =========
``full``               s_r                                                    r    r    0
``truncate(k)``        s_k                                                    k    k    S_trunc
``replay(k)``          s_k + (r - k) Delta_k, Delta_k = s_k - s_{k-1}          r    k    S_replay
``calibrate(c, map)``  map(readout input of c), an affine moment-matching map  c    c    ~0
``shift(k, map)``      map^-1(s_r), map = the calibration of truncate(k)      r    r    ~S_trunc
``translate(c, T)``    T(readout input of c), a paired affine translator      c    c    >= S
``base_rate(table)``   no state: the calibration split's mean full-depth       r    r    none
                       distribution at the position (`BaseRate`)
=====================  =====================================================  ===  ===  =========

``translate`` and ``base_rate`` are the two further controls of the S bracket (docs/bracket.md):
the translator is fitted on the calibration split from each example's readout input to its own
full-depth state (least squares; it can do missing affine computation, so it bounds S from
above), and the
base rate is the best readout that knows nothing about the example: full depth's mean predicted
distribution at the same position over the calibration split (for accuracy its most frequent
answer there), so it is what a map can gain with no information at all.

The protocol's sweep measures every entry of `SWEEP` at every k: a name and a builder that makes
the condition at k from the fitted calibration maps. `register_sweep_condition` adds one (a new
calibration, a learned translator); the sweep, the results and the fast-path = hooks equivalence
test then include it with no other change.

On a dense model an iteration is a layer (the state after layer t is
``blocks.{t-1}.hook_resid_post``) and the readout is the final norm and unembedding. `replay`
still runs there, but a dense model repeating a layer's update is not the same model in another
configuration: `Condition.realizable` says so and reports label it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens.hook_points import HookPoint

from dcp_lens.protocol.maps import StateMap
from dcp_lens.utils.registry import add_entry

HookList = list[tuple[str, Callable[[Tensor, HookPoint], Tensor | None]]]
States = Float[Tensor, "r_plus_1 *batch d_model"]


@runtime_checkable
class IterationModel(Protocol):
    """What the conditions need of a model: the active depth and the iteration hook names."""

    @property
    def n_iterations(self) -> int: ...

    @property
    def is_dense(self) -> bool: ...

    @property
    def readout_hook_name(self) -> str: ...

    def state_hook_name(self, t: int) -> str: ...


@runtime_checkable
class ProtocolModel(IterationModel, Protocol):
    """What `DepthControlProtocol` needs besides: a readout of states and hooked forwards
    (`HookedRecurrentTransformer`, `dcp_lens.zoo.loaders.bridge.BridgeIterationModel`)."""

    def readout(self, state: Tensor) -> Tensor: ...

    def run_with_hooks(self, *model_args: Tensor, **kwargs: object) -> Tensor: ...

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...

    def eval(self) -> torch.nn.Module: ...

    def train(self, mode: bool = True) -> torch.nn.Module: ...


class Condition(ABC):
    """One condition of the protocol: its hooks, its closed form and its (B, D) coordinates."""

    name: str
    # Whether this condition at k = r must reproduce full depth (the null control checks it).
    reproduces_full_at_r: bool = True
    # Whether confidence matching fits this condition's readout a temperature: not for the upper
    # end's translators (fitted to each example's own full-depth state) nor the base rate (full
    # depth's own readouts).
    matches_confidence: bool = True

    @property
    @abstractmethod
    def label(self) -> str:
        """A readable name with its depth, e.g. ``"replay(1)"`` or ``"calibrate(truncate(2))"``."""

    @abstractmethod
    def coordinates(self, r: int) -> tuple[int, int]:
        """(B, D): block applications and distinct iterations on a model of depth r."""

    @abstractmethod
    def fwd_hooks(self, model: IterationModel) -> HookList:
        """The ``(hook_name, hook_fn)`` pairs that realise this condition on ``model``."""

    @abstractmethod
    def readout_input(self, states: States) -> Float[Tensor, "*batch d_model"]:
        """The stream that reaches the readout, from the states s_0..s_r of a full-depth pass
        (``states[t]`` is s_t; r = ``len(states) - 1``)."""

    def at_depth(self, r: int) -> Condition:
        """The simplest condition equal to this one at depth r (e.g. ``replay(r)`` is ``full``);
        the sweep reads out each distinct one once."""
        return self

    def realizable(self, model: IterationModel) -> bool:
        """False where the condition is not the model in another configuration."""
        return True

    def logits_from_full(
        self, full_logits: Float[Tensor, "batch pos d_vocab"]
    ) -> Float[Tensor, "batch pos d_vocab"] | None:
        """This condition's logits rearranged from full depth's of the same batch, where no
        readout is needed for them (`BaseRate`); None (the default): read them out."""
        return None

    def _key(self) -> tuple[object, ...]:
        """What makes two conditions the same: class and label (and map, where there is one)."""
        return type(self), self.label

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Condition) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.label})"


class Full(Condition):
    """The unmodified model at its full depth r (no hooks)."""

    name = "full"

    @property
    def label(self) -> str:
        return "full"

    def coordinates(self, r: int) -> tuple[int, int]:
        return r, r

    def fwd_hooks(self, model: IterationModel) -> HookList:
        return []

    def readout_input(self, states: States) -> Tensor:
        return states[-1]


class _AtDepth(Condition):
    """A condition with a depth k (1 <= k <= r)."""

    def __init__(self, k: int) -> None:
        self.k = _positive(k, self.name)

    @property
    def label(self) -> str:
        return f"{self.name}({self.k})"

    def _check(self, r: int) -> None:
        if not 1 <= self.k <= r:
            raise ValueError(
                f"{self.name}(k={self.k}) needs 1 <= k <= r = {r} (the model's active depth); "
                "use `with model.iterations(k):` to run beyond r."
            )


class Truncate(_AtDepth):
    """Read out after k iterations: the readout sees s_k (B = D = k).

    On a recurrent model this equals ``model.iterations(k)``; the hook form runs all r iterations
    and swaps the readout input, so it composes with other hooks at full depth."""

    name = "truncate"

    def coordinates(self, r: int) -> tuple[int, int]:
        return self.k, self.k

    def fwd_hooks(self, model: IterationModel) -> HookList:
        self._check(model.n_iterations)
        captured: dict[str, Tensor] = {}

        def keep(state: Tensor, hook: HookPoint) -> None:
            captured["state"] = state

        def swap(readout_input: Tensor, hook: HookPoint) -> Tensor:
            return captured.pop("state")

        return [(model.state_hook_name(self.k), keep), (model.readout_hook_name, swap)]

    def readout_input(self, states: States) -> Tensor:
        self._check(len(states) - 1)
        return states[self.k]

    def at_depth(self, r: int) -> Condition:
        return Full() if self.k == r else self


class Replay(_AtDepth):
    """k distinct iterations, then the k-th update repeated: s_t = s_{t-1} + Delta_k for t > k.

    The linchpin control: ``replay(1)`` spends the full budget of r block applications with a
    single distinct iteration (B = r, D = k)."""

    name = "replay"

    def coordinates(self, r: int) -> tuple[int, int]:
        return r, self.k

    def fwd_hooks(self, model: IterationModel) -> HookList:
        self._check(model.n_iterations)
        k, captured = self.k, {}

        def keep_previous(state: Tensor, hook: HookPoint) -> None:
            captured["previous"] = state

        def keep_update(state: Tensor, hook: HookPoint) -> None:
            captured["state"], captured["update"] = state, state - captured.pop("previous")

        def replayed(t: int) -> Callable[..., Tensor]:
            def hook(state: Tensor, hook: HookPoint) -> Tensor:
                return captured["state"] + (t - k) * captured["update"]

            return hook

        hooks: HookList = [
            (model.state_hook_name(k - 1), keep_previous),
            (model.state_hook_name(k), keep_update),
        ]
        r = model.n_iterations
        return hooks + [(model.state_hook_name(t), replayed(t)) for t in range(k + 1, r + 1)]

    def readout_input(self, states: States) -> Tensor:
        r = len(states) - 1
        self._check(r)
        return states[self.k] + (r - self.k) * (states[self.k] - states[self.k - 1])

    def at_depth(self, r: int) -> Condition:
        return Full() if self.k == r else self

    def realizable(self, model: IterationModel) -> bool:
        return not model.is_dense


class Calibrate(Condition):
    """``inner`` with its readout input mapped by ``state_map`` (fitted by the protocol on a
    calibration split from ``inner``'s readout inputs to full depth's). Same B and D as inner."""

    name = "calibrate"

    def __init__(self, inner: Condition, state_map: StateMap) -> None:
        if not isinstance(inner, Condition):
            raise TypeError(f"calibrate wraps a Condition, got {type(inner).__name__}.")
        if isinstance(inner, Calibrate | Shift):
            raise ValueError(f"calibrate({inner.label}) would map the readout twice.")
        self.inner, self.state_map = inner, _check_map(state_map)

    @property
    def label(self) -> str:
        return f"calibrate({self.inner.label})"

    def coordinates(self, r: int) -> tuple[int, int]:
        return self.inner.coordinates(r)

    def fwd_hooks(self, model: IterationModel) -> HookList:
        return self.inner.fwd_hooks(model) + [(model.readout_hook_name, _map_hook(self.state_map))]

    def readout_input(self, states: States) -> Tensor:
        return self.state_map(self.inner.readout_input(states))

    def at_depth(self, r: int) -> Condition:
        inner = self.inner.at_depth(r)
        return self if inner is self.inner else Calibrate(inner, self.state_map)

    def realizable(self, model: IterationModel) -> bool:
        return self.inner.realizable(model)

    def _key(self) -> tuple[object, ...]:
        return type(self), self.label, id(self.state_map)


class Translate(Condition):
    """``inner`` with its readout input moved by a paired translator (fitted by the protocol on
    the calibration split from ``inner``'s readout inputs to each example's own full-depth
    state, by least squares: `dcp_lens.protocol.fit.fit_translators`, an
    `dcp_lens.protocol.translator.AffineTranslator`). Same B and D as inner.

    Unlike `Calibrate`, the translator saw the answers' distribution per example: it may carry out
    remaining computation that is affine in the state, so its cell bounds S from above."""

    name = "translate"
    matches_confidence = False  # the upper end reads the translator as fitted, untempered

    def __init__(self, inner: Condition, translator: Callable[[Tensor], Tensor]) -> None:
        if not isinstance(inner, Condition):
            raise TypeError(f"translate wraps a Condition, got {type(inner).__name__}.")
        if isinstance(inner, Calibrate | Shift | Translate):
            raise ValueError(f"translate({inner.label}) would map the readout twice.")
        if not callable(translator):
            raise TypeError(f"a translator must be callable, got {type(translator).__name__}.")
        self.inner, self.translator = inner, translator

    @property
    def label(self) -> str:
        return f"translate({self.inner.label})"

    def coordinates(self, r: int) -> tuple[int, int]:
        return self.inner.coordinates(r)

    def fwd_hooks(self, model: IterationModel) -> HookList:
        def hook(readout_input: Tensor, hook: HookPoint) -> Tensor:
            return self.translator(readout_input)

        return self.inner.fwd_hooks(model) + [(model.readout_hook_name, hook)]

    def readout_input(self, states: States) -> Tensor:
        return self.translator(self.inner.readout_input(states))

    def at_depth(self, r: int) -> Condition:
        # Full depth's own readout is what the translator is fitted to: at r it is the identity.
        inner = self.inner.at_depth(r)
        if isinstance(inner, Full):
            return inner
        return self if inner is self.inner else Translate(inner, self.translator)

    def realizable(self, model: IterationModel) -> bool:
        return self.inner.realizable(model)

    def _key(self) -> tuple[object, ...]:
        return type(self), self.label, id(self.translator)


class BaseRate(Condition):
    """The readout that knows nothing about the example: at each position, the log of full
    depth's mean predicted distribution over the calibration split at that position (its bucket,
    `position_bucket`), the same for every example, scored against the example's own target.

    It is the best constant readout under a proper scoring rule (for accuracy, the most frequent
    full-depth answer at the position), so no map without information about the example reads
    out better on average: the base-rate control of the S bracket (docs/bracket.md). It has no
    readout input; `logits` gives its readout and its hook form replaces the logits.

    Args:
        log_probs: ``[n_buckets, d_vocab]`` log mean distribution per position bucket.
    """

    name = "base_rate"
    reproduces_full_at_r = False
    matches_confidence = False  # full depth's own (mean) distribution

    def __init__(self, log_probs: Float[Tensor, "n_buckets d_vocab"]) -> None:
        if not isinstance(log_probs, Tensor) or log_probs.ndim != 2:
            raise TypeError(
                "base_rate needs a [n_buckets, d_vocab] tensor of log-probabilities, got "
                f"{getattr(log_probs, 'shape', type(log_probs).__name__)}."
            )
        self.log_probs = log_probs

    @property
    def label(self) -> str:
        return "base_rate"

    def coordinates(self, r: int) -> tuple[int, int]:
        return r, r

    def logits(self, positions: int, batch: int, device: torch.device) -> Tensor:
        """``[batch, positions, d_vocab]``: the table's row of each position's bucket."""
        buckets = position_bucket(torch.arange(positions)).clamp(max=len(self.log_probs) - 1)
        rows = self.log_probs.to(device)[buckets.to(device)]
        return rows[None].expand(batch, -1, -1)

    def fwd_hooks(self, model: IterationModel) -> HookList:
        if not self.realizable(model):
            raise ValueError(
                f"{type(model).__name__} has no hook_logits (its logits may be transformed after"
                " the unembedding), so base_rate has no hook form there; read it with"
                " BaseRate.logits(positions, batch, device) or protocol.condition_logits(...)."
            )

        def hook(logits: Tensor, hook: HookPoint) -> Tensor:
            table = self.logits(logits.shape[1], logits.shape[0], logits.device)
            return table.to(logits.dtype)

        return [("hook_logits", hook)]

    def realizable(self, model: IterationModel) -> bool:
        """Its hook form replaces the model's final logits: only where ``hook_logits`` is."""
        return "hook_logits" in getattr(model, "hook_dict", {})

    def readout_input(self, states: States) -> Tensor:
        raise TypeError(
            "base_rate has no readout input: it is a distribution per position, not a state;"
            " use BaseRate.logits(positions, batch, device) for its readout."
        )

    def _key(self) -> tuple[object, ...]:
        return type(self), self.label, id(self.log_probs)

    def logits_from_full(self, full_logits: Tensor) -> Tensor:
        # No readout: the table's rows, one per position, the same for every example.
        batch, positions = full_logits.shape[:2]
        if full_logits.device.type == "meta":
            return full_logits
        return self.logits(positions, batch, full_logits.device).to(full_logits.dtype)


# Positions below this are their own bucket; later ones share buckets 4 per doubling.
EXACT_POSITIONS = 16


def position_bucket(positions: Int[Tensor, "*shape"]) -> Int[Tensor, "*shape"]:
    """The base rate's bucket of each position: itself below `EXACT_POSITIONS`, then four
    buckets per doubling (long contexts pool their late positions, whose distributions differ
    little, so the table stays small)."""
    positions = positions.to(torch.int64)
    late = positions.clamp(min=EXACT_POSITIONS).double()
    bucket = EXACT_POSITIONS + torch.floor(4 * torch.log2(late / EXACT_POSITIONS)).to(torch.int64)
    return torch.where(positions < EXACT_POSITIONS, positions, bucket)


class Shift(_AtDepth):
    """Full depth with the readout input mapped by the *inverse* of calibrate(truncate(k)):
    full information in a truncated-looking frame (the positive control for S)."""

    name = "shift"

    def __init__(self, k: int, truncate_calibration: StateMap) -> None:
        super().__init__(k)
        self.state_map = _check_map(truncate_calibration)

    def coordinates(self, r: int) -> tuple[int, int]:
        return r, r

    def fwd_hooks(self, model: IterationModel) -> HookList:
        self._check(model.n_iterations)
        return [(model.readout_hook_name, _map_hook(self.state_map.inverse()))]

    def readout_input(self, states: States) -> Tensor:
        self._check(len(states) - 1)
        return self.state_map.inverse()(states[-1])

    def _key(self) -> tuple[object, ...]:
        return type(self), self.label, id(self.state_map)


# --------------------------------------------------------------------- the public factories


def full() -> Full:
    """The unmodified model at its full depth r (no hooks)."""
    return Full()


def truncate(k: int) -> Truncate:
    """Read out after k iterations (B = D = k); see `Truncate`."""
    return Truncate(k)


def replay(k: int) -> Replay:
    """k distinct iterations, then the k-th update repeated (B = r, D = k); see `Replay`."""
    return Replay(k)


def calibrate(condition: Condition, state_map: StateMap) -> Calibrate:
    """``condition`` with its readout input mapped by ``state_map`` (e.g. from
    `dcp_lens.protocol.calibration.fit_calibration(condition_states, full_states)`); see
    `Calibrate`."""
    return Calibrate(condition, state_map)


def translate(condition: Condition, translator: Callable[[Tensor], Tensor]) -> Translate:
    """``condition`` with its readout input moved by a paired ``translator`` (e.g. an
    `dcp_lens.protocol.translator.AffineTranslator`); see `Translate`."""
    return Translate(condition, translator)


def base_rate(log_probs: Tensor) -> BaseRate:
    """The no-information readout: ``log_probs`` ``[n_buckets, d_vocab]`` per position bucket
    (the protocol fits it as full depth's mean distribution on the calibration split); see
    `BaseRate`."""
    return BaseRate(log_probs)


def shift(k: int, truncate_calibration: StateMap) -> Shift:
    """Full depth, readout input mapped by the inverse of calibrate(truncate(k)); see `Shift`."""
    return Shift(k, truncate_calibration)


# ------------------------------------------------------------------------------- the sweep


@runtime_checkable
class MapLookup(Protocol):
    """A builder's second argument (`dcp_lens.protocol.fit.FittedMaps`): called with a source
    condition, the map fitted from its readout inputs (on the calibration split) to full depth's;
    ``translator(source)``, the paired translator fitted from them to each example's full-depth
    readout. Either is None where that source's states were non-finite."""

    def __call__(self, source: Condition) -> StateMap | None: ...

    def translator(self, source: Condition) -> Callable[[Tensor], Tensor] | None: ...

    @property
    def base_rate(self) -> Tensor | None:
        """``[n_buckets, d_vocab]`` log mean full-depth distribution per position bucket."""


@dataclass(frozen=True)
class SweepCondition:
    """An entry of the protocol's sweep: ``build(k, fitted)`` makes the condition at k, or
    returns None where a map it needs could not be fitted (the cell is reported non-finite)."""

    name: str
    build: Callable[[int, MapLookup], Condition | None]


def _calibrated(inner: Callable[[int], Condition]) -> Callable[[int, MapLookup], Condition | None]:
    def build(k: int, fitted: MapLookup) -> Condition | None:
        state_map = fitted(inner(k))
        return None if state_map is None else Calibrate(inner(k), state_map)

    return build


def _translated(
    inner: Callable[[int], Condition],
) -> Callable[[int, MapLookup], Condition | None]:
    def build(k: int, fitted: MapLookup) -> Condition | None:
        translator = fitted.translator(inner(k))
        return None if translator is None else Translate(inner(k), translator)

    return build


def _shift(k: int, fitted: MapLookup) -> Condition | None:
    state_map = fitted(Truncate(k))
    return None if state_map is None else Shift(k, state_map)


def _base_rate(k: int, fitted: MapLookup) -> Condition | None:
    table = fitted.base_rate
    return None if table is None else BaseRate(table)


# The five conditions of the decomposition, in the column order used by results and tables.
DECOMPOSED = ("truncate", "calibrate_truncate", "replay", "calibrate_replay", "shift")
# The controls the sweep reads on a fixed subsample of the evaluation examples
# (`dcp_lens.protocol.sweep.control_examples`), each with the condition read on every example
# that its cells are compared with on that subsample (docs/bracket.md, "Controls read on a
# subsample").
SUBSAMPLED_CONTROLS = {
    "shift": "full",
    "translate_truncate": "calibrate_truncate",
    "translate_replay": "calibrate_replay",
}

SWEEP: dict[str, SweepCondition] = {}


def register_sweep_condition(entry: SweepCondition) -> SweepCondition:
    """Add a condition to the protocol's sweep (measured at every k, reported as a curve).

    Raises:
        ValueError: the name is taken; the message names the existing entry.
    """
    if entry.name == "full":
        raise ValueError("'full' is the reference of every sweep condition; pick another name.")
    return add_entry(SWEEP, entry.name, entry, "sweep condition")


def unregister_sweep_condition(name: str) -> None:
    """Remove a condition added with `register_sweep_condition` (not one of `DECOMPOSED`)."""
    if name in DECOMPOSED:
        raise ValueError(f"{name!r} is one of the decomposition's conditions; it stays.")
    if name not in SWEEP:
        raise KeyError(f"no sweep condition named {name!r}; registered: {sorted(SWEEP)}.")
    del SWEEP[name]


for _entry in (
    SweepCondition("truncate", lambda k, fitted: Truncate(k)),
    SweepCondition("calibrate_truncate", _calibrated(Truncate)),
    SweepCondition("replay", lambda k, fitted: Replay(k)),
    SweepCondition("calibrate_replay", _calibrated(Replay)),
    SweepCondition("shift", _shift),
    SweepCondition("translate_truncate", _translated(Truncate)),
    SweepCondition("translate_replay", _translated(Replay)),
    SweepCondition("base_rate", _base_rate),
):
    register_sweep_condition(_entry)


def _map_hook(state_map: StateMap) -> Callable[..., Tensor]:
    def hook(readout_input: Tensor, hook: HookPoint) -> Tensor:
        return state_map(readout_input)

    return hook


def _positive(k: object, name: str) -> int:
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"{name}(k) needs an int number of iterations, got {k!r}.")
    if k < 1:
        raise ValueError(f"{name}(k={k}): k must be >= 1.")
    return k


def _check_map(state_map: object) -> StateMap:
    if not callable(state_map) or not hasattr(state_map, "inverse"):
        raise TypeError(
            "a state map must be callable with an .inverse() method (an AffineCalibration), "
            f"got {type(state_map).__name__}."
        )
    return state_map  # type: ignore[return-value]
