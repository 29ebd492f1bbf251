"""The confidence-matching stage: per (sweep condition, k), the temperature that gives its
readout full depth's mean entropy on the calibration split (label-free), so the loss metrics
compare what the readouts rank, not how confident a shifted frame makes them."""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor

from dcp_lens.protocol.budget import ReadoutPlan, in_smaller_chunks, stage_stop_message
from dcp_lens.protocol.calibration import all_finite
from dcp_lens.protocol.conditions import SWEEP, Condition, MapLookup
from dcp_lens.protocol.context import RunContext
from dcp_lens.protocol.evaluation_set import EvaluationSet
from dcp_lens.protocol.metrics import IGNORE_INDEX
from dcp_lens.protocol.readout import readouts
from dcp_lens.protocol.states import capture_states

# Per (sweep condition, k): the temperature of its readout (1.0: unmatched).
Temperatures = dict[tuple[str, int], float]


class ConfidenceMatching:
    """Fits `Temperatures` on the first `budget` scored positions of the calibration split.

    ``stash`` maps a calibration batch index to the (states, full logits) of each piece this
    stage reads of it (`pieces`), kept by the fit stage so that no forward pass is repeated.
    """

    def __init__(self, context: RunContext) -> None:
        self.context = context
        self.stash: dict[int, list[tuple[Tensor, Tensor]]] = {}
        self._stashing = False

    def start_stash(self) -> None:
        """Stash what `fit` reads of each calibration batch `stash_batch` is given from now."""
        self.stash, self._stashing = {}, True

    def stash_batch(
        self,
        calibration: EvaluationSet,
        index: int,
        rows: slice,
        states: Float[Tensor, "r_plus_1 batch pos d_model"],
    ) -> None:
        """Keep what `fit` reads of calibration batch ``index`` (rows ``rows``, its states
        ``states``); nothing once a batch past the budget was seen (later ones are not read)."""
        if not self._stashing:
            return
        pieces = self.pieces(calibration, index, rows)
        self._stashing = pieces is not None
        if pieces:
            self.stash[index] = self.keep(states, pieces, rows.start)

    @torch.no_grad()
    def fit(self, calibration: EvaluationSet, fitted: MapLookup) -> Temperatures:
        """Fit each condition's temperature so that its readout's mean entropy over scored
        positions of the calibration split equals full depth's (Newton and bisection on log T).

        Label-free: only the readouts' own distributions are used. Scaling logits does not move
        the argmax, so accuracy and top-1 agreement are unchanged."""
        context = self.context
        # Only the conditions given a temperature are read out (not the translators, fitted to
        # full depth's confidence already, nor the base rate).
        built = {k: matched(k, fitted) for k in context.k_grid}
        batch = min(context.config.batch_size, max(1, len(calibration)))
        positions = int(calibration.tokens.shape[1])
        (full_kept, kept), _ = in_smaller_chunks(
            lambda plan: self._read(calibration, built, plan),
            context.readout_plan(calibration),
            lambda plan: plan.halved(batch, positions),
            context.device(),
            lambda plan: stage_stop_message(
                "confidence matching",
                str(context.device()),
                "reading one condition of one example per readout call",
                "--resume does not read the calibration split again (with a --resume snapshot "
                "folder).",
                "--no-match-confidence or a shorter --k grid",
            ),
        )
        self.stash = {}
        reference = mean_entropy(torch.cat(full_kept), 1.0)
        return {
            cell: matching_temperature(torch.cat(chunks), reference)
            for cell, chunks in kept.items()
        }

    def _read(
        self,
        calibration: EvaluationSet,
        built: dict[int, dict[str, Condition | None]],
        plan: ReadoutPlan,
    ) -> tuple[list[Tensor], dict[tuple[str, int], list[Tensor]]]:
        """Full depth's logits and every matched condition's, at the scored positions
        confidence matching reads, read out in calls of ``plan.rows`` positions at most."""
        context = self.context
        kept: dict[tuple[str, int], list[Tensor]] = {}
        full_kept: list[Tensor] = []
        # The positions read: the first `budget` scored positions of the leading calibration
        # sequences, in order. Their states were kept by the fit stage (or, after a resume or on
        # another rank, are recomputed in the same batches, so the same bytes).
        for index, rows in enumerate(calibration.batches(context.config.batch_size)):
            pieces = self.pieces(calibration, index, rows)
            if pieces is None:
                break
            stashed = self.stash.get(index)
            if stashed is None:
                tokens = calibration.tokens[rows].to(context.device())
                states, _ = capture_states(context.model, tokens, stop_after_last=True)
                stashed = self.keep(states, pieces, rows.start)
            for (states, full_logits), (sequences, positions) in zip(stashed, pieces, strict=True):
                targets = calibration.targets[sequences][:, :positions].to(context.device())
                scored = targets != IGNORE_INDEX
                full_kept.append(full_logits[scored].float())
                for k in context.k_grid:
                    read = readouts(context.model, context.r, states, built[k], full_logits, plan)
                    for name, logits in read.items():
                        kept.setdefault((name, k), []).append(logits[scored].float())
                    del read
        return full_kept, kept

    def pieces(
        self, calibration: EvaluationSet, index: int, rows: slice
    ) -> list[tuple[slice, int]] | None:
        """What confidence matching reads of calibration batch ``index`` (rows ``rows``):
        (sequences, leading positions) pieces, the sequences read whole and then the one the
        budget ends in, cut after its last position needed (a causal readout's logits at a
        position do not depend on later ones); None once the budget is reached before it."""
        scored = (calibration.targets[: rows.stop] != IGNORE_INDEX).sum(-1)
        budget, before = self.budget(calibration), int(scored[: rows.start].sum())
        if before >= budget:
            return None
        pieces: list[tuple[slice, int]] = []
        room, length = budget - before, calibration.tokens.shape[1]
        whole = rows.start
        while whole < rows.stop and int(scored[whole]) < room:
            room -= int(scored[whole])
            whole += 1
        if whole > rows.start:
            pieces.append((slice(rows.start, whole), length))
        if whole < rows.stop:  # the budget ends in this sequence
            mask = calibration.targets[whole] != IGNORE_INDEX
            positions = int(torch.nonzero(mask.cumsum(0) >= room)[0]) + 1
            pieces.append((slice(whole, whole + 1), positions))
        return pieces

    def keep(
        self, states: Tensor, pieces: list[tuple[slice, int]], start: int = 0
    ) -> list[tuple[Tensor, Tensor]]:
        """Each piece's states (copies: a view would keep the whole batch alive) and full-depth
        logits; ``states`` are a batch's whose first sequence is number ``start``."""
        stashed = []
        for sequences, positions in pieces:
            local = slice(sequences.start - start, sequences.stop - start)
            kept = states[:, local, :positions].clone()
            stashed.append((kept, self.context.model.readout(kept[-1])))
        return stashed

    def budget(self, calibration: EvaluationSet) -> int:
        """Scored positions confidence matching reads."""
        # A few hundred scored positions fix a mean entropy well; the cost is cells x steps x
        # positions x vocabulary, so wide vocabularies get fewer positions.
        vocabulary = int(getattr(getattr(self.context.model, "cfg", None), "d_vocab", 1))
        return max(64, min(256, (1 << 18) // max(1, vocabulary)))


def matched(k: int, fitted: MapLookup) -> dict[str, Condition | None]:
    """The sweep conditions at ``k`` that confidence matching fits a temperature to (None: a map
    it needs could not be fitted; its temperature is then 1.0)."""
    built = {name: entry.build(k, fitted) for name, entry in SWEEP.items()}
    return {
        name: condition
        for name, condition in built.items()
        if condition is None or condition.matches_confidence
    }


def mean_entropy(logits: Float[Tensor, "n d_vocab"], temperature: float) -> float:
    """Mean entropy of softmax(logits / temperature) over the rows."""
    return _entropy_and_slope(logits, math.log(temperature))[0]


def _entropy_and_slope(logits: Float[Tensor, "n d_vocab"], log_t: float) -> tuple[float, float]:
    """Mean entropy H of softmax(logits / T) at T = exp(log_t), and dH/dlog T.

    With p = softmax(z / T): dH/dlog T = Var_p(z / T) = Var_p(log p), the variance of the log-
    probabilities under p (>= 0: entropy rises with T)."""
    log_probs = (logits * math.exp(-log_t)).log_softmax(-1)
    weighted = log_probs.exp() * log_probs  # p log p
    entropy = -weighted.sum(-1)
    variance = (weighted * log_probs).sum(-1) - entropy.square()
    return float(entropy.mean()), float(variance.clamp_min(0.0).mean())


TEMPERATURE_RANGE = (math.log(1e-3), math.log(1e3))


def matching_temperature(logits: Float[Tensor, "n d_vocab"], entropy: float) -> float:
    """The temperature T at which softmax(logits / T) has mean entropy ``entropy`` (Newton on
    log T, kept inside a shrinking bracket of [1e-3, 1e3] by bisection; the nearer end where it is
    out of reach; 1.0 if non-finite). Solved to 1e-6 of ``entropy`` (or of max(1, entropy))."""
    if not all_finite(logits) or not math.isfinite(entropy) or not len(logits):
        return 1.0
    tolerance = 1e-6 * max(1.0, entropy)
    low, high = TEMPERATURE_RANGE
    log_t = 0.0  # T = 1 first: full depth itself (and replay(r) = truncate(r)) is matched there
    for _ in range(100):
        value, slope = _entropy_and_slope(logits, log_t)
        if not math.isfinite(value) or abs(value - entropy) <= tolerance:
            break
        if value < entropy:  # entropy rises with T
            low = log_t
        else:
            high = log_t
        if high - low <= 1e-9:
            break
        step = log_t - (value - entropy) / slope if slope > 0.0 else math.nan
        # Newton's step where it stays strictly inside the bracket, else halve the bracket.
        log_t = step if low < step < high else (low + high) / 2
    return math.exp(log_t)
