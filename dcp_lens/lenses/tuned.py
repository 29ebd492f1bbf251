"""Two lenses TransformerLens refuses on looped models, one per iteration of the loop.

- `TunedLens`: an `AffineTranslator` per iteration t < r, fitted on a calibration split so the
  model's own readout of the moved state matches the full-depth output (KL), as tuned-lens does
  per layer. t = r keeps the identity (the model's own readout), as tuned-lens leaves its last
  layer. Saved and loaded as one safetensors file.
- `JacobianLens`: per iteration t, the matrix J_t = E[ sum_{t' >= p} d h_final[t'] / d s_t[p] ]
  averaged over source positions p and prompts, where h_final is the stream entering
  ``ln_final``, after the method of TransformerLens 4.3's ``tools/analysis/jacobian_lens.py``
  (which refuses a block that fires more than once per forward; here each iteration's state is
  its own hook point). The lens reads ``ln_final(J_t s_t) @ W_U``; on a model whose readout is
  the final norm alone, J_r is the identity and the lens at r is the logit lens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens.hook_points import HookPoint

from dcp_lens.lenses.lens import LensSource, by_iteration, iteration_states
from dcp_lens.model.hooked_recurrent_transformer import HookedRecurrentTransformer
from dcp_lens.protocol.conditions import HookList
from dcp_lens.protocol.states import capture_states
from dcp_lens.protocol.translator import AffineTranslator, TranslatorError
from dcp_lens.utils.errors import DCPLensError


class LensError(DCPLensError):
    """A lens asked for an iteration it was not fitted for, or given a file it cannot read."""


class TunedLens:
    """Per-iteration affine translators read out by the model's own readout.

    Attributes:
        translators: ``{t: AffineTranslator}`` for t in 0..r (identity at t = r).
        n_iterations: r, the depth the lens was fitted at.
    """

    def __init__(self, translators: dict[int, AffineTranslator], n_iterations: int):
        self.translators = dict(translators)
        self.n_iterations = n_iterations

    @classmethod
    def fit(
        cls,
        model: HookedRecurrentTransformer,
        tokens: Int[Tensor, "n pos"],
        iterations: Sequence[int] | None = None,
        *,
        steps: int = 200,
        lr: float = 1e-2,
        skip_first_position: bool = False,
    ) -> TunedLens:
        """Fit a translator for each t (default 0..r-1) on ``tokens``, a calibration split
        disjoint from the one the lens is read on; t = r is the identity."""
        r = model.n_iterations
        wanted = list(range(r)) if iterations is None else [t for t in iterations if t != r]
        with torch.no_grad():
            states, _ = capture_states(model, tokens, [*wanted, r], return_type=None)
            target = model.readout(states[-1])
        mask = torch.ones(tokens.shape, dtype=torch.bool)
        if skip_first_position:
            mask[:, 0] = False
        translators = {r: AffineTranslator(model.cfg.d_model)}
        for i, t in enumerate(wanted):
            translator = AffineTranslator(model.cfg.d_model)
            translator.fit(states[i], target, model.readout, steps=steps, lr=lr, mask=mask)
            translators[t] = translator
        return cls(translators, r)

    def translator(self, t: int) -> AffineTranslator:
        if t not in self.translators:
            raise LensError(
                f"the tuned lens has no translator for iteration {t}; fitted: "
                f"{sorted(self.translators)} (TunedLens.fit(model, tokens, iterations=...))."
            )
        return self.translators[t]

    def logits(
        self,
        model: HookedRecurrentTransformer,
        source: LensSource,
        iterations: Sequence[int] | None = None,
    ) -> Float[Tensor, "iteration batch pos d_vocab"]:
        """``model.readout(translator_t(s_t))`` for each t, indexed by iteration as every lens
        (`dcp_lens.lenses.lens.logit_lens`): by default entry t is iteration t, t = 0..r of the
        model's active view, with t = r the model itself (its translator is the identity) and
        NaN rows where no translator was fitted; a t named in ``iterations`` must have one."""
        default = iterations is None
        wanted = list(range(model.n_iterations + 1)) if iterations is None else list(iterations)
        states = iteration_states(model, source, wanted)
        rows: list[Tensor | None] = []
        for t, state in zip(wanted, states, strict=True):
            if t not in self.translators and t == model.n_iterations:
                rows.append(model.readout(state))  # the identity at full depth
            elif default and t not in self.translators:
                rows.append(None)
            else:
                rows.append(model.readout(self.translator(t)(state)))  # type: ignore[operator]
        return by_iteration(rows)

    def save(self, path: str | Path) -> Path:
        """One safetensors file: ``t{t}.weight`` / ``t{t}.bias`` per iteration."""
        from safetensors.torch import save_file

        tensors: dict[str, Tensor] = {}
        for t, translator in self.translators.items():
            tensors.update(translator.state_dict(prefix=f"t{t}."))
        metadata = {"format": "dcp-lens-tuned-lens", "n_iterations": str(self.n_iterations)}
        save_file(tensors, str(path), metadata=metadata)
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> TunedLens:
        from safetensors import safe_open
        from safetensors.torch import load_file

        if not Path(path).is_file():
            raise LensError(f"{path} does not exist; write one with TunedLens.save(path).")
        with safe_open(str(path), "pt") as handle:
            metadata = handle.metadata() or {}
        if metadata.get("format") != "dcp-lens-tuned-lens":
            raise LensError(f"{path} is not a tuned lens written by TunedLens.save.")
        tensors = load_file(str(path))
        steps = sorted({int(key.split(".")[0][1:]) for key in tensors})
        try:
            translators = {
                t: AffineTranslator.from_state_dict(tensors, prefix=f"t{t}.") for t in steps
            }
        except TranslatorError as error:
            raise LensError(f"{path}: {error}") from error
        return cls(translators, int(metadata["n_iterations"]))


def final_stream_hook(model: HookedRecurrentTransformer) -> str:
    """The hook holding the stream entering ``ln_final`` in the active view."""
    if model.cfg.n_coda or model.is_dense:
        return f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"
    if model.ln_pre_coda is not None:
        return "ln_pre_coda.hook_normalized"
    return "hook_readout_in"


class JacobianLens:
    """Per-iteration Jacobians J_t [d_model, d_model] from s_t to the stream entering ln_final.

    Attributes:
        jacobians: ``{t: J_t}``.
    """

    def __init__(self, jacobians: dict[int, Tensor]):
        self.jacobians = dict(jacobians)

    @classmethod
    def fit(
        cls,
        model: HookedRecurrentTransformer,
        tokens: Int[Tensor, "n pos"],
        iterations: Sequence[int] | None = None,
        *,
        skip_first: int = 0,
    ) -> JacobianLens:
        """Average, over prompts (rows of ``tokens``) and source positions p >= ``skip_first``,
        of sum_{t' >= p} d h_final[t'] / d s_t[p], for each t (default 0..r). One forward and
        d_model backward passes per prompt."""
        r = model.n_iterations
        wanted = list(range(r + 1)) if iterations is None else list(iterations)
        if not 0 <= skip_first < tokens.shape[1]:
            raise LensError(f"skip_first={skip_first} leaves no position of {tokens.shape[1]}.")
        d = model.cfg.d_model
        totals = {t: torch.zeros(d, d, dtype=torch.float64) for t in wanted}
        for row in tokens:
            for t, jacobian in _prompt_jacobians(model, row[None], wanted, skip_first).items():
                totals[t] += jacobian
        return cls({t: (total / len(tokens)) for t, total in totals.items()})

    def logits(
        self,
        model: HookedRecurrentTransformer,
        source: LensSource,
        iterations: Sequence[int] | None = None,
    ) -> Float[Tensor, "iteration batch pos d_vocab"]:
        """``ln_final(J_t s_t) @ W_U`` for each t, indexed by iteration as every lens: by default
        entry t is iteration t, t = 0..r, NaN where no Jacobian was fitted; a t named in
        ``iterations`` must have one."""
        default = iterations is None
        wanted = list(range(model.n_iterations + 1)) if iterations is None else list(iterations)
        missing = [t for t in wanted if t not in self.jacobians]
        if missing and not default:
            raise LensError(
                f"no Jacobian for iterations {missing}; fitted {sorted(self.jacobians)}."
            )
        states = iteration_states(model, source, wanted)
        rows: list[Tensor | None] = []
        for t, state in zip(wanted, states, strict=True):
            if t in missing:
                rows.append(None)
                continue
            moved = state @ self.jacobians[t].to(state.dtype).T
            rows.append(model.ln_final(moved) @ model.W_U)
        return by_iteration(rows)


def _prompt_jacobians(
    model: HookedRecurrentTransformer,
    tokens: Int[Tensor, "1 pos"],
    wanted: list[int],
    skip_first: int,
) -> dict[int, Tensor]:
    """For one prompt: mean over source positions of the summed-over-targets Jacobian."""
    d = model.cfg.d_model
    n_pos = tokens.shape[1]
    # A zero added to each s_t carries the gradient without cutting the loop's graph.
    probes = {t: torch.zeros(1, n_pos, d, requires_grad=True) for t in wanted}
    captured: dict[str, Tensor] = {}

    def add_probe(t: int) -> Callable[[Tensor, HookPoint], Tensor]:
        def hook(state: Tensor, hook: HookPoint) -> Tensor:
            return state + probes[t].to(state.dtype)

        return hook

    def keep(stream: Tensor, hook: HookPoint) -> None:
        captured["final"] = stream

    hooks: HookList = [(model.state_hook_name(t), add_probe(t)) for t in wanted]
    hooks.append((final_stream_hook(model), keep))
    with torch.enable_grad():
        model.run_with_hooks(tokens, return_type=None, fwd_hooks=hooks)
        final = captured["final"]  # [1, pos, d]
        inputs = [probes[t] for t in wanted]
        rows: dict[int, list[Tensor]] = {t: [] for t in wanted}
        for i in range(d):
            cotangent = torch.zeros_like(final)
            cotangent[..., i] = 1.0  # every target position t' at once: sum over t' >= p
            grads = torch.autograd.grad(
                final, inputs, cotangent, retain_graph=i < d - 1, allow_unused=True
            )
            for t, grad in zip(wanted, grads, strict=True):
                grad = torch.zeros(1, n_pos, d) if grad is None else grad
                rows[t].append(grad[0, skip_first:].double().mean(0))  # [d]
    return {t: torch.stack(rows[t]) for t in wanted}  # row i: d final_i / d s_t
