"""Training regimes: the one knob the controlled training intervention (docs/design.md §6) varies.

Every regime trains the same task with the same optimiser; they differ only in how the loss is
taken from the model:

- ``fixed``: r iterations, the loss at the final readout.
- ``sampled`` (Huginn): r drawn per step, either Poisson-log-normal with a given mean
  (tau ~ N(log(mean) - sigma^2 / 2, sigma), r ~ Poisson(exp(tau)) + 1) or uniform on
  1..r_max, clipped to 1..r_max; gradients flow through the last ``n_grad`` iterations only
  (the state before them is detached; e is still injected with gradient).
- ``every-iteration`` (Ouro): the loss averaged over the readouts of s_1 .. s_r.
- ``dense``: a dense model (``n_core = 0``) of distinct blocks, as many as the recurrent model
  applies (``n_prelude + r * n_core + n_coda``), same width, plain loss.

The loss is the cross-entropy at scored positions (targets are ``IGNORE_INDEX`` elsewhere).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens.hook_points import HookPoint

from dcp_lens.model.config import RecurrentConfig
from dcp_lens.model.hooked_recurrent_transformer import HookedRecurrentTransformer
from dcp_lens.model.loss import scored_cross_entropy
from dcp_lens.protocol.states import capture_states
from dcp_lens.utils.checks import check_field_types
from dcp_lens.utils.errors import ConfigError

REGIMES = ("fixed", "sampled", "every-iteration", "dense")
SAMPLINGS = ("poisson_lognormal", "uniform")


@dataclass
class RegimeConfig:
    """Which regime, and the parameters of ``sampled`` (ignored by the others).

    Args:
        name: one of `REGIMES`.
        sampling: ``"poisson_lognormal"`` (Huginn) or ``"uniform"`` on 1..max_iterations.
        mean_iterations: the mean of exp(tau), Huginn's ``mean_recurrence`` (so the mean of r
            is about ``mean_iterations + 1`` before clipping). None: the model's r.
        sigma: the standard deviation of tau (Huginn: 0.5).
        max_iterations: r is clipped to 1..max_iterations. None: twice the model's r.
        n_grad: iterations that receive gradient (the last ones). None: max(1, r // 2).
    """

    name: str = "fixed"
    sampling: str = "poisson_lognormal"
    mean_iterations: float | None = None
    sigma: float = 0.5
    max_iterations: int | None = None
    n_grad: int | None = None

    def __post_init__(self) -> None:
        check_field_types(RegimeConfig, dataclasses.asdict(self), "RegimeConfig")
        if self.name not in REGIMES:
            raise ValueError(f"regime name={self.name!r} is not one of {REGIMES}.")
        if self.sampling not in SAMPLINGS:
            raise ValueError(f"sampling={self.sampling!r} is not one of {SAMPLINGS}.")
        if self.mean_iterations is not None and not (
            math.isfinite(self.mean_iterations) and self.mean_iterations > 0
        ):
            raise ValueError(f"mean_iterations={self.mean_iterations} must be positive and finite.")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"sigma={self.sigma} must be a finite number >= 0.")
        for name in ("max_iterations", "n_grad"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1 (or None for the default).")

    def resolved(self, n_iterations: int) -> RegimeConfig:
        """A copy with every None default filled in for a model of r = ``n_iterations``; the
        fields of ``sampled`` are set only for that regime (None for the others)."""
        if self.name != "sampled":
            return dataclasses.replace(self, mean_iterations=None, max_iterations=None, n_grad=None)
        return dataclasses.replace(
            self,
            mean_iterations=float(n_iterations)
            if self.mean_iterations is None
            else self.mean_iterations,
            max_iterations=2 * n_iterations if self.max_iterations is None else self.max_iterations,
            n_grad=max(1, n_iterations // 2) if self.n_grad is None else self.n_grad,
        )

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RegimeConfig:
        check_field_types(cls, data, "RegimeConfig")
        check_known_keys(cls, data)
        values = dict(data)
        for name in ("mean_iterations", "sigma"):
            if values.get(name) is not None:
                values[name] = float(values[name])
        return cls(**values)


def check_known_keys(cls: type, data: Mapping[str, object]) -> None:
    """Raise ValueError when ``data`` has keys that are not fields of dataclass ``cls``."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} keys {unknown}; known keys: {sorted(known)}.")


def dense_config(cfg: RecurrentConfig) -> RecurrentConfig:
    """The matched dense model of a recurrent config: ``n_prelude + r * n_core + n_coda``
    distinct blocks (no loop, no coda: the readout is the final norm and unembedding), the
    same width, heads, MLP and norms."""
    if cfg.is_dense:
        raise ValueError("dense_config needs a recurrent config (n_core > 0) to match.")
    fields = cfg.to_dict()
    fields.update(
        n_prelude=cfg.layers_for(cfg.n_iterations),
        n_core=0,
        n_coda=0,
        n_iterations=0,
        injection="none",
        iteration_norm="none",
    )
    return RecurrentConfig.from_dict(fields)


def build_regime_model(cfg: RecurrentConfig, regime: RegimeConfig) -> HookedRecurrentTransformer:
    """The model a regime trains: ``cfg`` itself, or its matched dense model for ``dense``."""
    return HookedRecurrentTransformer(dense_config(cfg) if regime.name == "dense" else cfg)


def sample_iterations(regime: RegimeConfig, generator: torch.Generator) -> int:
    """One draw of r for the ``sampled`` regime (needs `RegimeConfig.resolved` fields)."""
    if regime.max_iterations is None or regime.mean_iterations is None:
        raise ValueError("sample_iterations needs a resolved RegimeConfig (call .resolved(r)).")
    if regime.sampling == "uniform":
        draw = int(torch.randint(1, regime.max_iterations + 1, (), generator=generator))
    else:
        mu = math.log(regime.mean_iterations) - regime.sigma**2 / 2
        tau = mu + regime.sigma * torch.randn((), generator=generator, dtype=torch.float64)
        draw = int(torch.poisson(tau.exp().reshape(1), generator=generator)) + 1
    return min(max(draw, 1), regime.max_iterations)


def readout_logits(
    model: HookedRecurrentTransformer,
    tokens: Int[Tensor, "batch pos"],
    iterations: Sequence[int],
) -> Float[Tensor, "k batch pos d_vocab"]:
    """The logits read out from the state after each t in ``iterations`` (``truncate(t)`` of
    the same model), from one forward pass: ``[len(iterations), batch, pos, d_vocab]``.

    On a recurrent model t may exceed the active view (extrapolation); on a dense model t is
    a layer count, 1..n_layers. Gradients flow when called outside ``torch.no_grad``."""
    if not iterations:
        raise ValueError("iterations must name at least one iteration count.")
    deepest = max(iterations)
    view = contextlib.nullcontext() if model.is_dense else model.iterations(deepest)
    with view:
        stop = deepest if model.is_dense else model.cfg.layers_for(deepest) - model.cfg.n_coda
        states, _ = capture_states(model, tokens, iterations, return_type=None, stop_at_layer=stop)
    logits = model.readout(states.flatten(0, 1))
    return logits.unflatten(0, (len(iterations), tokens.shape[0]))


def fixed_loss(
    model: HookedRecurrentTransformer,
    tokens: Int[Tensor, "batch pos"],
    targets: Int[Tensor, "batch pos"],
    n_iterations: int | None = None,
) -> Float[Tensor, ""]:
    """The loss at the final readout after ``n_iterations`` (default: the active view)."""
    kwargs = {} if model.is_dense or n_iterations is None else {"n_iterations": n_iterations}
    return scored_cross_entropy(model(tokens, **kwargs), targets)


def truncated_backprop_loss(
    model: HookedRecurrentTransformer,
    tokens: Int[Tensor, "batch pos"],
    targets: Int[Tensor, "batch pos"],
    n_iterations: int,
    n_grad: int,
) -> Float[Tensor, ""]:
    """The final-readout loss after ``n_iterations``, with gradient through the last ``n_grad``
    iterations only: s_{r - n_grad} is detached (e is still injected with gradient)."""
    if n_iterations <= n_grad:
        return fixed_loss(model, tokens, targets, n_iterations)
    with model.iterations(n_iterations):
        cut = model.state_hook_name(n_iterations - n_grad)

        def detach(state: Tensor, hook: HookPoint) -> Tensor:
            return state.detach()

        logits = model.run_with_hooks(tokens, fwd_hooks=[(cut, detach)])
    return scored_cross_entropy(logits, targets)


def every_iteration_loss(
    model: HookedRecurrentTransformer,
    tokens: Int[Tensor, "batch pos"],
    targets: Int[Tensor, "batch pos"],
    n_iterations: int,
) -> Float[Tensor, ""]:
    """The mean over t = 1..n_iterations of the loss at the readout of s_t."""
    logits = readout_logits(model, tokens, range(1, n_iterations + 1))
    losses = torch.stack([scored_cross_entropy(each, targets) for each in logits])
    return losses.mean()


def regime_loss(
    model: HookedRecurrentTransformer,
    regime: RegimeConfig,
    tokens: Int[Tensor, "batch pos"],
    targets: Int[Tensor, "batch pos"],
    generator: torch.Generator,
) -> tuple[Float[Tensor, ""], int]:
    """One training step's loss under ``regime`` (resolved), and the iterations it ran (the
    number of layers for ``dense``). ``generator`` draws r for ``sampled`` only."""
    if regime.name == "dense":
        if not model.is_dense:
            raise ValueError(
                "the dense regime trains a dense model; build it with build_regime_model."
            )
        return fixed_loss(model, tokens, targets), model.cfg.n_layers
    if model.is_dense:
        raise ValueError(f"the {regime.name!r} regime needs a recurrent model (n_core > 0).")
    r = model.cfg.n_iterations
    if regime.name == "fixed":
        return fixed_loss(model, tokens, targets, r), r
    if regime.name == "every-iteration":
        return every_iteration_loss(model, tokens, targets, r), r
    assert regime.n_grad is not None, "resolve the regime first"
    r = sample_iterations(regime, generator)
    return truncated_backprop_loss(model, tokens, targets, r, regime.n_grad), r
