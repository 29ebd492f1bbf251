"""Planted ground truth: hand-built recurrent models whose truncation gap has a known cause.

Each model is an ordinary `HookedRecurrentTransformer` (no prelude or coda, one core layer, RMS
pre-norm, attention switched off) whose MLP is set by hand. A GELU MLP computes any linear map
exactly, since gelu(z) - gelu(-z) = z, and |z| up to exp(-200) as (gelu(cz) + gelu(-cz)) / c for
large c. Positions do not interact, so every position of a sequence is an independent example.
Run DCP on one (``dcp-lens run --model planted:readout_shift``) to check a setup: it must give the
planted factor >= 90% of the gap's area and the others within 10%; a mixture's shares must lie
within 0.1 of its true shares (`expected_shares`). ``dcp-lens validate`` runs them all.

===============================  ====================================================  ========
model                            mechanism                                             DCP must
===============================  ====================================================  ========
``readout_shift``                answer in e at every depth; a clock rotates by        S
                                 2 pi / 11 each iteration and biases the answer
                                 logits unless at r
``distinct_computation``         one-hot node, one step of a 13-cycle per iteration;   D
                                 the answer is the node after r steps
``block_count``                  every iteration adds the same vote +-delta (sign of   B
                                 an XOR of two input features) to a noisy answer
``readout_shift_by_token_type``  the answer's logits shifted by a turning clock, in    S
                                 opposite directions for two token types
``readout_shift_by_position``    the same, the type set by the position's parity       S
``readout_shift_step``           ``readout_shift`` with the clock turned once, at the  S
                                 last iteration: replay's readout is truncation's
``mixture_shift_distinct``       half the tokens ``readout_shift_step``, half a        S + D
                                 32-cycle
``mixture_shift_blocks``         half the tokens ``readout_shift_step``, half          S + B
                                 ``block_count``
``*_soft``                       the first three with answers drawn from the full-     S, D, B
                                 depth prediction (cross-entropy = KL to full)
===============================  ====================================================  ========
"""

from __future__ import annotations

import inspect
import math
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dcp_lens.model.components.norms import RMSNorm
from dcp_lens.model.config import RecurrentConfig
from dcp_lens.model.hooked_recurrent_transformer import HookedRecurrentTransformer
from dcp_lens.model.tokenization import VocabularyTokenizer
from dcp_lens.protocol.dcp import EvaluationSet
from dcp_lens.protocol.metrics import HIGHER_IS_BETTER, IGNORE_INDEX, per_example_metrics
from dcp_lens.protocol.results import FACTORS
from dcp_lens.protocol.states import capture_states
from dcp_lens.utils.devices import check_device, check_dtype
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


def _base_config(
    d_model: int, d_vocab: int, n_iterations: int, d_mlp: int, n_prelude: int = 0
) -> RecurrentConfig:
    return RecurrentConfig(
        d_model=d_model, n_heads=1, d_head=d_model, d_mlp=d_mlp, d_vocab=d_vocab,
        n_ctx=SEQUENCE_LENGTH, n_prelude=n_prelude, n_core=1, n_coda=0, n_iterations=n_iterations,
        injection="none", state_init="embed", normalization_type="RMS", eps=1e-12,
        positional_embedding_type="learned",
    )  # fmt: skip


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


def _positions(model: HookedRecurrentTransformer) -> Tensor:
    """The learned position table W_pos (every planted model has one)."""
    assert model.pos_embed is not None, "planted models have learned positions"
    return model.pos_embed.W_pos


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


def readout_shift_step(size: int = 8, n_iterations: int = 8, seed: int = 0) -> PlantedModel:
    """S only, with replay exactly neutral: the clock turns once, at the last iteration.

    `readout_shift` turns its clock a little every iteration, and replaying the k-th update
    extrapolates along the chord, which for k near r lands near c_r: replay then repairs part of
    the shift (B 0.02 of its gap, more on some seeds), an interaction the mixtures' planted truth
    cannot book. Here the state is [answer one-hot (size), clock (2), counter q, carrier C]. Each
    iteration adds 1 to q (from the carrier), and a sharp GELU unit that fires only when q = r - 1
    turns the clock from c_0 to c_r = -c_0 at iteration r. So s_k, k < r, holds the answer in
    full with the clock at c_0 (the readout biases answer j's logit by lambda <w_j, c_0 - c_r>,
    the same bias for every token: a translation that mean matching undoes, S = gap),
    and the k-th update, k < r, moves q only, so replay's readout is truncation's (B = 0), and
    calibrated replay is full depth (D = 0).
    """
    n_answers = _at_least(size, 2, "size")
    r = _at_least(n_iterations, 2, "n_iterations")
    d_model = n_answers + 4
    n_inputs = 4 * n_answers
    cfg = _base_config(d_model, n_inputs, r, 4)
    model = _blank(cfg)
    clock, counter, carrier = slice(n_answers, n_answers + 2), n_answers + 2, n_answers + 3
    carrier_size = 100.0  # dominates the norm: the counter moves the RMS by < 0.4%
    start = torch.tensor([1.0, 0.0])
    final = -start
    answers = torch.arange(n_inputs) % n_answers
    rms = math.sqrt((1.0 + 1.0 + carrier_size**2) / d_model)  # at q = 0
    with torch.no_grad():
        W_E = model.embed.W_E
        W_E[torch.arange(n_inputs), answers] = 1.0
        W_E[:, clock] = start
        W_E[:, carrier] = carrier_size
        mlp = model._core[0][0].mlp
        # Units 0, 1: gelu(u_C) - gelu(-u_C) = C / rms, scaled to add 1 to q every iteration.
        mlp.W_in[carrier, 0], mlp.W_in[carrier, 1] = 1.0, -1.0
        mlp.W_out[0, counter] = rms / carrier_size
        mlp.W_out[1, counter] = -rms / carrier_size
        # Unit 2: preactivation 100 (q - r + 1.5), times rms / RMS(s): +50 at q = r - 1, -50
        # (gelu ~ 0) at q <= r - 2; its output turns the clock by final - start.
        sharpness = 100.0 * rms
        mlp.W_in[counter, 2] = sharpness
        mlp.W_in[carrier, 2] = -sharpness * (r - 1.5) / carrier_size
        mlp.W_out[2, clock] = (final - start) / 50.0
        generator = torch.Generator().manual_seed(seed)
        directions = torch.randn(2, n_answers, generator=generator)
        directions = directions / directions.norm(dim=0, keepdim=True)
        strength = 20.0
        # The readout sees s / RMS(s): scale by rms so that answer j's logit is about
        # s_j + strength <w_j, clock - c_r>.
        W_U = torch.zeros(d_model, n_inputs)
        W_U[torch.arange(n_answers), torch.arange(n_answers)] = rms
        W_U[clock, :n_answers] = strength * rms * directions
        W_U[carrier, :n_answers] = -strength * rms * (final @ directions) / carrier_size
        W_U[carrier, n_answers:] = -rms  # input-only tokens are never answers (logit -100)
        model.unembedding.copy_(W_U)
        # The RMS grows with q, so the unit fires a little below 50: rescale its output so that
        # the clock lands on c_r exactly (every token has the same norm, so one factor does).
        reached = capture_states(model, torch.zeros(1, 1, dtype=torch.long))[0][r][0, 0, clock]
        mlp.W_out[2, clock] *= (final - start).norm() / (reached - start).norm()
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


def _type_dependent_shift(
    by: str, size: int, n_iterations: int, seed: int, shift_size: float = 3.0
) -> PlantedModel:
    """S only, a shift that differs between inputs (`readout_shift_by_token_type`, `..._position`).

    The state is [answer logits z (size), clock A (2), clock B (2), carrier]. Half the inputs are
    type A, half type B, by token (``by="token"``) or by the position's parity (``by="position"``).
    A type-A input's clock starts at c0 and turns by +2 pi / 11 per iteration; a type-B input's
    starts at c0's mirror image and turns the other way (the other clock stays 0). Every
    iteration adds the turn of the clock to z through a fixed random map (W for clock A, -W
    mirrored for clock B) and e starts z where the r turns bring it to the answer's one-hot:
    z_k = onehot + delta_type(k), with delta_B(k) = -delta_A(k) and delta(r) = 0. The readout
    reads z only. The answer is in z at every depth and nothing is computed (D = 0); the turning
    clock makes replay miss (B ~ 0, as in `readout_shift`). Within a type the shift is a
    translation, so an affine map fitted per cluster of the state (the clocks separate the types)
    repairs both truncate and replay exactly; pooled over types the mean of z never moves and the
    shift shows only as between-type spread of z, which moment matching squeezes rather than
    undoes. (One pooled affine map does exist: subtract the clocks' contribution. A shift that
    no pooled affine map repairs needs different linear maps per type on the same coordinates;
    the ones moment matching can recover are stretches, whose updates are collinear, so replay
    repairs them too: a B/S confound, not an S-only model.)
    """
    n_answers = _at_least(size, 3, "size")
    r = _at_least(n_iterations, 2, "n_iterations")
    n_inputs = 2 * n_answers if by == "token" else n_answers
    d_model = n_answers + 5
    cfg = _base_config(d_model, n_inputs, r, 2 * d_model)
    model = _blank(cfg)
    z, clock_a, clock_b, carrier = slice(0, n_answers), [n_answers, n_answers + 1], \
        [n_answers + 2, n_answers + 3], n_answers + 4  # fmt: skip
    angle = 2 * math.pi / 11
    turn = torch.tensor([[math.cos(angle), math.sin(angle)], [-math.sin(angle), math.cos(angle)]])
    mirror = torch.diag(torch.tensor([1.0, -1.0]))
    turn_b = mirror @ turn @ mirror  # the mirror image turns the other way
    generator = torch.Generator().manual_seed(seed)
    into_z = shift_size * torch.randn(2, n_answers, generator=generator) / math.sqrt(2)
    into_z_b = -mirror @ into_z  # so that delta_B = -delta_A
    start_a = torch.tensor([1.0, 0.0])
    start_b = start_a @ mirror
    final_a = start_a @ torch.linalg.matrix_power(turn, r)
    final_b = start_b @ torch.linalg.matrix_power(turn_b, r)
    offset_a = (start_a - final_a) @ into_z  # z_0 - onehot for type A
    offset_b = (start_b - final_b) @ into_z_b
    answers = torch.arange(n_inputs) % n_answers
    carrier_size = 100.0  # dominates the norm, so the RMS norm barely moves as z shifts
    with torch.no_grad():
        W_E = model.embed.W_E
        W_E[torch.arange(n_inputs), answers] = 1.0
        W_E[:, carrier] = carrier_size
        # The type, and with it the clock and z's start, comes with the token or the position.
        table: Tensor = W_E if by == "token" else _positions(model)
        rows = (torch.arange(table.shape[0]) // (n_answers if by == "token" else 1)) % 2 == 0
        table[rows, clock_a[0] : clock_a[1] + 1] = start_a
        table[~rows, clock_b[0] : clock_b[1] + 1] = start_b
        table[rows, z] += offset_a
        table[~rows, z] += offset_b
        rms = math.sqrt((carrier_size**2 + 2.0) / d_model)
        linear = torch.zeros(d_model, d_model)
        linear[clock_a[0] : clock_a[1] + 1, clock_a[0] : clock_a[1] + 1] = turn - torch.eye(2)
        linear[clock_b[0] : clock_b[1] + 1, clock_b[0] : clock_b[1] + 1] = turn_b - torch.eye(2)
        linear[clock_a[0] : clock_a[1] + 1, z] = (turn - torch.eye(2)) @ into_z
        linear[clock_b[0] : clock_b[1] + 1, z] = (turn_b - torch.eye(2)) @ into_z_b
        _set_linear_mlp(model, linear, rms)
        sharpness = 4.0  # logit of answer j: sharpness * z_j
        W_U = torch.zeros(d_model, n_inputs)
        W_U[torch.arange(n_answers), torch.arange(n_answers)] = sharpness * rms
        W_U[carrier, n_answers:] = -1.0  # input-only tokens are never answers
        model.unembedding.copy_(W_U)
    model.planted_task = PlantedTask(answers, n_inputs, seed)
    return model


def readout_shift_by_token_type(
    size: int = 8, n_iterations: int = 8, seed: int = 0
) -> PlantedModel:
    """S only, a shift that depends on the token's type; see `_type_dependent_shift`.

    Tokens 0..size-1 are type A, size..2 size-1 type B; token t answers t mod size.
    """
    return _type_dependent_shift("token", size, n_iterations, seed)


def readout_shift_by_position(size: int = 8, n_iterations: int = 8, seed: int = 0) -> PlantedModel:
    """S only, a shift that depends on the position's parity; see `_type_dependent_shift`:
    even positions are type A, odd ones type B; token t answers t."""
    return _type_dependent_shift("position", size, n_iterations, seed)


def _mixture(first: PlantedModel, second: PlantedModel, factors: tuple[str, str]) -> PlantedModel:
    """Two planted models side by side in one: block-diagonal state, MLP and readout; the tokens
    of ``first`` come first in the vocabulary. Exact: a token's state is zero in the other block,
    and the RMS norm's extra width is folded into the weights (u = s / rms grows by
    sqrt(D / d) over the component's own, so its MLP input and readout weights shrink by that).
    Planted MLPs have no biases (`_blank`), so none are copied."""
    d1, d2 = first.cfg.d_model, second.cfg.d_model
    v1, v2 = first.cfg.d_vocab, second.cfg.d_vocab
    m1, m2 = first.cfg.d_mlp, second.cfg.d_mlp
    assert m1 is not None and m2 is not None
    if first.n_iterations != second.n_iterations:
        raise ValueError("mixed planted models need the same n_iterations.")
    for part in (first, second):
        if part.cfg.n_prelude or bool(_positions(part).any()):
            raise ValueError("only prelude-free, position-free planted models mix.")
    d = d1 + d2
    cfg = _base_config(d, v1 + v2, first.n_iterations, m1 + m2)
    model = _blank(cfg)
    blocks = ((first, slice(0, d1), slice(0, v1), slice(0, m1)),
              (second, slice(d1, d), slice(v1, v1 + v2), slice(m1, m1 + m2)))  # fmt: skip
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


def mixture_shift_distinct(n_iterations: int = 8, seed: int = 0) -> PlantedModel:
    """S + D: half the tokens are `readout_shift_step` (size 8, 32 tokens), half
    `distinct_computation` (a 32-cycle). The true shares are the two halves' truncation gaps:
    `expected_shares` measures them on the evaluation set (S about 0.47 of the accuracy gap).
    The S half is the step clock, not `readout_shift`'s turning one, because a mixture's truth
    books each half's gap to its own factor: that holds only where replay leaves the S half's
    readout as truncation left it (docs/validation.md, "Coverage of the intervals")."""
    return _mixture(
        readout_shift_step(8, n_iterations, seed),
        distinct_computation(32, n_iterations, seed),
        ("S", "D"),
    )


def mixture_shift_blocks(n_iterations: int = 8, seed: int = 0) -> PlantedModel:
    """S + B: half the tokens are `readout_shift_step` (size 8, 32 tokens), half `block_count`
    (32 tokens, its readout scaled by 50 so that its answer coordinate is the logit and its gap
    shows on the losses too). True shares as for `mixture_shift_distinct`, and the S half is
    the step clock for the same reason."""
    blocks = block_count(32, n_iterations, seed)
    with torch.no_grad():
        blocks.unembedding.mul_(50.0)
    return _mixture(readout_shift_step(8, n_iterations, seed), blocks, ("S", "B"))


def _soft(model: PlantedModel, readout_scale: float) -> PlantedModel:
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


def readout_shift_soft(size: int = 8, n_iterations: int = 8, seed: int = 0) -> PlantedModel:
    """`readout_shift` with soft answers (see `_soft`): S only, on cross-entropy and KL too."""
    return _soft(readout_shift(size, n_iterations, seed), 1.0)


def distinct_computation_soft(size: int = 13, n_iterations: int = 8, seed: int = 0) -> PlantedModel:
    """`distinct_computation` with soft answers (see `_soft`): D only, on cross-entropy and KL."""
    return _soft(distinct_computation(size, n_iterations, seed), 1.0)


def block_count_soft(size: int = 256, n_iterations: int = 8, seed: int = 0) -> PlantedModel:
    """`block_count` with soft answers (see `_soft`; the readout scaled so that the answer
    coordinate is the logit): B only, on cross-entropy and KL."""
    return _soft(block_count(size, n_iterations, seed), 20.0)


# ------------------------------------------------- models for the S bracket (docs/bracket.md)


def _adapter_config(d_model: int, d_vocab: int, n_iterations: int, d_mlp: int) -> RecurrentConfig:
    """Like `_base_config`, with the concat adapter: u_t = W [s_{t-1}; e], so the input e can reach
    every iteration without staying in the state (what the remaining computation needs is then
    absent from s_k)."""
    return RecurrentConfig(
        d_model=d_model, n_heads=1, d_head=d_model, d_mlp=d_mlp, d_vocab=d_vocab,
        n_ctx=SEQUENCE_LENGTH, n_prelude=0, n_core=1, n_coda=0, n_iterations=n_iterations,
        injection="concat_adapter", state_init="embed", normalization_type="RMS", eps=1e-12,
        positional_embedding_type="learned",
    )  # fmt: skip


def _route(model: PlantedModel, from_state: Sequence[int], from_input: Sequence[int]) -> None:
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


def distinct_computation_context(
    size: int = 11, n_iterations: int = 8, seed: int = 0, skew: int = 0
) -> PlantedModel:
    """D only, and identifiable: what is left to compute after k is absent from s_k.

    A token is a pair (start node, step) of a ``size``-cycle (``size`` prime, > r). The state is
    [node one-hot (size), step one-hot (size), carrier]; s_0 = e. Each iteration the adapter
    feeds the node from the state and the step from the input e, and the MLP moves the node by
    the step (one unit per (node, step), firing when both are on) and clears the step from the
    state. So s_k holds node_k = start + k step only, and the answer, start + r step = node_k +
    (r - k) step, is independent of node_k (the step is uniform and (r - k) step is uniform mod a
    prime): no map of s_k, affine or not, beats the base rate (S = 0); a replayed update
    lands on no node the readout reads as new (B = 0); each iteration is new work (D = 1).

    ``skew`` > 0 adds ``skew`` * ``size`` tokens that copy the pairs whose answer is node 0:
    answer 0 then holds (1 + skew) / (size + skew) of the answers while node_k stays uniform, so
    full depth's marginal differs from truncation's and marginal matching pulls the readout
    toward the frequent answer (a base-rate gain, not readout shift).
    """
    n = _at_least(size, 3, "size")
    r = _at_least(n_iterations, 2, "n_iterations")
    extra = _at_least(skew, 0, "skew")
    pairs = [(start, step) for start in range(n) for step in range(n)]
    pairs += [((-r * step) % n, step) for _ in range(extra) for step in range(n)]
    n_inputs = len(pairs)
    d_model = 2 * n + 1
    node, steps, carrier = slice(0, n), slice(n, 2 * n), 2 * n
    units = [(i, step) for i in range(n) for step in range(1, n)]
    cfg = _adapter_config(d_model, n_inputs, r, len(units) + 2 * n)
    model = _blank(cfg)
    carrier_size = 10.0
    rms = math.sqrt((carrier_size**2 + 2.0) / d_model)  # u = [node, step, carrier]: fixed norm
    sharpness = 20.0  # gelu(20) = 20, gelu(0) = 0, gelu(-20) ~ 0: a unit is on or off
    with torch.no_grad():
        start = torch.tensor([p[0] for p in pairs])
        step = torch.tensor([p[1] for p in pairs])
        W_E = model.embed.W_E
        W_E[torch.arange(n_inputs), start] = 1.0
        W_E[torch.arange(n_inputs), n + step] = 1.0
        W_E[:, carrier] = carrier_size
        _route(model, [*range(n), carrier], range(n, 2 * n))
        mlp = model._core[0][0].mlp
        for unit, (i, j) in enumerate(units):  # on iff node i and step j: node i -> i + j
            mlp.W_in[i, unit] = sharpness * rms
            mlp.W_in[n + j, unit] = sharpness * rms
            mlp.W_in[carrier, unit] = -sharpness * rms / carrier_size
            mlp.W_out[unit, (i + j) % n] = 1.0 / sharpness
            mlp.W_out[unit, i] = -1.0 / sharpness
        clear = len(units)  # gelu(z) - gelu(-z) = z: take the step back out of the state
        for j in range(n):
            mlp.W_in[n + j, clear + 2 * j] = rms
            mlp.W_in[n + j, clear + 2 * j + 1] = -rms
            mlp.W_out[clear + 2 * j, n + j] = -1.0
            mlp.W_out[clear + 2 * j + 1, n + j] = 1.0
        readout_rms = math.sqrt((carrier_size**2 + 1.0) / d_model)  # s_t = [node, 0, carrier]
        W_U = torch.zeros(d_model, n_inputs)
        W_U[node, :n] = 10.0 * readout_rms * torch.eye(n)
        W_U[carrier, n:] = -10.0 * readout_rms / carrier_size  # non-nodes are never answers
        W_U[steps, :] = 0.0
        model.unembedding.copy_(W_U)
    answers = (start + r * step) % n
    model.planted_task = PlantedTask(answers, n_inputs, seed)
    return model


def distinct_computation_skewed(
    size: int = 11, n_iterations: int = 8, seed: int = 0
) -> PlantedModel:
    """Ambiguous for marginal matching: `distinct_computation_context` with a skewed answer prior
    (about half the answers are node 0). The truth is D = 1; calibration books the base rate as
    S unless it is discounted (docs/bracket.md)."""
    return distinct_computation_context(size, n_iterations, seed, skew=size - 1)


def block_count_context(
    size: int = 256, n_iterations: int = 8, seed: int = 0, vote: float = 0.3
) -> PlantedModel:
    """B only, and identifiable: `block_count` with the features that cast the vote kept out of
    the state.

    The state is [answer, x1, x2, carrier], s_0 = e = [eta, x1, x2, carrier]. Each iteration the
    adapter feeds the answer and carrier from the state and x1, x2 from the input e; the MLP adds
    ``vote`` * x1 x2 to the answer and clears x1, x2 from the state. So s_k = [eta + k vote x1 x2,
    0, 0, carrier]: what is left to add depends on x1 x2, which s_k holds only through the sum,
    and by symmetry the truncated readout's sign is already the best read of it (S = 0).
    Replaying any update k >= 2 reproduces full depth exactly (B = 1), and no iteration computes
    anything the first did not (D = 0).
    """
    n_inputs = _at_least(size, 8, "size")
    r = _at_least(n_iterations, 2, "n_iterations")
    cfg = _adapter_config(4, n_inputs, r, 8)
    model = _blank(cfg)
    generator = torch.Generator().manual_seed(seed)
    features = torch.stack([torch.arange(n_inputs) % 2, (torch.arange(n_inputs) // 2) % 2], 1)
    features = 2.0 * features.float() - 1.0
    offsets = torch.randn(n_inputs, generator=generator)
    carrier = 100.0
    sharpness = 2000.0
    rms = math.sqrt((carrier**2 + 2.0) / 4.0)  # up to the answer coordinate's own size
    with torch.no_grad():
        model.embed.W_E.copy_(
            torch.stack(
                [offsets, features[:, 0], features[:, 1], torch.full((n_inputs,), carrier)], 1
            )
        )
        _route(model, [0, 3], [1, 2])
        mlp = model._core[0][0].mlp
        plus, minus = torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.tensor([0.0, 1.0, -1.0, 0.0])
        mlp.W_in[:, :4] = torch.stack([plus, -plus, minus, -minus], 1) * sharpness
        mlp.W_out[:4, 0] = torch.tensor([1.0, 1.0, -1.0, -1.0]) * vote * rms / (2.0 * sharpness)
        for i, coordinate in enumerate((1, 2)):  # clear x1, x2: gelu(z) - gelu(-z) = z
            mlp.W_in[coordinate, 4 + 2 * i] = rms
            mlp.W_in[coordinate, 5 + 2 * i] = -rms
            mlp.W_out[4 + 2 * i, coordinate] = -1.0
            mlp.W_out[5 + 2 * i, coordinate] = 1.0
        scale = 20.0 * carrier / 2.0  # the answer coordinate is the logit
        W_U = torch.zeros(4, n_inputs)
        W_U[0, 0], W_U[0, 1] = scale / carrier, -scale / carrier
        W_U[3, 2:] = -1.0
        model.unembedding.copy_(W_U)
    answers = torch.where(features[:, 0] * features[:, 1] > 0, 0, 1)
    model.planted_task = PlantedTask(answers, n_inputs, seed)
    return model


def frame_flip(n_iterations: int = 8, seed: int = 0) -> PlantedModel:
    """Ambiguous: readout shift that keeps the marginal (truth S = 1, not identifiable).

    The state is an answer's code in {-1, +1}^4 (16 answers, every code used once), and each
    iteration flips the sign of its first two coordinates, a linear change of frame that maps the
    set of codes onto itself. Nothing is computed: s_k holds the answer in full, in the frame of
    s_r when r - k is even and the flipped frame when it is odd. The codes' distribution is the
    same at every depth, so no map fitted to marginals can see the change (S_lower = 0), while a
    paired map learns the flip (S_upper = 1). The same holds, with the opposite convention, of
    `distinct_computation`, whose permutation of a one-hot state is also a change of frame.
    """
    r = _at_least(n_iterations, 2, "n_iterations")
    cfg = _base_config(4, 16, r, 8)
    model = _blank(cfg)
    bits = (torch.arange(16)[:, None] >> torch.arange(4)) & 1
    codes = 2.0 * bits.float() - 1.0  # [16, 4], token t's code
    flip = torch.diag(torch.tensor([-1.0, -1.0, 1.0, 1.0]))
    with torch.no_grad():
        model.embed.W_E.copy_(codes)
        _set_linear_mlp(model, flip - torch.eye(4), 1.0)  # every code has RMS 1
        model.unembedding.copy_(3.0 * codes.T)  # logit of answer j: 3 <code_j, s>
    model.planted_task = PlantedTask(torch.arange(16), 16, seed)
    return model


def mixture_three_way(n_iterations: int = 8, seed: int = 0) -> PlantedModel:
    """Ambiguous: S + B + D, a third of the tokens each: `mixture_shift_blocks` (S and B) beside
    a 32-cycle `distinct_computation` (D, a permutation a paired map can learn)."""
    return _mixture(
        mixture_shift_blocks(n_iterations, seed),
        distinct_computation(32, n_iterations, seed),
        ("S+B", "D"),
    )


def distinct_computation_smooth(
    size: int = 13, n_iterations: int = 8, seed: int = 0, width: float = 3.0
) -> PlantedModel:
    """Ambiguous for B: `distinct_computation` read by a smooth unembedding (answer j's logit
    falls off as a Gaussian of width ``width`` in the cycle distance from the node). Replaying
    the last update, (r - k + 1) e_{n_k} - (r - k) e_{n_k - 1}, then moves the argmax forward
    along the cycle: replay walks between valid answers. The truth is D = 1 (each iteration is a
    new step); docs/bracket.md explains why B is flagged rather than booked here."""
    model = distinct_computation(size, n_iterations, seed)
    n = model.cfg.d_model
    index = torch.arange(n)
    distance = (index[:, None] - index[None, :]).abs()
    distance = torch.minimum(distance, n - distance).float()
    with torch.no_grad():
        model.unembedding.copy_(10.0 * torch.exp(-(distance**2) / (2 * width**2)))
    return model


# ----------------------------------- ambiguous models of the map class and of the order of S, B


def frame_flip_gated(
    n_iterations: int = 8, seed: int = 0, flipped: tuple[int, int] = (0, 1), gate: int = 2
) -> PlantedModel:
    """Ambiguous: readout shift that no affine map undoes (truth S = 1, not identifiable).

    Like `frame_flip`, the state is an answer's code in {-1, +1}^4 (16 answers) and nothing is
    computed; but each iteration flips the sign of the coordinates ``flipped`` only where the
    coordinate ``gate`` is +1: c_i -> -c_i c_g when it flips, a product of two coordinates. So
    s_k holds the answer in full, in a frame that differs from s_r's by a gated sign flip when
    r - k is odd. The codes' distribution is the same at every depth, and the product c_i c_3
    is uncorrelated with every coordinate, so neither marginal matching nor a paired affine
    translator recovers any of it: the affine maps see a gap they cannot repair, and the right
    answer is "not recovered by an affine change of frame" (distinct computation, or a
    non-affine shift), never "distinct computation".
    """
    r = _at_least(n_iterations, 2, "n_iterations")
    if len({*flipped, gate}) != 3 or not all(0 <= i < 4 for i in (*flipped, gate)):
        raise ConfigError(f"flipped={flipped} and gate={gate} must be three distinct of 0..3.")
    cfg = _base_config(4, 16, r, 12)
    model = _blank(cfg)
    bits = (torch.arange(16)[:, None] >> torch.arange(4)) & 1
    codes = 2.0 * bits.float() - 1.0  # [16, 4], token t's code; every state has RMS 1
    sharpness = 2000.0  # |z| = (gelu(cz) + gelu(-cz)) / c, exact for z in {0, +-2}
    with torch.no_grad():
        model.embed.W_E.copy_(codes)
        mlp = model._core[0][0].mlp
        for n, i in enumerate(flipped):  # delta c_i = -c_i - c_i c_g (the flip where c_g = +1)
            linear, product = 2 * n, 4 + 4 * n
            mlp.W_in[i, linear], mlp.W_in[i, linear + 1] = 1.0, -1.0
            mlp.W_out[linear, i], mlp.W_out[linear + 1, i] = -1.0, 1.0
            # c_i c_g = (|c_i + c_g| - |c_i - c_g|) / 2
            for unit, (a, b) in enumerate(((1, 1), (-1, -1), (1, -1), (-1, 1))):
                mlp.W_in[i, product + unit] = a * sharpness
                mlp.W_in[gate, product + unit] = b * sharpness
                sign = -1.0 if unit < 2 else 1.0
                mlp.W_out[product + unit, i] = sign / (2.0 * sharpness)
        model.unembedding.copy_(3.0 * codes.T)  # logit of answer j: 3 <code_j, s>
    model.planted_task = PlantedTask(torch.arange(16), 16, seed)
    return model


def frame_warp(
    n_iterations: int = 8, seed: int = 0, magnitudes: tuple[float, float] = (0.5, 1.5)
) -> PlantedModel:
    """Ambiguous: an invertible elementwise warp of the frame (truth S = 1, not identifiable).

    The state is [x (2), carrier]: the answer's code, each coordinate at one of the levels
    +-m_1, +-m_2 (``magnitudes``, default 0.5 and 1.5; 16 answers). Each iteration warps every
    coordinate by w, which swaps the two magnitudes and keeps the sign (w(x) = (m_1 + m_2)
    sign(x) - x on the levels, its own inverse). Nothing is computed: s_k holds the answer in
    full, in s_r's frame when r - k is even and warped when it is odd. The levels' distribution
    is the same at every depth (no marginal map sees the warp), and w is not affine (at the
    default levels the best affine fit of w(x) from x has slope 0.6), so the affine maps
    recover little of the gap: the right answer is "not recovered by an affine change of
    frame", never "distinct computation".
    """
    r = _at_least(n_iterations, 2, "n_iterations")
    small, large = (float(m) for m in magnitudes)
    if not 0.1 <= small < large <= 3.0:
        raise ConfigError(f"magnitudes={magnitudes} must be two levels 0.1 <= m_1 < m_2 <= 3.")
    levels = torch.tensor([-large, -small, small, large])
    total = small + large
    codes = torch.stack([levels.repeat_interleave(4), levels.repeat(4)], 1)  # [16, 2]
    d_model = 3
    cfg = _base_config(d_model, 16, r, 10)
    model = _blank(cfg)
    carrier = 2
    carrier_size = 100.0  # dominates the norm: the warp moves the RMS by < 0.02%
    rms = math.sqrt((carrier_size**2 + small**2 + large**2) / d_model)  # mean code norm^2
    sharpness = 100.0 / (small / rms)  # clip(c u, -1, 1) is sign(x) for |x| >= m_1
    with torch.no_grad():
        model.embed.W_E[:, :2] = codes
        model.embed.W_E[:, carrier] = carrier_size
        mlp = model._core[0][0].mlp
        for i in (0, 1):  # delta x_i = (m_1 + m_2) sign(x_i) - 2 x_i
            base = 5 * i
            # sign(x) = gelu(c u + 1) - gelu(c u - 1) - 1, with the 1s from the carrier
            mlp.W_in[i, base], mlp.W_in[carrier, base] = sharpness, rms / carrier_size
            mlp.W_in[i, base + 1], mlp.W_in[carrier, base + 1] = sharpness, -rms / carrier_size
            mlp.W_out[base, i], mlp.W_out[base + 1, i] = total, -total
            # -2 x = -2 rms (gelu(u) - gelu(-u)); the constant -2 from the carrier unit below
            mlp.W_in[i, base + 2], mlp.W_in[i, base + 3] = 1.0, -1.0
            mlp.W_out[base + 2, i], mlp.W_out[base + 3, i] = -2.0 * rms, 2.0 * rms
            mlp.W_in[carrier, base + 4] = rms / carrier_size  # gelu(1) ~ 0.841: a constant unit
            mlp.W_out[base + 4, i] = -total / float(torch.nn.functional.gelu(torch.tensor(1.0)))
        # Nearest code: logit_j = beta (<code_j, x> - |code_j|^2 / 2), read from s / RMS(s).
        beta = 20.0
        W_U = torch.zeros(d_model, 16)
        W_U[:2] = beta * rms * codes.T
        W_U[carrier] = -beta * rms * (codes**2).sum(1) / (2.0 * carrier_size)
        model.unembedding.copy_(W_U)
    model.planted_task = PlantedTask(torch.arange(16), 16, seed)
    return model


def readout_shift_walk(
    size: int = 8, n_iterations: int = 8, seed: int = 0, strength: float = 3.0
) -> PlantedModel:
    """Ambiguous for the order of S and B: a constant per-step update (truth S = 1 or B = 1).

    The state is [answer one-hot (size), walk t, carrier]. Every iteration adds 1 to t (from the
    carrier), and the readout biases answer j's logit by lambda w_j (t - r): zero at full depth
    only. Nothing is computed. The shift is a translation along a line, so mean matching undoes
    it (S = gap taken first), and replaying any update walks the rest of the line to full depth
    (B = gap taken first): the two orders of S and B give 1 and 0, and the split of S and B is
    a convention, not a measurement. The right answer is inconclusive (the order decides).
    """
    n_answers = _at_least(size, 2, "size")
    r = _at_least(n_iterations, 2, "n_iterations")
    d_model = n_answers + 2
    n_inputs = 4 * n_answers
    cfg = _base_config(d_model, n_inputs, r, 2)
    model = _blank(cfg)
    walk, carrier = n_answers, n_answers + 1
    carrier_size = 100.0  # dominates the norm: the walk moves the RMS by < 0.4%
    answers = torch.arange(n_inputs) % n_answers
    rms = math.sqrt((1.0 + carrier_size**2) / d_model)
    with torch.no_grad():
        W_E = model.embed.W_E
        W_E[torch.arange(n_inputs), answers] = 1.0
        W_E[:, carrier] = carrier_size
        mlp = model._core[0][0].mlp
        mlp.W_in[carrier, 0], mlp.W_in[carrier, 1] = 1.0, -1.0
        mlp.W_out[0, walk] = rms / carrier_size
        mlp.W_out[1, walk] = -rms / carrier_size
        generator = torch.Generator().manual_seed(seed)
        directions = torch.randn(n_answers, generator=generator)
        W_U = torch.zeros(d_model, n_inputs)
        W_U[torch.arange(n_answers), torch.arange(n_answers)] = 4.0 * rms
        W_U[walk, :n_answers] = strength * rms * directions
        W_U[carrier, :n_answers] = -strength * rms * r * directions / carrier_size
        W_U[carrier, n_answers:] = -rms  # input-only tokens are never answers
        model.unembedding.copy_(W_U)
    model.planted_task = PlantedTask(answers, n_inputs, seed)
    return model


BUILDERS: dict[str, Callable[..., PlantedModel]] = {
    "readout_shift": readout_shift,
    "distinct_computation": distinct_computation,
    "block_count": block_count,
    "readout_shift_by_token_type": readout_shift_by_token_type,
    "readout_shift_by_position": readout_shift_by_position,
    "mixture_shift_distinct": mixture_shift_distinct,
    "mixture_shift_blocks": mixture_shift_blocks,
    "readout_shift_soft": readout_shift_soft,
    "distinct_computation_soft": distinct_computation_soft,
    "block_count_soft": block_count_soft,
    "distinct_computation_context": distinct_computation_context,
    "block_count_context": block_count_context,
    "frame_flip": frame_flip,
    "distinct_computation_skewed": distinct_computation_skewed,
    "mixture_three_way": mixture_three_way,
    "distinct_computation_smooth": distinct_computation_smooth,
    "readout_shift_step": readout_shift_step,
    "frame_flip_gated": frame_flip_gated,
    "frame_warp": frame_warp,
    "readout_shift_walk": readout_shift_walk,
}
# The factor behind the whole gap of each single-factor model; mixtures name both.
EXPECTED_FACTOR = {
    "readout_shift": "S",
    "distinct_computation": "D",
    "block_count": "B",
    "readout_shift_by_token_type": "S",
    "readout_shift_by_position": "S",
    "mixture_shift_distinct": "S+D",
    "mixture_shift_blocks": "S+B",
    "readout_shift_soft": "S",
    "distinct_computation_soft": "D",
    "block_count_soft": "B",
    "distinct_computation_context": "D",
    "block_count_context": "B",
    "frame_flip": "S",
    "distinct_computation_skewed": "D",
    "mixture_three_way": "S+B+D",
    "distinct_computation_smooth": "D",
    "readout_shift_step": "S",
    "frame_flip_gated": "S",
    "frame_warp": "S",
    "readout_shift_walk": "S",
}
# Whether the S and B brackets can identify the truth on the evaluation data (docs/bracket.md):
# False where a paired map can do the remaining computation (a permutation or flip of the state),
# where the base rate is a large part of the gap, or where replay's readout walks between answers;
# the bracket must then be flagged "not identified" at every k with a gap.
IDENTIFIABLE = {
    "readout_shift": True,
    "distinct_computation": False,
    "block_count": True,
    "readout_shift_by_token_type": True,
    "readout_shift_by_position": True,
    "mixture_shift_distinct": False,
    "mixture_shift_blocks": True,
    "readout_shift_soft": True,
    "distinct_computation_soft": False,
    "block_count_soft": True,
    "distinct_computation_context": True,
    "block_count_context": True,
    "frame_flip": False,
    "distinct_computation_skewed": False,
    "mixture_three_way": False,
    "distinct_computation_smooth": False,
    "readout_shift_step": True,
    "frame_flip_gated": False,
    "frame_warp": False,
    "readout_shift_walk": False,
}

# The suite the point decomposition was validated on before the bracket; `dcp-lens validate`
# judges every model of BRACKET_PLANTED by the bracket rule (docs/validation.md).
PLANTED = tuple(name for name in BUILDERS if name not in ("distinct_computation_context",
    "block_count_context", "frame_flip", "distinct_computation_skewed", "mixture_three_way",
    "distinct_computation_smooth", "readout_shift_step", "frame_flip_gated",
    "frame_warp", "readout_shift_walk"))  # fmt: skip
BRACKET_PLANTED = tuple(BUILDERS)


def expected_shares(
    name: str, model: PlantedModel, evaluation: EvaluationSet, metric: str, k_grid: Sequence[int]
) -> dict[str, float]:
    """The true S, B, D shares of planted model ``name``'s truncation gap area over ``k_grid``.

    A single-factor model's gap is its factor's by construction (1 for it, 0 for the others). A
    mixture's gap at every k is the sum of its mechanisms' gaps over their own positions (no
    position interacts with another), so the true share of a factor is the area of the gap on its
    positions over the whole gap's area, measured on ``evaluation`` from truncation alone.
    """
    task = model.planted_task
    if task.factors is None:
        factor = EXPECTED_FACTOR.get(name)
        if factor not in FACTORS:
            raise ValueError(f"{name!r} is not a single-factor planted model of {BRACKET_PLANTED}.")
        return {f: float(f == factor) for f in FACTORS}
    masks = task.factor_masks(evaluation.tokens)
    sign = 1.0 if HIGHER_IS_BETTER[metric] else -1.0
    areas = dict.fromkeys(FACTORS, 0.0)
    with torch.no_grad():
        states, full_logits = capture_states(model, evaluation.tokens)
        full_log_probs = full_logits.log_softmax(-1)
        for factor, mask in masks.items():
            targets = torch.where(mask, evaluation.targets, IGNORE_INDEX)
            count = mask.sum(-1).to(full_logits.dtype)

            def total(logits: Tensor, targets: Tensor = targets, count: Tensor = count) -> float:
                means = per_example_metrics(logits, full_log_probs, targets, (metric,))[metric]
                return float((means * count).sum())

            full = total(full_logits)
            areas[factor] = sum(sign * (full - total(model.readout(states[k]))) for k in k_grid)
    gap = sum(areas.values())
    return {f: areas[f] / gap if gap else math.nan for f in FACTORS}


def load_planted(name: str, **overrides: object) -> PlantedModel:
    """``load("planted:NAME", size=…, n_iterations=…, seed=…)``."""
    if name not in BUILDERS:
        raise ConfigError(f"unknown planted model {name!r}; choose one of {BRACKET_PLANTED}.")
    fields = dict(overrides)
    device, dtype = fields.pop("device", None), fields.pop("dtype", None)
    builder = BUILDERS[name]
    accepted = [p for p in inspect.signature(builder).parameters if p not in ("device", "dtype")]
    unknown = sorted(set(fields) - set(accepted))
    if unknown:
        raise ConfigError(
            f"planted:{name} takes no {', '.join(unknown)}; its options are {accepted}, device "
            "and dtype."
        )
    hints = typing.get_type_hints(builder)
    for field, value in fields.items():
        wanted = hints.get(field)
        kinds = (int, float) if wanted is float else (wanted,) if wanted is int else None
        if kinds is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
            raise ConfigTypeError(
                f"planted:{name} option {field}={value!r:.40} must be "
                f"{'a number' if wanted is float else 'an int'}."
            )
    target = None if device is None else check_device(device)
    kind = None if dtype is None else check_dtype(dtype)
    model = builder(**fields)  # type: ignore[arg-type]
    if target or kind:
        model = model.to(device=target, dtype=kind)
    # Planted models number their symbols themselves: <0>, <1>, … give them strings.
    model.tokenizer = VocabularyTokenizer([f"<{i}>" for i in range(model.cfg.d_vocab)])
    return model


def _at_least(value: object, minimum: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(f"{name} must be an int, got {value!r}.")
    if value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}.")
    return value
