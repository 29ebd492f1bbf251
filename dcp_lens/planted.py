"""Planted ground truth: hand-built recurrent models whose truncation gap has one known cause.

Each model is an ordinary `HookedRecurrentTransformer` (no prelude or coda, one core layer, RMS
pre-norm, attention switched off) whose MLP is set by hand. A GELU MLP computes any linear map
exactly, since gelu(z) - gelu(-z) = z, and |z| up to exp(-200) as (gelu(cz) + gelu(-cz)) / c for
large c. Positions do not interact, so every position of a sequence is an independent example.
Run DCP on one (``dcp-lens run --model planted:readout_shift``) to check a setup: on the accuracy
metric it must give the planted factor >= 90% of the gap's area and the others <= 10%.

=========================  ==========================================================  ========
model                      mechanism                                                   DCP must
=========================  ==========================================================  ========
``readout_shift``          answer in e at every depth; a clock rotates by 2 pi / 11    S
                           each iteration and biases the answer logits unless at r
``distinct_computation``   one-hot node, one step of a 13-cycle per iteration; the     D
                           answer is the node after r steps
``block_count``            every iteration adds the same vote +-delta (sign of an      B
                           XOR of two input features) to a noisy answer coordinate
=========================  ==========================================================  ========
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dcp_lens.components.norms import RMSNorm
from dcp_lens.config import RecurrentConfig
from dcp_lens.hooked_recurrent_transformer import HookedRecurrentTransformer
from dcp_lens.protocol import EvaluationSet
from dcp_lens.registry import register_loader

PLANTED = ("readout_shift", "distinct_computation", "block_count")
SEQUENCE_LENGTH = 8


@dataclass(frozen=True)
class PlantedTask:
    """Random token sequences and each position's answer under a planted model's rule."""

    answers: Tensor  # [d_vocab] long: the answer to each input token
    n_inputs: int  # input tokens are 0..n_inputs-1
    seed: int

    def split(self, name: str, n: int) -> EvaluationSet:
        """``n`` sequences of the ``"calibration"`` or ``"evaluation"`` split (disjoint seeds)."""
        offsets = {"train": 0, "calibration": 1, "evaluation": 2}
        if name not in offsets:
            raise ValueError(f"split={name!r} must be one of {sorted(offsets)}.")
        generator = torch.Generator().manual_seed(self.seed * 7919 + offsets[name])
        tokens = torch.randint(0, self.n_inputs, (n, SEQUENCE_LENGTH), generator=generator)
        return EvaluationSet(tokens, self.answers[tokens])

    def calibration(self, n: int = 512) -> EvaluationSet:
        return self.split("calibration", n)

    def evaluation(self, n: int = 512) -> EvaluationSet:
        return self.split("evaluation", n)


def _base_config(d_model: int, d_vocab: int, n_iterations: int, d_mlp: int) -> RecurrentConfig:
    return RecurrentConfig(
        d_model=d_model, n_heads=1, d_head=d_model, d_mlp=d_mlp, d_vocab=d_vocab,
        n_ctx=SEQUENCE_LENGTH, n_prelude=0, n_core=1, n_coda=0, n_iterations=n_iterations,
        injection="none", state_init="embed", normalization_type="RMS", eps=1e-12,
        positional_embedding_type="learned",
    )  # fmt: skip


class PlantedModel(HookedRecurrentTransformer):
    """A hand-built model together with the task it solves (``planted_task``)."""

    planted_task: PlantedTask

    @property
    def task(self) -> PlantedTask:
        """The planted task (``evaluation(n)`` / ``calibration(n)`` give evaluation sets)."""
        return self.planted_task

    @property
    def unembedding(self) -> Tensor:
        assert self.W_U_untied is not None, "planted models have an untied unembedding"
        return self.W_U_untied


def _blank(cfg: RecurrentConfig) -> PlantedModel:
    """The model with every weight zero (attention adds nothing) and unit norm weights."""
    model = PlantedModel(cfg)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.w.fill_(1.0)
    return model.eval()


def _set_linear_mlp(model: HookedRecurrentTransformer, linear: Tensor, rms: float) -> None:
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


def readout_shift(
    size: int = 8, n_iterations: int = 8, seed: int = 0, angle: float = 2 * math.pi / 11
) -> PlantedModel:
    """S only: DCP must attribute the gap to readout shift (S ~ gap; B, D ~ 0).

    ``size`` answer classes. The state is [answer one-hot (size), clock (2), constant 1]; the
    answer is in e and never changes. The core rotates the clock by ``angle`` (a linear map, so
    each iteration's update points elsewhere and replaying one update misses). The readout adds
    lambda <w_j, clock - c_r> to answer j: zero only when the clock is where it is after r
    iterations. Calibration (even mean-only) moves the clock back; nothing is computed, so D = 0.
    """
    n_answers = _at_least(size, 2, "size")
    d_model = n_answers + 3
    n_inputs = 4 * n_answers
    cfg = _base_config(d_model, n_inputs, _at_least(n_iterations, 2, "n_iterations"), 2 * d_model)
    model = _blank(cfg)
    clock = slice(n_answers, n_answers + 2)
    constant = n_answers + 2
    start = torch.tensor([1.0, 0.0])
    rotation = torch.tensor(
        [[math.cos(angle), math.sin(angle)], [-math.sin(angle), math.cos(angle)]]
    )  # row-vector convention: c_t = c_{t-1} @ rotation
    answers = torch.arange(n_inputs) % n_answers
    with torch.no_grad():
        W_E = model.embed.W_E
        W_E[torch.arange(n_inputs), answers] = 1.0
        W_E[:, clock] = start
        W_E[:, constant] = 1.0
        rms = math.sqrt((1.0 + 1.0 + 1.0) / d_model)  # every state has norm^2 = 3
        linear = torch.zeros(d_model, d_model)
        linear[clock, clock] = rotation - torch.eye(2)
        _set_linear_mlp(model, linear, rms)
        final_clock = start @ torch.linalg.matrix_power(rotation, cfg.n_iterations)
        generator = torch.Generator().manual_seed(seed)
        directions = torch.randn(2, n_answers, generator=generator)
        directions = directions / directions.norm(dim=0, keepdim=True)
        strength = 20.0
        W_U = torch.zeros(d_model, n_inputs)
        W_U[torch.arange(n_answers), torch.arange(n_answers)] = 1.0
        W_U[clock, :n_answers] = strength * directions
        W_U[constant, :n_answers] = -strength * (final_clock @ directions)
        W_U[constant, n_answers:] = -100.0  # input-only tokens are never answers
        model.unembedding.copy_(W_U)
    model.planted_task = PlantedTask(answers, n_inputs, seed)
    return model


def distinct_computation(size: int = 13, n_iterations: int = 8, seed: int = 0) -> PlantedModel:
    """D only: DCP must attribute the gap to distinct computation (D ~ gap; S, B ~ 0).

    The state is a one-hot node of a ``size``-cycle; each iteration moves it one step (a
    permutation, linear). Start nodes are uniform, so every depth sees the same state distribution
    (S = 0); the answer is the node after r steps, so each iteration is new work, and a replayed
    update lands on no node that answers correctly (B = 0). ``size`` should exceed r.
    """
    n_nodes = _at_least(size, 3, "size")
    cfg = _base_config(n_nodes, n_nodes, _at_least(n_iterations, 2, "n_iterations"), 2 * n_nodes)
    model = _blank(cfg)
    step = torch.roll(torch.eye(n_nodes), shifts=1, dims=1)  # e_i @ step = e_{i+1}
    with torch.no_grad():
        model.embed.W_E.copy_(torch.eye(n_nodes))
        _set_linear_mlp(model, step - torch.eye(n_nodes), math.sqrt(1.0 / n_nodes))
        model.unembedding.copy_(torch.eye(n_nodes))
    answers = (torch.arange(n_nodes) + cfg.n_iterations) % n_nodes
    model.planted_task = PlantedTask(answers, n_nodes, seed)
    return model


def block_count(
    size: int = 256, n_iterations: int = 8, seed: int = 0, vote: float = 0.3
) -> PlantedModel:
    """B only: DCP must attribute the gap to block applications (B ~ gap; S, D ~ 0).

    ``size`` input tokens, each with two +-1 features x1, x2 and a fixed N(0, 1) offset eta. The
    state is [x1, x2, carrier, answer]; the answer coordinate starts at eta and every iteration adds
    ``vote`` * x1 x2 (an XOR, computed by the MLP from |x1 + x2| - |x1 - x2|: not linear in the
    state, so no affine calibration can supply it). The readout takes the sign. Accuracy grows with
    the number of applications; replaying the first update reproduces full depth; calibration
    cannot raise the signal-to-noise ratio; no iteration computes anything the first did not.
    """
    n_inputs = _at_least(size, 8, "size")
    cfg = _base_config(4, n_inputs, _at_least(n_iterations, 2, "n_iterations"), 4)
    model = _blank(cfg)
    generator = torch.Generator().manual_seed(seed)
    features = torch.stack([torch.arange(n_inputs) % 2, (torch.arange(n_inputs) // 2) % 2], 1)
    features = 2.0 * features.float() - 1.0  # x1, x2 in {-1, +1}, balanced
    offsets = torch.randn(n_inputs, generator=generator)
    carrier = 100.0  # dominates the state's norm, so the RMS norm barely changes as votes add up
    sharpness = 2000.0  # gelu(c z) / c is |z|-exact far from 0
    with torch.no_grad():
        model.embed.W_E.copy_(
            torch.stack(
                [features[:, 0], features[:, 1], torch.full((n_inputs,), carrier), offsets], 1
            )
        )
        mlp = model._core[0][0].mlp
        rms = carrier / 2.0  # sqrt(carrier^2 / 4) up to the small coordinates
        plus, minus = torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([1.0, -1.0, 0.0, 0.0])
        mlp.W_in.copy_(torch.stack([plus, -plus, minus, -minus], 1) * sharpness)
        # (|u1 + u2| - |u1 - u2|) = 2 x1 x2 / rms for u = s / rms: scale back to `vote` per step.
        scale = vote * rms / (2.0 * sharpness)
        mlp.W_out.zero_()
        mlp.W_out[:4, 3] = torch.tensor([1.0, 1.0, -1.0, -1.0]) * scale
        W_U = torch.zeros(4, n_inputs)
        W_U[3, 0], W_U[3, 1] = 1.0, -1.0  # token 0: x1 x2 = +1; token 1: x1 x2 = -1
        W_U[2, 2:] = -1.0  # other tokens are never answers
        model.unembedding.copy_(W_U)
    answers = torch.where(features[:, 0] * features[:, 1] > 0, 0, 1)
    model.planted_task = PlantedTask(answers, n_inputs, seed)
    return model


BUILDERS = {
    "readout_shift": readout_shift,
    "distinct_computation": distinct_computation,
    "block_count": block_count,
}
EXPECTED_FACTOR = {"readout_shift": "S", "distinct_computation": "D", "block_count": "B"}


@register_loader("planted")
def load_planted(name: str, **overrides: object) -> PlantedModel:
    """``load("planted:NAME", size=…, n_iterations=…, seed=…)``."""
    if name not in BUILDERS:
        raise ValueError(f"unknown planted model {name!r}; choose one of {PLANTED}.")
    return BUILDERS[name](**overrides)  # type: ignore[arg-type]


def _at_least(value: object, minimum: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}.")
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}.")
    return value
