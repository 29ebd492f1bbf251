"""The planted models' building blocks: the task, the model class, a blank model, a linear MLP,
the concat adapter, routing, and the two ways of combining models (a mixture, soft answers).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dcp_lens.model.components.norms import RMSNorm
from dcp_lens.model.config import RecurrentConfig
from dcp_lens.model.hooked_recurrent_transformer import HookedRecurrentTransformer
from dcp_lens.protocol.dcp import EvaluationSet
from dcp_lens.utils.errors import ConfigError, ConfigTypeError

SEQUENCE_LENGTH = 8


@dataclass(frozen=True)
class PlantedTask:
    """Random token sequences and each position's answer under a planted model's rule.

    ``target_probabilities`` (``[SEQUENCE_LENGTH, n_inputs, d_vocab]``) makes the answers soft:
    each position's target is drawn from the distribution of its (position, token). ``factors``
    names the factor behind each input token's gap in a mixture (``None``: one factor for all).
    """

    answers: Tensor  # [d_vocab] long: the answer to each input token
    n_inputs: int  # input tokens are 0..n_inputs-1
    seed: int
    target_probabilities: Tensor | None = None
    factors: tuple[str, ...] | None = None

    def split(self, name: str, n: int) -> EvaluationSet:
        """``n`` sequences of the ``"calibration"`` or ``"evaluation"`` split (disjoint seeds)."""
        offsets = {"train": 0, "calibration": 1, "evaluation": 2}
        if name not in offsets:
            raise ValueError(f"split={name!r} must be one of {sorted(offsets)}.")
        generator = torch.Generator().manual_seed(self.seed * 7919 + offsets[name])
        tokens = torch.randint(0, self.n_inputs, (n, SEQUENCE_LENGTH), generator=generator)
        if self.target_probabilities is None:
            return EvaluationSet(tokens, self.answers[tokens])
        positions = torch.arange(SEQUENCE_LENGTH).expand_as(tokens)
        probabilities = self.target_probabilities[positions, tokens]  # [n, pos, d_vocab]
        targets = torch.multinomial(probabilities.flatten(0, 1), 1, generator=generator)
        return EvaluationSet(tokens, targets.view(tokens.shape))

    def calibration(self, n: int = 512) -> EvaluationSet:
        return self.split("calibration", n)

    def evaluation(self, n: int = 512) -> EvaluationSet:
        return self.split("evaluation", n)

    def factor_masks(self, tokens: Tensor) -> dict[str, Tensor]:
        """Per factor of a mixture, the positions of ``tokens`` whose gap it causes (bool)."""
        if self.factors is None:
            raise ValueError("this planted task has one factor; factor_masks is for mixtures.")
        names = sorted(set(self.factors))
        index = torch.tensor([names.index(f) for f in self.factors])[tokens]
        return {name: index == i for i, name in enumerate(names)}


def base_config(
    d_model: int, d_vocab: int, n_iterations: int, d_mlp: int, n_prelude: int = 0
) -> RecurrentConfig:
    return RecurrentConfig(
        d_model=d_model,
        n_heads=1,
        d_head=d_model,
        d_mlp=d_mlp,
        d_vocab=d_vocab,
        n_ctx=SEQUENCE_LENGTH,
        n_prelude=n_prelude,
        n_core=1,
        n_coda=0,
        n_iterations=n_iterations,
        injection="none",
        state_init="embed",
        normalization_type="RMS",
        eps=1e-12,
        positional_embedding_type="learned",
    )


class PlantedModel(HookedRecurrentTransformer):
    """A hand-built model together with the task it solves (``planted_task``)."""

    planted_task: PlantedTask

    @property
    def task_object(self) -> PlantedTask:
        """The planted task (``evaluation(n)`` / ``calibration(n)`` give evaluation sets), which
        `dcp_lens.tasks.task_of` returns for this model."""
        return self.planted_task

    @property
    def task(self) -> PlantedTask:
        """The planted task, as `task_object` (a planted model is built with its task)."""
        return self.planted_task

    @property
    def unembedding(self) -> Tensor:
        assert self.W_U_untied is not None, "planted models have an untied unembedding"
        return self.W_U_untied


def blank_model(cfg: RecurrentConfig) -> PlantedModel:
    """The model with every weight zero (attention adds nothing) and unit norm weights."""
    model = PlantedModel(cfg)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.w.fill_(1.0)
    return model.eval()


def position_table(model: HookedRecurrentTransformer) -> Tensor:
    """The learned position table W_pos (every planted model has one)."""
    assert model.pos_embed is not None, "planted models have learned positions"
    return model.pos_embed.W_pos


def set_linear_mlp(model: HookedRecurrentTransformer, linear: Tensor, rms: float) -> None:
    """Make the core MLP add ``s @ linear`` to a state s whose RMS is ``rms`` (gelu pair)."""
    mlp = model._core[0][0].mlp
    d = linear.shape[0]
    with torch.no_grad():
        mlp.W_in.zero_()
        mlp.W_out.zero_()
        mlp.W_in[:, :d] = linear * rms
        mlp.W_in[:, d : 2 * d] = -linear * rms
        mlp.W_out[:d] = torch.eye(d)
        mlp.W_out[d : 2 * d] = -torch.eye(d)


def mixture(first: PlantedModel, second: PlantedModel, factors: tuple[str, str]) -> PlantedModel:
    """Two planted models side by side in one: block-diagonal state, MLP and readout; the tokens
    of ``first`` come first in the vocabulary. Exact: a token's state is zero in the other block,
    and the RMS norm's extra width is folded into the weights (u = s / rms grows by
    sqrt(D / d) over the component's own, so its MLP input and readout weights shrink by that).
    Planted MLPs have no biases (`blank_model`), so none are copied."""
    d1, d2 = first.cfg.d_model, second.cfg.d_model
    v1, v2 = first.cfg.d_vocab, second.cfg.d_vocab
    m1, m2 = first.cfg.d_mlp, second.cfg.d_mlp
    assert m1 is not None and m2 is not None
    if first.n_iterations != second.n_iterations:
        raise ValueError("mixed planted models need the same n_iterations.")
    for part in (first, second):
        if part.cfg.n_prelude or bool(position_table(part).any()):
            raise ValueError("only prelude-free, position-free planted models mix.")
    d = d1 + d2
    cfg = base_config(d, v1 + v2, first.n_iterations, m1 + m2)
    model = blank_model(cfg)
    blocks = (
        (first, slice(0, d1), slice(0, v1), slice(0, m1)),
        (second, slice(d1, d), slice(v1, v1 + v2), slice(m1, m1 + m2)),
    )
    with torch.no_grad():
        mlp = model._core[0][0].mlp
        for part, state, vocab, hidden in blocks:
            width_ratio = math.sqrt(part.cfg.d_model / d)
            part_mlp = part._core[0][0].mlp
            model.embed.W_E[vocab, state] = part.embed.W_E
            mlp.W_in[state, hidden] = part_mlp.W_in * width_ratio
            mlp.W_out[hidden, state] = part_mlp.W_out
            model.unembedding[state, vocab] = part.unembedding * width_ratio
    answers = torch.cat([first.planted_task.answers, second.planted_task.answers + v1])
    # A part that is itself a mixture keeps its own per-token factors.
    token_factors = tuple(
        token_factor
        for part, factor in ((first, factors[0]), (second, factors[1]))
        for token_factor in (part.planted_task.factors or (factor,) * part.planted_task.n_inputs)
    )
    if first.planted_task.n_inputs != v1 or second.planted_task.n_inputs != v2:
        raise ValueError("mixed planted models must use their whole vocabulary as inputs.")
    model.planted_task = PlantedTask(answers, v1 + v2, first.planted_task.seed, None, token_factors)
    return model


def soft_answers(model: PlantedModel, readout_scale: float) -> PlantedModel:
    """``model`` with its readout scaled by ``readout_scale`` and soft answers: each position's
    target is drawn from the full-depth model's own predictive distribution for its (position,
    token). Full depth is then the true distribution, so the expected cross-entropy gap of any
    condition is its KL to full depth, and both losses carry the planted factor."""
    task = model.planted_task
    with torch.no_grad():
        model.unembedding.mul_(readout_scale)
        every_token = torch.arange(task.n_inputs)[:, None].expand(-1, SEQUENCE_LENGTH)
        probabilities = model(every_token).double().softmax(-1).transpose(0, 1).float()
    model.planted_task = PlantedTask(
        task.answers, task.n_inputs, task.seed, probabilities.contiguous(), task.factors
    )
    return model


def adapter_config(d_model: int, d_vocab: int, n_iterations: int, d_mlp: int) -> RecurrentConfig:
    """Like `base_config`, with the concat adapter: u_t = W [s_{t-1}; e], so the input e can reach
    every iteration without staying in the state (what the remaining computation needs is then
    absent from s_k)."""
    return RecurrentConfig(
        d_model=d_model,
        n_heads=1,
        d_head=d_model,
        d_mlp=d_mlp,
        d_vocab=d_vocab,
        n_ctx=SEQUENCE_LENGTH,
        n_prelude=0,
        n_core=1,
        n_coda=0,
        n_iterations=n_iterations,
        injection="concat_adapter",
        state_init="embed",
        normalization_type="RMS",
        eps=1e-12,
        positional_embedding_type="learned",
    )


def route(model: PlantedModel, from_state: Sequence[int], from_input: Sequence[int]) -> None:
    """Set the adapter so that u_t takes the coordinates ``from_state`` of s_{t-1} and
    ``from_input`` of e (every other coordinate of u_t is 0)."""
    adapter = model.inject.W_adapter
    d = model.cfg.d_model
    with torch.no_grad():
        adapter.zero_()
        for i in from_state:
            adapter[i, i] = 1.0
        for i in from_input:
            adapter[i, d + i] = 1.0


def at_least(value: object, minimum: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(f"{name} must be an int, got {value!r}.")
    if value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}.")
    return value
