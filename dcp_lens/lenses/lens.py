"""Per-iteration lenses: the model's own readout applied to the state after every iteration.

The lens at iteration t reads ``model.readout(s_t)``: ``hook_readout_in``, the pre-coda norm, the
coda blocks, ``ln_final`` and the unembedding, exactly what the model applies to s_r. So the lens at
t = r is the model's logits and at t = k it is the truncated model's (``truncate(k)``).
TransformerLens's ``cache.accumulated_resid(apply_ln=True)`` applies only ``ln_final`` to each
block's input, skipping the pre-coda norm and the coda: on a model with either, it is not the
logits the truncated model produces.

- `iteration_states`: s_t for every t, from tokens (one forward pass) or from an `ActivationCache`.
- `logit_lens`: the readout of every s_t; with ``calibration`` the *calibrated lens*, each s_t first
  moved by a fitted map (`fit_lens_calibrations`, or the protocol's maps, `protocol_calibrations`).
- `prediction_trajectory`: rank and probability of a target token at every iteration, with Ouro's
  exit probabilities beside them when the model has an exit gate.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens.ActivationCache import ActivationCache

from dcp_lens.model.names import DepthMismatchError
from dcp_lens.protocol.calibration import AffineCalibration, StreamingMoments
from dcp_lens.protocol.conditions import ProtocolModel, StateMap, truncate
from dcp_lens.protocol.dcp import DepthControlProtocol
from dcp_lens.protocol.metrics import IGNORE_INDEX
from dcp_lens.protocol.states import capture_states

# A map applied to s_t before the readout (an `AffineCalibration`, or any callable on states).
StateCalibration = Callable[[Tensor], Tensor]
# Where states come from: tokens [batch, pos] (one forward pass) or a recorded cache.
LensSource = Int[Tensor, "batch pos"] | ActivationCache | Mapping[str, Tensor]


def iteration_states(
    model: ProtocolModel,
    source: LensSource,
    iterations: Sequence[int] | None = None,
) -> Float[Tensor, "iteration batch pos d_model"]:
    """The states s_t for t in ``iterations`` (default 0..r of the active view), stacked.

    Args:
        model: a `HookedRecurrentTransformer` (dense models too: s_t is layer t's output).
        source: tokens [batch, pos] (one forward pass), or an `ActivationCache` (or any mapping
            of hook names to tensors) recorded in the model's active view.
        iterations: the t to read, in order.
    """
    wanted = list(range(model.n_iterations + 1)) if iterations is None else list(iterations)
    if not wanted:
        raise ValueError("iterations is empty; name at least one iteration t.")
    if isinstance(source, Tensor):
        states, _ = capture_states(model, source, wanted, return_type=None)
        return states
    names = [model.state_hook_name(t) for t in wanted]
    missing = [name for name in names if name not in source.keys()]
    recorded = getattr(source, "recorded_iterations", None)
    if missing and recorded is not None and recorded != model.n_iterations:
        raise DepthMismatchError(
            f"the cache was recorded at k = {recorded} iterations but the model now runs k = "
            f"{model.n_iterations}, so it holds no {missing}; read it inside `with "
            f"model.iterations({recorded}):`, or record it again in this view."
        )
    if missing:
        raise KeyError(
            f"the cache holds no {missing}; record it with model.run_with_cache(tokens) in the "
            "same view (a cache of n_iterations=k is read inside `with model.iterations(k):`)."
        )
    return torch.stack([source[name] for name in names])


def logit_lens(
    model: ProtocolModel,
    source: LensSource,
    iterations: Sequence[int] | None = None,
    calibration: Mapping[int, StateCalibration | None] | None = None,
) -> Float[Tensor, "iteration batch pos d_vocab"]:
    """``model.readout(s_t)`` for every t: the logits the model would give reading out s_t.

    Indexed by iteration, as every lens here is by default: entry t reads s_t, t = 0..r, with or
    without ``calibration``, so ``lens[t]`` and ``calibrated[t]`` are the same iteration.

    Args:
        model, source: as `iteration_states`.
        iterations: the t to read, in order (entry i is then iteration ``iterations[i]``);
            default 0..r.
        calibration: the calibrated lens: ``calibration[t]`` is applied to s_t first (from
            `fit_lens_calibrations` or `protocol_calibrations`, which fit t = 1..r). By default
            an iteration without a map (t = 0) is a row of NaN: there is no calibrated reading
            of it; a t named in ``iterations`` must have one.

    Returns:
        Logits ``[len(iterations), batch, pos, d_vocab]``: ``[r + 1, ...]`` by default.
    """
    default = iterations is None
    wanted = list(range(model.n_iterations + 1)) if iterations is None else list(iterations)
    if calibration is not None and not calibration:
        raise ValueError("calibration is empty; fit it with fit_lens_calibrations(model, tokens).")
    states = iteration_states(model, source, wanted)
    rows: list[Tensor | None] = []
    for t, state in zip(wanted, states, strict=True):
        if calibration is not None and default and t not in calibration:
            rows.append(None)  # no map at this t: no calibrated reading
            continue
        mapping = _calibration_at(calibration, t)
        rows.append(model.readout(state if mapping is None else mapping(state)))
    return by_iteration(rows)


def by_iteration(rows: Sequence[Tensor | None]) -> Tensor:
    """A lens's rows stacked ``[iteration, ...]``, a row the lens has no reading for (None) as
    NaN of the others' shape."""
    template = next((row for row in rows if row is not None), None)
    if template is None:
        raise ValueError("the lens has no reading at any iteration asked for; fit it first.")
    return torch.stack(
        [torch.full_like(template, float("nan")) if row is None else row for row in rows]
    )


def fit_lens_calibrations(
    model: ProtocolModel,
    tokens: Int[Tensor, "n pos"],
    iterations: Sequence[int] | None = None,
    mode: str = "full",
    *,
    skip_first_position: bool = False,
    batch_size: int = 32,
) -> dict[int, AffineCalibration]:
    """Fit, for each t, the affine map moving s_t's moments onto s_r's (the calibrated lens).

    The maps are the protocol's ``calibrate(truncate(t))`` (`dcp_lens.protocol.calibration`),
    fitted on
    ``tokens``: use a split disjoint from the one the lens is read on.

    Args:
        tokens: the calibration split, read in batches of ``batch_size`` sequences.
        iterations: the t to fit (default 1..r).
        mode: ``"mean"``, ``"diag"`` or ``"full"``.
        skip_first_position: leave position 0 out of the statistics (attention sinks).

    Returns:
        ``{t: AffineCalibration}``.
    """
    r = model.n_iterations
    wanted = list(range(1, r + 1)) if iterations is None else list(iterations)
    if not wanted:
        raise ValueError("iterations is empty; name at least one iteration t.")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1.")
    reference = StreamingMoments()
    sources = {t: StreamingMoments() for t in wanted}
    with torch.no_grad():
        for start in range(0, tokens.shape[0], batch_size):
            batch = tokens[start : start + batch_size]
            states, _ = capture_states(model, batch, [*wanted, r], return_type=None)
            if skip_first_position:
                states = states[:, :, 1:]
            reference.update(states[-1])
            for i, t in enumerate(wanted):
                sources[t].update(states[i])
    return {t: AffineCalibration.fit(moments, reference, mode) for t, moments in sources.items()}


def protocol_calibrations(
    protocol: DepthControlProtocol, iterations: Sequence[int] | None = None
) -> dict[int, StateMap | None]:
    """The maps a fitted `DepthControlProtocol` uses for ``calibrate(truncate(t))``, per t.

    ``protocol.fit(calibration)`` (or ``run``) must have been called; t defaults to 1..r. A t
    whose states were non-finite on the calibration split maps to None."""
    wanted = list(range(1, protocol.r + 1)) if iterations is None else list(iterations)
    return {t: protocol.fitted(truncate(t)) for t in wanted}


@dataclass
class PredictionTrajectory:
    """Where a prediction forms: the target token's rank and probability at every iteration.

    Attributes:
        iterations: the t of each row.
        target: the token tracked at each position, [batch, pos].
        probability: softmax probability of the target under the lens, [iteration, batch, pos].
        rank: the target's rank among all tokens (0 = top), [iteration, batch, pos].
        top_token: the lens's top token, [iteration, batch, pos].
        exit_probability: for a model with Ouro's exit gate, the probability of exiting at
            step t, [iteration, batch, pos] (NaN at t = 0, where no step has run); else None.
    """

    iterations: list[int]
    target: Int[Tensor, "batch pos"]
    probability: Float[Tensor, "iteration batch pos"]
    rank: Int[Tensor, "iteration batch pos"]
    top_token: Int[Tensor, "iteration batch pos"]
    exit_probability: Float[Tensor, "iteration batch pos"] | None = None

    def table(self, example: int = 0, position: int = -1) -> pd.DataFrame:
        """One position's trajectory: a row per iteration (iteration, target, rank,
        probability, top_token and, for Ouro, exit_probability)."""
        columns: dict[str, object] = {
            "iteration": self.iterations,
            "target": int(self.target[example, position]),
            "rank": self.rank[:, example, position].tolist(),
            "probability": self.probability[:, example, position].tolist(),
            "top_token": self.top_token[:, example, position].tolist(),
        }
        if self.exit_probability is not None:
            columns["exit_probability"] = self.exit_probability[:, example, position].tolist()
        return pd.DataFrame(columns)


def prediction_trajectory(
    model: ProtocolModel,
    source: LensSource,
    targets: Int[Tensor, "batch pos"] | None = None,
    iterations: Sequence[int] | None = None,
    calibration: Mapping[int, StateCalibration | None] | None = None,
) -> PredictionTrajectory:
    """Rank and probability of ``targets`` under the (calibrated) lens at every iteration.

    Args:
        model, source, iterations, calibration: as `logit_lens`.
        targets: the token to track at each position [batch, pos], -100 where nothing is
            scored (probability NaN and rank -1 there) (e.g. the next token,
            ``tokens[:, 1:]`` against the lens at ``[:, :-1]``, or a task's answer); default: the
            model's own full-depth prediction, so the trajectory shows when it forms.

    Returns:
        A `PredictionTrajectory`; ``exit_probability`` is filled when the model has an
        ``exit_gate`` (Ouro), computed from the same states.
    """
    if iterations is None and calibration is not None:
        iterations = sorted(calibration)
    r = model.n_iterations
    wanted = list(range(r + 1)) if iterations is None else list(iterations)
    lens = logit_lens(model, source, wanted, calibration)
    if targets is None:
        final = iteration_states(model, source, [r])[0]
        targets = model.readout(final).argmax(-1)
    if targets.shape != lens.shape[1:3]:
        raise ValueError(
            f"targets must be [batch, pos] = {tuple(lens.shape[1:3])}, got {tuple(targets.shape)}."
        )
    targets = targets.to(lens.device)
    scored = targets != IGNORE_INDEX  # a task's -100 marks positions it does not score
    lens = lens.detach()  # a record of where the prediction forms, not a graph
    log_probs = lens.float().log_softmax(-1)
    index = targets.where(scored, 0).expand(len(wanted), *targets.shape)[..., None]
    target_log_prob = log_probs.gather(-1, index)
    rank = (log_probs > target_log_prob).sum(-1).masked_fill(~scored, -1)
    probability = target_log_prob[..., 0].exp().masked_fill(~scored, float("nan"))
    return PredictionTrajectory(
        iterations=wanted,
        target=targets,
        probability=probability,
        rank=rank,
        top_token=lens.argmax(-1),
        exit_probability=_exit_probability(model, source, wanted),
    )


def _exit_probability(model: ProtocolModel, source: LensSource, wanted: list[int]) -> Tensor | None:
    """Ouro's exit distribution over steps 1..r, aligned with ``wanted`` (NaN at t = 0)."""
    exit_gate = getattr(model, "exit_gate", None)
    if exit_gate is None:
        return None
    from dcp_lens.model.components.exit_gate import exit_distribution

    steps = iteration_states(model, source, range(1, model.n_iterations + 1))
    with torch.no_grad():
        pdf = exit_distribution(exit_gate(steps).movedim(0, -1)).movedim(-1, 0)
    nan = torch.full_like(pdf[0], float("nan"))
    return torch.stack([nan if t == 0 else pdf[t - 1] for t in wanted])


def _calibration_at(
    calibration: Mapping[int, StateCalibration | None] | None, t: int
) -> StateCalibration | None:
    if calibration is None:
        return None
    if t not in calibration:
        raise KeyError(f"no calibration for iteration {t}; calibrated: {sorted(calibration)}.")
    mapping = calibration[t]
    if mapping is None:
        raise ValueError(
            f"the calibration of iteration {t} could not be fitted (its states were non-finite "
            "on the calibration split); leave t out of iterations."
        )
    return mapping
