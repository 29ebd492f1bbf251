"""`DepthControlProtocol`: every condition of DCP at every k, fast, and the decomposition.

The sweep is fast by construction. One full-depth pass per batch records every iteration's state
s_0..s_r; every condition of `dcp_lens.protocol.conditions.SWEEP` is then a readout of the state
its closed
form builds from them (`Condition.readout_input`):

==========================  =================================================================
truncate(k)                 readout(s_k)
replay(k)                   readout(s_k + (r - k) Delta_k)
calibrate_truncate(k)       readout(cal_trunc_k(s_k))
calibrate_replay(k)         readout(cal_replay_k(s_k + (r - k) Delta_k))
shift(k)                    readout(cal_trunc_k^-1(s_r))
==========================  =================================================================

``readout`` runs only PreCoda, coda, final norm and unembedding. `condition_logits` computes the
same conditions through their hooks (`Condition.fwd_hooks`) on a full forward; tests check the two
agree for every registered condition. Memory is bounded by the batch: states are kept for one
batch at a time, and only fixed-size subsamples are kept for the probe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from dcp_lens.protocol.calibration import (
    AffineCalibration,
    MixtureCalibration,
    StreamingMoments,
    all_finite,
    fit_calibration,
)
from dcp_lens.protocol.conditions import SWEEP, Condition, Full, ProtocolModel, Truncate
from dcp_lens.protocol.decomposition import decompose
from dcp_lens.protocol.metrics import (
    HIGHER_IS_BETTER,
    IGNORE_INDEX,
    LOSS_METRICS,
    METRICS,
    NEEDS_ANSWERS,
    VALIDATION,
    per_example_metrics,
    reference_log_probs,
)
from dcp_lens.protocol.probe import ResidualOODProbe
from dcp_lens.protocol.results import ProtocolResults
from dcp_lens.protocol.states import capture_states
from dcp_lens.utils import distributed
from dcp_lens.utils.checks import check_targets
from dcp_lens.utils.memory import release_free_memory
from dcp_lens.utils.snapshots import Checkpoint


@dataclass
class EvaluationSet:
    """Token sequences, the positions whose predictions are scored, and their answers.

    ``targets[i, p]`` is what the logits at position p of example i should predict, or -100 where
    position p is not scored. Build one with `from_task_batch` (task data with answers) or
    `from_tokens` (language modelling: the next token is the target; no accuracy).
    """

    tokens: Int[Tensor, "n pos"]
    targets: Int[Tensor, "n pos"]
    attention_mask: Bool[Tensor, "n pos"] | None = None
    has_answers: bool = True
    metadata: dict[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tokens.ndim != 2 or self.tokens.shape[0] == 0 or self.tokens.shape[1] == 0:
            raise ValueError(
                f"the evaluation set is empty or not [n, pos]: tokens have shape "
                f"{tuple(self.tokens.shape)}; pass at least one sequence."
            )
        if self.targets.shape != self.tokens.shape:
            raise ValueError(
                f"targets {tuple(self.targets.shape)} must have the shape of tokens "
                f"{tuple(self.tokens.shape)} (-100 where a position is not scored)."
            )
        check_targets(self.targets, None, "the evaluation set's targets")
        if not bool(self.scored.any()):
            raise ValueError("no position is scored: every target is -100.")
        if self.attention_mask is not None and bool((self.scored & ~self.attention_mask).any()):
            raise ValueError("a scored position is padding (attention_mask is False there).")

    @classmethod
    def from_task_batch(cls, batch: Any) -> EvaluationSet:
        """From a `dcp_lens.tasks.TaskBatch` (tokens, targets with -100, attention mask)."""
        metadata = dict(getattr(batch, "metadata", {}) or {})
        return cls(
            batch.tokens, batch.targets, getattr(batch, "attention_mask", None), True, metadata
        )

    @classmethod
    def from_tokens(
        cls,
        tokens: Int[Tensor, "n pos"],
        scored_positions: Int[Tensor, "n m"] | Sequence[Sequence[int]] | None = None,
    ) -> EvaluationSet:
        """Language modelling: logits at p predict tokens[p + 1]. ``scored_positions`` (indices
        in 0..pos-2 per example) restricts scoring; by default every position but the last."""
        if tokens.ndim != 2 or tokens.shape[0] == 0 or tokens.shape[1] < 2:
            raise ValueError(
                f"the evaluation set is empty or too short: tokens have shape "
                f"{tuple(tokens.shape)}; language modelling needs [n >= 1, pos >= 2]."
            )
        targets = torch.full_like(tokens, IGNORE_INDEX)
        if scored_positions is None:
            targets[:, :-1] = tokens[:, 1:]
        else:
            positions = torch.as_tensor(scored_positions, dtype=torch.long)
            n_pos = tokens.shape[1]
            if positions.ndim != 2 or positions.shape[0] != tokens.shape[0]:
                raise ValueError(f"scored_positions must be [n={tokens.shape[0]}, m].")
            if bool(((positions < 0) | (positions > n_pos - 2)).any()):
                bad = positions[(positions < 0) | (positions > n_pos - 2)][0].item()
                raise ValueError(
                    f"scored position {bad} is outside the sequence: positions 0..{n_pos - 2} "
                    f"have a next token (sequence length {n_pos})."
                )
            rows = torch.arange(tokens.shape[0])[:, None].expand_as(positions)
            targets[rows, positions] = tokens[rows, positions + 1]
        return cls(tokens, targets, None, has_answers=False)

    @property
    def scored(self) -> Bool[Tensor, "n pos"]:
        return self.targets != IGNORE_INDEX

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def batches(self, batch_size: int) -> list[slice]:
        return [slice(i, min(i + batch_size, len(self))) for i in range(0, len(self), batch_size)]

    def example_keys(self) -> Int[Tensor, " n"]:
        """One non-negative int64 per example, a hash of its tokens up to padding: what keys an
        example's noise, probe sampling and bootstrap order, so none of them depends on the
        batch size or the order of the examples."""
        keys = [int(digest[:15], 16) for digest in self._digests()]
        return torch.tensor(keys, dtype=torch.int64)

    def _digests(self) -> list[str]:
        rows = []
        for i in range(len(self)):
            row = self.tokens[i]
            if self.attention_mask is not None:
                row = row[self.attention_mask[i]]
            rows.append(hashlib.sha1(row.cpu().numpy().tobytes()).hexdigest())
        return rows

    def fingerprints(self) -> set[str]:
        """One hash per example (its tokens up to padding), to detect overlapping splits."""
        return set(self._digests())


StateMapLike = AffineCalibration | MixtureCalibration
CALIBRATION_MODES = ("mean", "diag", "full", "mixture")

# Logit difference (nats) below which replay(k) and truncate(k) count as the same readout: B and
# I_BS are then zero by construction (a norm at the readout ignores replay's scaling), not found.
B_IDENTIFICATION_TOLERANCE = 1e-3


class DepthControlProtocol:
    """Run DCP on one model (recurrent or dense) and decompose its truncation gap.

    Args:
        model: a `HookedRecurrentTransformer`, or any `dcp_lens.protocol.conditions.ProtocolModel`
            (``n_iterations``, ``is_dense``, ``state_hook_name``, ``readout_hook_name``,
            ``readout``, ``run_with_hooks``), e.g. a dense TransformerLens bridge.
        k_grid: iteration counts to test (default: every k in 1..r when r <= 8, else 1, 2, 3, 4
            and a geometric grid (x1.5) up to and including r).
        metrics: any of ``"accuracy"`` (needs answers), ``"cross_entropy"``, ``"kl_to_full"``;
            default: all that the evaluation set defines.
        calibration_mode: the S control's label-free map: ``"mean"``, ``"diag"``, ``"full"``
            (pooled affine: whiten and re-colour) or ``"mixture"`` (optimal transport between
            Gaussian mixtures of the two marginals, for shifts that differ between inputs).
        mixture_components: clusters of the ``"mixture"`` map.
        calibration_points: states per condition kept to fit the ``"mixture"`` map.
        match_confidence: score the loss metrics (``cross_entropy``, ``kl_to_full``) on readouts
            whose temperature is matched, label-free on the calibration split, to full depth's
            mean entropy: the frame's repair is then not confused with a change of confidence.
        noise_draws: with a noisy initial state (``state_init`` ``normal`` / ``huginn``), the
            evaluation is repeated with this many noise draws and each example's values are
            averaged over them, so the intervals (over examples) include the noise's variance.
            An example's noise is keyed by the seed and its tokens, never by its batch slot.
        batch_size: sequences per forward pass.
        n_bootstrap: paired bootstrap draws for the intervals.
        probe: ``"trajectory"`` (probe s_t for every t and calibrate(truncate(k))), ``"none"``.
        probe_points: states per side kept for the probe (a random subsample).
        skip_first_position: leave position 0 out of the calibration statistics (attention sinks).
        spec: the model's name in the results (default: the spec it was loaded with,
            ``model.spec``, else ``"model"``).
        checkpoint: where the calibration and evaluation loops snapshot what they have
            accumulated, and resume from (`dcp_lens.utils.snapshots.Checkpoint`); None: no
            snapshots.
    """

    def __init__(
        self,
        model: ProtocolModel,
        *,
        k_grid: Sequence[int] | None = None,
        metrics: Sequence[str] | None = None,
        calibration_mode: str = "full",
        mixture_components: int = 8,
        calibration_points: int = 4096,
        match_confidence: bool = True,
        noise_draws: int = 1,
        batch_size: int = 32,
        n_bootstrap: int = 1000,
        seed: int = 0,
        probe: str = "trajectory",
        probe_points: int = 2000,
        skip_first_position: bool = False,
        spec: str | None = None,
        progress: bool = True,
        checkpoint: Checkpoint | None = None,
    ) -> None:
        self.model = model
        self.r = int(model.n_iterations)
        self.k_grid = self._check_grid(k_grid)
        if metrics is not None and (not metrics or any(m not in METRICS for m in metrics)):
            raise ValueError(f"metrics {list(metrics)} must be a non-empty subset of {METRICS}.")
        if probe not in ("trajectory", "none"):
            raise ValueError(f"probe={probe!r} must be 'trajectory' or 'none'.")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1.")
        self.requested_metrics = None if metrics is None else tuple(metrics)
        self.metrics: tuple[str, ...] = self.requested_metrics or METRICS
        if calibration_mode not in CALIBRATION_MODES:
            raise ValueError(
                f"calibration_mode={calibration_mode!r} is not one of {CALIBRATION_MODES}."
            )
        self.calibration_mode = calibration_mode
        self.mixture_components = mixture_components
        self.calibration_points = calibration_points
        self.match_confidence = match_confidence
        if isinstance(noise_draws, bool) or not isinstance(noise_draws, int) or noise_draws < 1:
            raise ValueError(f"noise_draws={noise_draws!r} must be an int >= 1.")
        self.noise_draws = noise_draws
        # Per (sweep condition, k): the temperature that gives its readout full depth's mean
        # entropy on the calibration split (loss metrics only; 1.0 without matching).
        self.temperatures: dict[tuple[str, int], float] = {}
        # Calibration batch index -> (states, full logits) of each piece confidence matching
        # reads of it (`_temperature_pieces`), kept by `fit` so that it needs no forward pass.
        self._temperature_states: dict[int, list[tuple[Tensor, Tensor]]] = {}
        self.batch_size = batch_size
        self.n_bootstrap = n_bootstrap
        self.seed = seed
        self.probe_mode = probe
        self.probe_points = probe_points
        self.skip_first_position = skip_first_position
        self.spec = spec if spec is not None else str(getattr(model, "spec", None) or "model")
        self.progress = progress
        self.checkpoint = checkpoint
        # Fitted maps keyed by the label of the condition they were fitted from (at depth r:
        # ``"full"`` is calibrate(full)); None where that condition's states were non-finite.
        self.calibrations: dict[str, StateMapLike | None] | None = None
        self.calibration_null: StateMapLike | None = None
        self.probe: ResidualOODProbe | None = None
        # Per k, max |readout(replay(k)) - readout(truncate(k))| over the evaluation set.
        self._replay_difference: dict[int, float] = {}

    # ------------------------------------------------------------------------ public API

    def run(
        self, evaluation: EvaluationSet | Any, calibration: EvaluationSet | Any
    ) -> ProtocolResults:
        """Fit the calibrations on ``calibration``, evaluate every condition on ``evaluation``
        and decompose. The two sets must not share an example. Task batches
        (`dcp_lens.tasks.TaskBatch`) are converted with `EvaluationSet.from_task_batch`."""
        evaluation = _as_evaluation_set(evaluation, "evaluation")
        calibration = _as_evaluation_set(calibration, "calibration")
        self._check_sets(evaluation, calibration)
        was_training = getattr(self.model, "training", False)
        self.model.eval()
        try:
            with torch.no_grad():
                probe_reference = self.fit(calibration)
                if self._matches_confidence():
                    self._fit_temperatures(calibration)
                values, null_control, probe_states = self._evaluate(evaluation)
                for draw in range(1, self._noise_draws()):
                    with _noise_seed(self.model, draw):
                        more, _, _ = self._evaluate(evaluation, f"evaluation.{draw}")
                    values = _accumulate(values, more)
                if self._noise_draws() > 1:
                    values = _scale(values, 1.0 / self._noise_draws())
                # The bootstrap resamples positions in this order: make it the examples' own.
                values = _reorder(values, torch.argsort(evaluation.example_keys(), stable=True))
                if distributed.is_main():
                    probe_summary = self._probe(probe_reference, probe_states)
        finally:
            self.model.train(was_training)
        if not distributed.is_main():  # rank 0 decomposes; every rank returns its results
            return distributed.broadcast_from_main(None)
        flags = self._identification(probe_summary)
        decompositions = {
            metric: dataclasses.replace(
                decompose(
                    values[metric],
                    self.k_grid,
                    n_iterations=self.r,
                    metric=metric,
                    higher_is_better=HIGHER_IS_BETTER[metric],
                    n_bootstrap=self.n_bootstrap,
                    seed=self.seed,
                ),
                **flags,
                validated=VALIDATION[metric][0],
                validation_reason=VALIDATION[metric][1],
            )
            for metric in self.metrics
        }
        probe_summary["s_rank_correlation"] = _probe_s_rank_correlation(
            probe_summary, decompositions[self.metrics[0]]
        )
        results = ProtocolResults(
            model=self.spec,
            architecture="dense" if self.model.is_dense else "recurrent",
            n_iterations=self.r,
            decompositions=decompositions,
            null_control=null_control,
            probe=probe_summary,
            calibration=self._calibration_record(),
            metadata={
                "k_grid": list(self.k_grid),
                "calibration_mode": self.calibration_mode,
                "n_evaluation": len(evaluation),
                "n_calibration": len(calibration),
                "seed": self.seed,
                "skip_first_position": self.skip_first_position,
                "calibration_failures": self._calibration_failures(),
                "noise_draws": self._noise_draws(),
                "replay_truncate_max_abs_logit_diff": {
                    str(k): self._replay_difference.get(k, math.nan) for k in self.k_grid
                },
                "b_identification_tolerance": B_IDENTIFICATION_TOLERANCE,
                "calibration_fallbacks": self._calibration_fallbacks(),
            },
        )
        return distributed.broadcast_from_main(results)

    @torch.no_grad()
    def _fit_temperatures(self, calibration: EvaluationSet) -> None:
        """Fit each condition's temperature so that its readout's mean entropy over scored
        positions of the calibration split equals full depth's (bisection on log T).

        Label-free: only the readouts' own distributions are used. Scaling logits does not move
        the argmax, so accuracy and top-1 agreement are unchanged; the loss metrics then compare
        what the readouts rank, not how confident a shifted frame makes them."""
        kept: dict[tuple[str, int], list[Tensor]] = {}
        full_kept: list[Tensor] = []
        built = {k: self._sweep_at(k) for k in self.k_grid}
        # The positions read: the first `_temperature_budget` scored positions of the leading
        # calibration sequences, in order. Their states were kept by `fit` (or, after a resume or
        # on another rank, are recomputed in the same batches, so the same bytes).
        for index, rows in enumerate(calibration.batches(self.batch_size)):
            pieces = self._temperature_pieces(calibration, index, rows)
            if pieces is None:
                break
            stashed = self._temperature_states.get(index)
            if stashed is None:
                tokens = calibration.tokens[rows].to(self._device())
                states, _ = capture_states(self.model, tokens, stop_after_last=True)
                stashed = self._stash(states, pieces, rows.start)
            for (states, full_logits), (sequences, positions) in zip(stashed, pieces, strict=True):
                targets = calibration.targets[sequences][:, :positions].to(self._device())
                scored = targets != IGNORE_INDEX
                full_kept.append(full_logits[scored].float())
                for k in self.k_grid:
                    for name, logits in self._readouts(states, built[k], full_logits).items():
                        kept.setdefault((name, k), []).append(logits[scored].float())
        self._temperature_states = {}
        reference = _mean_entropy(torch.cat(full_kept), 1.0)
        self.temperatures = {
            cell: _matching_temperature(torch.cat(chunks), reference)
            for cell, chunks in kept.items()
        }

    def _temperature_pieces(
        self, calibration: EvaluationSet, index: int, rows: slice
    ) -> list[tuple[slice, int]] | None:
        """What confidence matching reads of calibration batch ``index`` (rows ``rows``):
        (sequences, leading positions) pieces, the sequences read whole and then the one the
        budget ends in, cut after its last position needed (a causal readout's logits at a
        position do not depend on later ones); None once the budget is reached before it."""
        scored = (calibration.targets[: rows.stop] != IGNORE_INDEX).sum(-1)
        budget, before = self._temperature_budget(calibration), int(scored[: rows.start].sum())
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

    def _stash(
        self, states: Tensor, pieces: list[tuple[slice, int]], start: int = 0
    ) -> list[tuple[Tensor, Tensor]]:
        """Each piece's states (copies: a view would keep the whole batch alive) and full-depth
        logits; ``states`` are a batch's whose first sequence is number ``start``."""
        stashed = []
        for sequences, positions in pieces:
            local = slice(sequences.start - start, sequences.stop - start)
            kept = states[:, local, :positions].clone()
            stashed.append((kept, self.model.readout(kept[-1])))
        return stashed

    def _temperature_budget(self, calibration: EvaluationSet) -> int:
        """Scored positions confidence matching reads."""
        # A few hundred scored positions fix a mean entropy well; the cost is cells x steps x
        # positions x vocabulary, so wide vocabularies get fewer positions.
        vocabulary = int(getattr(getattr(self.model, "cfg", None), "d_vocab", 1))
        return max(64, min(256, (1 << 18) // max(1, vocabulary)))

    def _matches_confidence(self) -> bool:
        return self.match_confidence and bool(set(self.metrics) & set(LOSS_METRICS))

    def _noise_draws(self) -> int:
        noisy = getattr(getattr(self.model, "cfg", None), "state_init", "zeros") in (
            "normal",
            "huginn",
        )
        return self.noise_draws if noisy else 1

    def _calibration_record(self) -> dict[str, Any]:
        """The S control's map and its settings, as results record them."""
        record: dict[str, Any] = {
            "mode": self.calibration_mode,
            "fitted_on": "the calibration split, without labels (marginals only)",
            "covariance": "Ledoit-Wolf shrinkage",
            "skip_first_position": self.skip_first_position,
        }
        if self.temperatures:
            record["confidence_matching"] = {
                "what": "loss metrics scored at the temperature giving full depth's mean entropy",
                "temperatures": {
                    name: {str(k): t for (n, k), t in self.temperatures.items() if n == name}
                    for name in dict.fromkeys(n for n, _ in self.temperatures)
                },
            }
        if self.calibration_mode == "mixture":
            record.update(
                components=self.mixture_components,
                calibration_points=self.calibration_points,
                plan="optimal transport between cluster weights, Wasserstein-2 (Bures) cost",
            )
        return record

    def _identification(self, probe: dict[str, Any]) -> dict[str, Any]:
        """Per k: is S identified (the calibrated truncated states pass the probe's null) and
        is B identified (replay(k) reads out differently from truncate(k))?"""
        by_k = {row["k"]: row for row in probe.get("calibrate_truncate", [])}
        auroc = np.array([by_k.get(k, {}).get("auroc", math.nan) for k in self.k_grid], float)
        threshold = np.array(
            [by_k.get(k, {}).get("auroc_threshold", math.nan) for k in self.k_grid], float
        )
        # Truncated states that are themselves indistinguishable from full depth have no shift to
        # repair (discrete states, as in planted distinct_computation, where any calibration
        # moves them off their lattice and the classifier sees that).
        raw = {row["iteration"]: row for row in probe.get("trajectory", [])}
        raw_auroc = np.array([raw.get(k, {}).get("auroc", math.nan) for k in self.k_grid], float)
        raw_threshold = np.array(
            [raw.get(k, {}).get("auroc_threshold", math.nan) for k in self.k_grid], float
        )
        replay = np.array([self._replay_difference.get(k, math.nan) for k in self.k_grid], float)
        with np.errstate(invalid="ignore"):
            repaired = np.isfinite(auroc) & (auroc <= threshold)
            unshifted = np.isfinite(raw_auroc) & (raw_auroc <= raw_threshold)
            return {
                "s_identified": repaired | unshifted,
                "b_identified": np.isfinite(replay) & (replay > B_IDENTIFICATION_TOLERANCE),
                "residual_auroc": auroc,
                "residual_auroc_threshold": threshold,
            }

    @torch.no_grad()
    def fit(self, calibration: EvaluationSet) -> Tensor | None:
        """Fit every calibration map the sweep's conditions ask for on the calibration split
        (streaming moments of each source condition's readout inputs against full depth's).

        Returns the probe's reference subsample of full-depth readout inputs (or None)."""
        sources: dict[str, Condition] = {"full": Full()}

        def wanted(source: Condition) -> _Pending:
            source = source.at_depth(self.r)
            sources.setdefault(source.label, source)
            return _Pending()

        for k in self.k_grid:
            for entry in SWEEP.values():
                entry.build(k, wanted)
        # One stream of moments per source; a stream that ever turns non-finite (replay can
        # explode) is dropped, and the conditions that need it are reported as non-finite.
        streams: dict[str, StreamingMoments | None] = {
            label: StreamingMoments() for label in sources
        }
        mixture = self.calibration_mode == "mixture"
        samples = {
            label: _Subsample(self.calibration_points, self.seed + 7 + i)
            for i, label in enumerate(sources if mixture else ())
        }
        sample = _Subsample(self.probe_points, self.seed)
        calibration_keys = calibration.example_keys()
        batches = distributed.assigned(calibration.batches(self.batch_size))
        done, saved = self._restore("calibration")
        if saved is not None:
            streams = {
                label: None if state is None else StreamingMoments.from_state(state)
                for label, state in saved["streams"].items()
            }
            for label, state in saved["samples"].items():
                samples[label].restore(state)
            sample.restore(saved["sample"])
        self._temperature_states = {}
        matching = self._matches_confidence()
        for batch_number, (index, rows) in enumerate(
            self._progress(batches[done:], "calibration"), start=done
        ):
            # Only the states: the maps are fitted to readout inputs, not to logits.
            states, _ = capture_states(
                self.model, calibration.tokens[rows].to(self._device()), stop_after_last=True
            )
            pieces = self._temperature_pieces(calibration, index, rows) if matching else None
            matching = pieces is not None  # past the budget, later batches are not read
            if pieces:
                self._temperature_states[index] = self._stash(states, pieces, rows.start)
            keep = self._pooled_positions(calibration, rows)
            pooled = states[:, keep]  # [r + 1, n_tokens, d]
            example, position = _row_ids(calibration_keys[rows], keep)
            sample.add(pooled[self.r], example, position)
            for label, moments in streams.items():
                if moments is None:
                    continue
                state = sources[label].readout_input(pooled)
                if all_finite(state):
                    moments.update(state)
                    if mixture:
                        samples[label].add(state, example, position)
                else:
                    streams[label] = None
            self._snapshot(
                "calibration", batch_number + 1, len(batches),
                lambda: {
                    "streams": {n: None if m is None else m.state() for n, m in streams.items()},
                    "samples": {label: s.state() for label, s in samples.items()},
                    "sample": sample.state(),
                },
            )  # fmt: skip
        if distributed.rank_and_world()[1] > 1:
            streams, samples, sample = _merged_fit(streams, samples, sample, self._device())
        reference = streams["full"]
        self.calibrations = {
            label: None
            if source is None or reference is None
            else self._fit_map(source, reference, samples.get(label), samples.get("full"))
            for label, source in streams.items()
        }
        self.calibration_null = self._fit_halves(sample)
        return sample.tensor()

    def _fit_map(
        self,
        source: StreamingMoments,
        reference: StreamingMoments,
        source_sample: _Subsample | None,
        reference_sample: _Subsample | None,
    ) -> StateMapLike:
        if self.calibration_mode != "mixture":
            return AffineCalibration.fit(source, reference, self.calibration_mode)
        assert source_sample is not None and reference_sample is not None
        source_states, reference_states = source_sample.tensor(), reference_sample.tensor()
        assert source_states is not None and reference_states is not None
        return MixtureCalibration.fit(
            source_states, reference_states, self.mixture_components, self.seed
        )

    def _fit_halves(self, sample: _Subsample) -> StateMapLike | None:
        """The real calibration null: the same kind of map fitted between two disjoint halves
        of the calibration split's full-depth states (even and odd examples). It should leave
        full depth's readout as it is; `calibrate(full)` fitted onto itself is the identity by
        construction and tests nothing."""
        states, groups = sample.tensor(), sample.groups()
        if states is None or groups is None or not bool(states.isfinite().all()):
            return None
        even = groups.to(states.device) % 2 == 0
        if int(even.sum()) < 8 or int((~even).sum()) < 8:
            return None
        first, second = states[even], states[~even]
        try:
            if self.calibration_mode == "mixture":
                return MixtureCalibration.fit(first, second, self.mixture_components, self.seed)
            return fit_calibration(first, second, self.calibration_mode)
        except ValueError:
            return None

    def fitted(self, source: Condition) -> StateMapLike | None:
        """The map fitted from ``source``'s readout inputs to full depth's (None: non-finite)."""
        calibrations = self._require_calibrations()
        label = source.at_depth(self.r).label
        if label not in calibrations:
            raise KeyError(
                f"no calibration was fitted from {label}; fitted: {sorted(calibrations)}. Fit "
                "again after changing k_grid or the registered sweep conditions."
            )
        return calibrations[label]

    def condition(self, name: str, k: int) -> Condition:
        """The condition ``name`` (``"full"`` or a `SWEEP` entry) at ``k``, with fitted maps."""
        if name == "full":
            return Full()
        if name not in SWEEP:
            raise ValueError(f"unknown condition {name!r}; expected full or one of {tuple(SWEEP)}.")
        self._check_k(k)
        built = SWEEP[name].build(k, self.fitted)
        if built is None:
            raise ValueError(
                f"{name}({k}) needs a calibration that could not be fitted: its states were "
                "non-finite on the calibration split."
            )
        return built

    def states(
        self, tokens: Int[Tensor, "batch pos"]
    ) -> tuple[Float[Tensor, "r_plus_1 batch pos d_model"], Float[Tensor, "batch pos d_vocab"]]:
        """One full-depth forward: every state s_0..s_r and the full logits."""
        return capture_states(self.model, tokens.to(self._device()))

    def readout_inputs(
        self, states: Float[Tensor, "r_plus_1 batch pos d_model"], condition: str, k: int
    ) -> Float[Tensor, "batch pos d_model"]:
        """The stream that reaches the readout under ``condition`` at ``k`` (fast path)."""
        return self.condition(condition, k).readout_input(states)

    def condition_logits(
        self, tokens: Int[Tensor, "batch pos"], condition: str, k: int, *, via: str = "fast"
    ) -> Float[Tensor, "batch pos d_vocab"]:
        """Logits of one condition, by the fast path (``via="fast"``) or by running the model
        with the condition's hooks (``via="hooks"``, what a notebook user would do)."""
        if via not in ("fast", "hooks"):
            raise ValueError(f"via={via!r} must be 'fast' or 'hooks'.")
        built = self.condition(condition, k)
        if via == "hooks":
            fwd_hooks = built.fwd_hooks(self.model)
            return self.model.run_with_hooks(tokens.to(self._device()), fwd_hooks=fwd_hooks)
        states, logits = self.states(tokens)
        if isinstance(built, Full):
            return logits
        return self.model.readout(built.readout_input(states))

    # ------------------------------------------------------------------------ internals

    def _evaluate(
        self, evaluation: EvaluationSet, stage: str = "evaluation.0"
    ) -> tuple[dict[str, dict[str, Any]], dict[str, Any], dict[str, Any]]:
        per_example: dict[tuple[str, str, int], list[Tensor]] = {}
        null: dict[str, float] = {name: 0.0 for name in SWEEP}
        n, points = len(evaluation), self.probe_points
        sample = _Subsample(points, self.seed + 1)
        trajectory = [_Subsample(points, self.seed + 2 + t) for t in range(self.r + 1)]
        calibrated = {k: _Subsample(points, self.seed + 1000 + k) for k in self.k_grid}
        evaluation_keys = evaluation.example_keys()
        built = {k: self._sweep_at(k) for k in {*self.k_grid, self.r}}
        halves_diff, halves_change = 0.0, dict[str, float]()
        batches = distributed.assigned(evaluation.batches(self.batch_size))
        done, saved = self._restore(stage)
        if saved is not None:
            per_example = {(m, c, int(k)): list(chunks) for m, c, k, chunks in saved["per_example"]}
            null, halves_diff = dict(saved["null"]), float(saved["halves_diff"])
            halves_change = dict(saved["halves_change"])
            self._replay_difference = {int(k): v for k, v in saved["replay_difference"].items()}
            sample.restore(saved["sample"])
            for t, state in enumerate(saved["trajectory"]):
                trajectory[t].restore(state)
            for k, state in saved["calibrated"].items():
                calibrated[int(k)].restore(state)

        def snapshot() -> dict[str, Any]:
            return {
                "per_example": [[*key, chunks] for key, chunks in per_example.items()],
                "null": null, "halves_diff": halves_diff, "halves_change": halves_change,
                "replay_difference": dict(self._replay_difference),
                "sample": sample.state(), "trajectory": [s.state() for s in trajectory],
                "calibrated": {k: s.state() for k, s in calibrated.items()},
            }  # fmt: skip

        for batch_number, (_, rows) in enumerate(
            self._progress(batches[done:], "evaluation"), start=done
        ):
            targets = evaluation.targets[rows].to(self._device())
            states, full_logits = self.states(evaluation.tokens[rows])
            scoring = _Reference.of(full_logits, targets)
            reference = self._record(per_example, ("full", 0), full_logits, scoring)
            at_r: dict[str, Tensor] | None = None
            for k in self.k_grid:
                readouts = self._readouts(states, built[k], full_logits)
                if k == self.r:
                    at_r = readouts
                for name, logits in readouts.items():
                    temperature = self.temperatures.get((name, k), 1.0)
                    tempered = logits if temperature == 1.0 else logits / temperature
                    self._record(per_example, (name, k), tempered, scoring)
                difference = _max_diff(readouts["replay"], readouts["truncate"])
                self._replay_difference[k] = _nan_max(
                    self._replay_difference.get(k, 0.0), difference
                )
            # The null control: at k = r every condition must reproduce full depth.
            if at_r is None:
                at_r = self._readouts(states, built[self.r], full_logits)
            for name, logits in at_r.items():
                null[name] = _nan_max(null[name], _max_diff(logits, full_logits))
            if self.calibration_null is not None:
                halves = self.model.readout(self.calibration_null(states[self.r]))
                halves_diff = _nan_max(halves_diff, _max_diff(halves, full_logits))
                moved = scoring.score(halves, self.metrics)
                for metric in self.metrics:
                    change = (moved[metric] - reference[metric]).double().sum()
                    halves_change[metric] = halves_change.get(metric, 0.0) + float(change)
            if self.probe_mode != "none":
                # Held-out reference from even examples, probed states from odd ones: a two-sample
                # test needs independent samples, not two views of the same sequences.
                # The example of each state goes along: the C2ST splits by example, since the
                # positions of one sequence share its content and are not independent draws.
                keep = self._pooled_positions(evaluation, rows)
                example, position = _row_ids(evaluation_keys[rows], keep)
                even = example % 2 == 0
                held_out = states[self.r][keep][even.to(keep.device)]
                sample.add(held_out, example[even], position[even])
                probed = states[:, keep][:, (~even).to(keep.device)]
                probed_examples, probed_positions = example[~even], position[~even]
                for t in range(self.r + 1):
                    trajectory[t].add(probed[t], probed_examples, probed_positions)
                for k in self.k_grid:
                    mapping = self.fitted(Truncate(k))
                    calibrated[k].add(_apply(mapping, probed[k]), probed_examples, probed_positions)
            self._snapshot(stage, batch_number + 1, len(batches), snapshot)
        if distributed.rank_and_world()[1] > 1:
            gathered = distributed.gather_to_main(
                ([i for i, _ in batches], per_example, null, halves_diff, halves_change,
                 self._replay_difference, sample, trajectory, calibrated)
            )  # fmt: skip
            if gathered is None:  # not rank 0: rank 0 decomposes
                return {}, {}, {}
            per_example, null, halves_diff, halves_change, sample, trajectory, calibrated = (
                self._merged_evaluation(gathered)
            )
        values: dict[str, dict[str, Any]] = {}
        for (metric, condition, k), chunks in per_example.items():
            vector = torch.cat(chunks).double().cpu()
            if condition == "full":
                values.setdefault(metric, {})["full"] = vector
            else:
                values.setdefault(metric, {}).setdefault(condition, {})[k] = vector
        full_map = self.fitted(Full())
        null_control: dict[str, Any] = {
            "max_abs_logit_diff": _nan_max(null.pop("truncate"), null.pop("replay")),
            "calibrate_full_max_abs_logit_diff": _nan_max(
                null.pop("calibrate_truncate"), null.pop("calibrate_replay")
            ),
            "shift_at_r_max_abs_logit_diff": null.pop("shift"),
            "calibrate_full_identity_deviation": (
                full_map.identity_deviation() if full_map is not None else math.nan
            ),
            **{f"{name}_at_r_max_abs_logit_diff": value for name, value in null.items()},
            "calibrate_full_halves_max_abs_logit_diff": (
                halves_diff if self.calibration_null is not None else math.nan
            ),
            "calibrate_full_halves_metric_change": {
                metric: halves_change.get(metric, math.nan) / n for metric in self.metrics
            },
        }
        probe_states: dict[str, Any] = {
            "held_out": sample.tensor(),
            "held_out_groups": sample.groups(),
            "trajectory": [(s.tensor(), s.groups()) for s in trajectory],
            "calibrate_truncate": {
                k: (calibrated[k].tensor(), calibrated[k].groups()) for k in self.k_grid
            },
        }
        return values, null_control, probe_states

    def _restore(self, stage: str) -> tuple[int, Any]:
        """Batches done and state of ``stage``'s last snapshot; ``(0, None)`` without one."""
        if self.checkpoint is None:
            return 0, None
        return self.checkpoint.restore(stage, self._device())

    def _snapshot(self, stage: str, done: int, total: int, state: Any) -> None:
        if self.checkpoint is not None:
            self.checkpoint.save(stage, done, total, state)

    def _merged_evaluation(self, gathered: list[Any]) -> tuple[Any, ...]:
        """Every rank's `_evaluate` accumulators combined on rank 0, as one process would have
        them: per-example chunks in batch order, maxima and sums over ranks, subsamples merged."""
        per_example: dict[tuple[str, str, int], list[Tensor]] = {}
        ordered = sorted(
            (index, key, chunks[position])
            for part in gathered
            for position, index in enumerate(part[0])
            for key, chunks in part[1].items()
        )
        for _, key, chunk in ordered:
            per_example.setdefault(key, []).append(chunk.to(self._device()))
        null = {name: _nan_max_all(part[2][name] for part in gathered) for name in SWEEP}
        halves_diff = _nan_max_all(part[3] for part in gathered)
        halves_change: dict[str, float] = {}
        for part in gathered:
            for metric, change in part[4].items():
                halves_change[metric] = halves_change.get(metric, 0.0) + change
        for k in self.k_grid:
            differences = [part[5][k] for part in gathered if k in part[5]]
            if differences:
                self._replay_difference[k] = _nan_max_all(differences)
        sample = _Subsample.merged([part[6] for part in gathered])
        trajectory = [
            _Subsample.merged([part[7][t] for part in gathered]) for t in range(self.r + 1)
        ]
        calibrated = {k: _Subsample.merged([part[8][k] for part in gathered]) for k in self.k_grid}
        return per_example, null, halves_diff, halves_change, sample, trajectory, calibrated

    def _sweep_at(self, k: int) -> dict[str, Condition | None]:
        """Every sweep condition at k (None where a map it needs could not be fitted)."""
        return {name: entry.build(k, self.fitted) for name, entry in SWEEP.items()}

    def _readouts(
        self,
        states: Float[Tensor, "r_plus_1 batch pos d_model"],
        conditions: dict[str, Condition | None],
        full_logits: Float[Tensor, "batch pos d_vocab"],
    ) -> dict[str, Tensor]:
        """The logits of every condition of one k; a condition equal to another at this depth
        (replay(r) = truncate(r)) is read out once.

        On an accelerator the conditions go through one readout call (a larger batch fills the
        device). On the CPU they are grouped into calls of at most `CPU_READOUT_ROWS` positions
        (one condition a call above it): past that a larger batch makes no matrix product faster,
        only the temporaries larger (on the `dcp-lens bench` model five conditions of 2048
        positions read out one at a time took 0.20 s against 0.24 s in one call)."""
        distinct = list(
            dict.fromkeys(c.at_depth(self.r) for c in conditions.values() if c is not None)
        )
        # Full depth's logits are already known (truncate(r) = replay(r) = full).
        logits: dict[Condition, Tensor] = {c: full_logits for c in distinct if isinstance(c, Full)}
        to_read = [c for c in distinct if c not in logits]
        positions = states[0].numel() // states.shape[-1]
        group = len(to_read)
        if states.device.type == "cpu":
            group = max(1, CPU_READOUT_ROWS // max(1, positions))
        for start in range(0, len(to_read), group):
            chunk = to_read[start : start + group]
            inputs = [condition.readout_input(states) for condition in chunk]
            read = self.model.readout(inputs[0] if len(chunk) == 1 else torch.cat(inputs))
            logits.update(zip(chunk, read.chunk(len(chunk)), strict=True))
        missing = torch.full_like(full_logits, math.nan)
        return {
            name: missing if c is None else logits[c.at_depth(self.r)]
            for name, c in conditions.items()
        }

    def _record(
        self,
        per_example: dict[tuple[str, str, int], list[Tensor]],
        cell: tuple[str, int],
        logits: Tensor,
        scoring: _Reference,
    ) -> dict[str, Tensor]:
        """Append each metric's per-example values for ``cell``; returns them."""
        values = scoring.score(logits, self.metrics)
        for metric, value in values.items():
            per_example.setdefault((metric, *cell), []).append(value)
        return values

    def _probe(self, reference: Tensor | None, states: dict[str, Any]) -> dict[str, Any]:
        usable = [reference, states["held_out"]]
        if self.probe_mode == "none" or any(x is None or not x.isfinite().all() for x in usable):
            return {"reference_auroc": math.nan, "trajectory": []}
        assert reference is not None
        probe = ResidualOODProbe(max_points=self.probe_points).fit(
            reference.double(),
            states["held_out"].double(),
            seed=self.seed,
            held_out_groups=states["held_out_groups"],
        )
        self.probe = probe

        def score(sample: tuple[Tensor | None, Tensor | None]) -> dict[str, float]:
            rows, groups = sample
            if rows is None or not bool(rows.isfinite().all()):
                return {"mahalanobis": math.nan, "auroc": math.nan}
            return probe.score(rows.double(), seed=self.seed, groups=groups)

        trajectory = [
            {"iteration": t, **score(sample)}
            for t, sample in enumerate(self._progress(states["trajectory"], "probe"))
        ]
        calibrated = [
            {"k": k, **score(sample)} for k, sample in states["calibrate_truncate"].items()
        ]
        # s_r of the probed examples against the held-out reference: full depth against itself.
        at_full_depth = trajectory[self.r]
        return {
            "reference_auroc": at_full_depth["auroc"],
            "reference_mahalanobis": at_full_depth["mahalanobis"],
            "noise_floor": probe.noise_floor,
            "trajectory": trajectory,
            "calibrate_truncate": calibrated,
        }

    def _pooled_positions(self, data: EvaluationSet, rows: slice) -> Bool[Tensor, "batch pos"]:
        """Positions pooled into the calibration statistics: every real (non-padding) token."""
        tokens = data.tokens[rows]
        keep = torch.ones_like(tokens, dtype=torch.bool)
        if data.attention_mask is not None:
            keep &= data.attention_mask[rows]
        if self.skip_first_position:
            keep[:, 0] = False
        return keep.to(self._device())

    def _check_grid(self, k_grid: Sequence[int] | None) -> tuple[int, ...]:
        if k_grid is None:
            if self.r <= 8:
                return tuple(range(1, self.r + 1))
            geometric = {1, 2, 3, 4, self.r}
            k = 4
            while k < self.r:
                geometric.add(k)
                k = math.ceil(k * 1.5)
            return tuple(sorted(geometric))
        grid = tuple(sorted(set(int(k) for k in k_grid)))
        if not grid:
            raise ValueError("k_grid is empty; pass iteration counts in 1..r.")
        for k in grid:
            self._check_k(k)
        return grid

    def _check_k(self, k: int) -> None:
        if not 1 <= k <= self.r:
            raise ValueError(
                f"k={k} is outside [1, r={self.r}]: truncate, replay and shift need 1 <= k <= r."
            )

    def _check_sets(self, evaluation: EvaluationSet, calibration: EvaluationSet) -> None:
        for name, data in (("evaluation", evaluation), ("calibration", calibration)):
            if not isinstance(data, EvaluationSet):
                raise TypeError(f"{name} must be an EvaluationSet, got {type(data).__name__}.")
        if self.requested_metrics is None:
            self.metrics = tuple(
                m for m in METRICS if evaluation.has_answers or m not in NEEDS_ANSWERS
            )
        if "accuracy" in self.metrics and not evaluation.has_answers:
            raise ValueError(
                "metric 'accuracy' needs answers, but this evaluation set is plain language "
                "modelling (EvaluationSet.from_tokens); drop 'accuracy' from metrics or build "
                "the set from a task with answers."
            )
        shared = evaluation.fingerprints() & calibration.fingerprints()
        if shared:
            raise ValueError(
                f"the calibration split overlaps the evaluation split ({len(shared)} shared "
                "examples); calibration must be fitted on examples never evaluated."
            )
        d_vocab = getattr(getattr(self.model, "cfg", None), "d_vocab", None)
        for name, data in (("evaluation", evaluation), ("calibration", calibration)):
            check_targets(data.targets, d_vocab, f"the {name} set's targets")
        n_ctx = getattr(getattr(self.model, "cfg", None), "n_ctx", None)
        if n_ctx is not None and evaluation.tokens.shape[1] > n_ctx:
            raise ValueError(
                f"scored positions run to {evaluation.tokens.shape[1] - 1}, outside the model's "
                f"context of n_ctx={n_ctx}."
            )

    def _calibration_failures(self) -> list[str]:
        return [label for label, mapping in self._require_calibrations().items() if mapping is None]

    def _calibration_fallbacks(self) -> list[str]:
        """Maps fitted in a simpler mode than asked, as ``"truncate(1): diag"``: the
        calibration split had too few states for ``calibration_mode``."""
        return [
            f"{label}: {mapping.mode}"
            for label, mapping in self._require_calibrations().items()
            if mapping is not None and mapping.mode != self.calibration_mode
        ]

    def _require_calibrations(self) -> dict[str, StateMapLike | None]:
        if self.calibrations is None:
            raise RuntimeError("fit the calibrations first: protocol.fit(calibration_set).")
        return self.calibrations

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _progress(self, items: Sequence[Any], description: str) -> Iterator[Any]:
        """``items`` with a progress bar; the heap's free pages go back to the system after
        each (`dcp_lens.utils.memory.release_free_memory`)."""
        for item in tqdm(items, desc=f"DCP {description}", disable=not self.progress, leave=False):
            yield item
            release_free_memory()


def task_data(
    model: Any,
    task: str | None,
    n_eval: int | None,
    n_calibration: int | None,
    seed: int,
    **text_options: Any,
) -> tuple[EvaluationSet, EvaluationSet]:
    """Evaluation and calibration sets for a model: its planted task, the task it was trained on
    (``model.task_config``), or ``task`` (a task name, ``char_lm:PATH``, or ``text:PATH`` in the
    model's own tokens with ``text_options`` of `dcp_lens.tasks.text.text_task`), built with
    ``seed``. A task with its own vocabulary is refused on a model with its own tokenizer.

    Returns:
        ``(evaluation, calibration)``: ``n_eval`` and ``n_calibration`` sequences (None: 512, or
        for a text corpus `TextLM.split_sizes`) from the task's disjoint splits.
    """
    planted = getattr(model, "planted_task", None)
    if planted is not None and task is None:
        return planted.evaluation(n_eval or 512), planted.calibration(n_calibration or 512)
    from dcp_lens.tasks import Task, check_task_tokens, get_task
    from dcp_lens.tasks.text import text_task

    built: Task
    if task is not None and task.startswith("text:"):
        built = text_task(model, task.partition(":")[2], seed=seed, **text_options)
        n_eval, n_calibration = built.split_sizes(n_eval, n_calibration)
    elif task is not None:
        name, _, path = task.partition(":")
        kwargs: dict[str, Any] = {"path": path} if path else {}
        built = get_task(name, seed=seed, **kwargs)
    elif getattr(model, "task_config", None):
        built = get_task(**model.task_config)
    else:
        raise ValueError(
            "this model has no task of its own; pass a task name, char_lm:PATH or text:PATH "
            "(--task)."
        )
    check_task_tokens(built, model)
    evaluation = EvaluationSet.from_task_batch(built.evaluation(n_eval or 512))
    calibration = EvaluationSet.from_task_batch(built.calibration(n_calibration or 512))
    return evaluation, calibration


class _Subsample:
    """A fixed-size pseudo-random subsample of rows streamed in batches (for the probe and the
    mixture calibration): the ``size`` rows of smallest priority, a hash of the seed, the row's
    example key and its position. Which rows are kept, and their order, depend on the examples
    only, never on the batch size or the order of the examples."""

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self.seed = np.uint64(seed % 2**63)
        self.rows: Tensor | None = None
        self.keys: Tensor | None = None  # the example of each kept row
        self.priority = np.zeros(0, dtype=np.uint64)

    def add(
        self,
        rows: Float[Tensor, "n d"],
        keys: Int[Tensor, " n"],
        positions: Int[Tensor, " n"],
    ) -> None:
        if rows.shape[0] == 0:
            return
        priority = _mix(keys.cpu().numpy(), positions.cpu().numpy(), self.seed)
        self._keep(priority, rows.detach(), keys.cpu())

    def _keep(self, priority: np.ndarray, rows: Tensor, keys: Tensor) -> None:
        """Keep the ``size`` rows of smallest priority among those kept and these."""
        if self.rows is not None and self.keys is not None:
            priority = np.concatenate([self.priority, priority])
            rows = torch.cat([self.rows, rows])
            keys = torch.cat([self.keys, keys])
        order = np.argsort(priority, kind="stable")[: self.size]
        index = torch.from_numpy(order.astype(np.int64))
        self.rows, self.keys = rows[index.to(rows.device)], keys[index]
        self.priority = priority[order]

    def state(self) -> dict[str, Any]:
        """The kept rows, their example keys and priorities (tensors), for `restore`."""
        priority = torch.from_numpy(self.priority.view(np.int64).copy())
        return {"rows": self.rows, "keys": self.keys, "priority": priority}

    def restore(self, state: dict[str, Any]) -> None:
        """Keep exactly what `state` recorded."""
        self.rows, self.keys = state["rows"], state["keys"]
        if self.keys is not None:
            self.keys = self.keys.cpu()
        self.priority = state["priority"].cpu().numpy().view(np.uint64).copy()

    @classmethod
    def merged(cls, parts: Sequence[_Subsample]) -> _Subsample:
        """The subsample of the union of the rows the ``parts`` (same size and seed) saw."""
        merged = cls(parts[0].size, 0)
        merged.seed = parts[0].seed
        for part in parts:
            if part.rows is not None and part.keys is not None:
                merged._keep(part.priority, part.rows, part.keys)
        return merged

    def tensor(self) -> Tensor | None:
        return self.rows

    def groups(self) -> Tensor | None:
        """The example key of each kept row."""
        return self.keys


def _row_ids(
    keys: Int[Tensor, " batch"], keep: Bool[Tensor, "batch pos"]
) -> tuple[Int[Tensor, " n"], Int[Tensor, " n"]]:
    """The example key and the position of every kept (batch, position), on the CPU."""
    keep = keep.cpu()
    example = keys[:, None].expand(keep.shape)[keep]
    position = torch.arange(keep.shape[1])[None].expand(keep.shape)[keep]
    return example, position


def _mix(keys: np.ndarray, positions: np.ndarray, seed: np.uint64) -> np.ndarray:
    """A splitmix64-style hash of (example key, position, seed), uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = keys.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        x ^= positions.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9) + seed
        x ^= x >> np.uint64(31)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(29)
    return x


def _merged_fit(
    streams: dict[str, StreamingMoments | None],
    samples: dict[str, _Subsample],
    sample: _Subsample,
    device: torch.device,
) -> tuple[dict[str, StreamingMoments | None], dict[str, _Subsample], _Subsample]:
    """`DepthControlProtocol.fit`'s moments and subsamples merged over every rank, in rank
    order on every rank (so every rank fits the same maps), on ``device``. A stream that turned
    non-finite on any rank is dropped."""
    parts = distributed.all_gather((streams, samples, sample))
    merged: dict[str, StreamingMoments | None] = {}
    for label in streams:
        each = [part[0][label] for part in parts]
        total: StreamingMoments | None = None
        if all(moments is not None for moments in each):
            total = StreamingMoments()
            for moments in each:
                total.merge(moments)
        merged[label] = distributed.moved(total, device)
    merged_samples = {
        label: distributed.moved(_Subsample.merged([part[1][label] for part in parts]), device)
        for label in samples
    }
    probe = distributed.moved(_Subsample.merged([part[2] for part in parts]), device)
    return merged, merged_samples, probe


def _nan_max_all(values: Any) -> float:
    """The maximum of ``values``, NaN if any is NaN (see `_nan_max`)."""
    result = -math.inf
    for value in values:
        result = _nan_max(result, value)
    return result


def _probe_s_rank_correlation(probe: dict[str, Any], decomposition: Any) -> float:
    """Spearman correlation over k of the probe's Mahalanobis score of s_k with S(k)
    (docs/design.md §5): does the directly measured readout shift order the k's as S does?"""
    by_iteration = {row["iteration"]: row["mahalanobis"] for row in probe.get("trajectory", [])}
    pairs = [
        (by_iteration.get(k, math.nan), float(s))
        for k, s in zip(decomposition.k_grid, decomposition.cells["S"], strict=True)
    ]
    pairs = [(m, s) for m, s in pairs if math.isfinite(m) and math.isfinite(s)]
    if len(pairs) < 3:
        return math.nan
    ranks = torch.tensor(pairs, dtype=torch.float64).argsort(0).argsort(0).double()
    ranks = ranks - ranks.mean(0)
    denominator = float(ranks.norm(dim=0).prod())
    return float((ranks[:, 0] * ranks[:, 1]).sum()) / denominator if denominator else math.nan


def _as_evaluation_set(data: Any, name: str) -> EvaluationSet:
    """``data`` as an `EvaluationSet` (a `dcp_lens.tasks.TaskBatch` is converted)."""
    from dcp_lens.tasks import TaskBatch

    if isinstance(data, TaskBatch):
        return EvaluationSet.from_task_batch(data)
    if not isinstance(data, EvaluationSet):
        raise TypeError(
            f"{name} must be an EvaluationSet or a TaskBatch, got {type(data).__name__}; build "
            "one with EvaluationSet.from_task_batch(batch) or EvaluationSet.from_tokens(tokens)."
        )
    return data


def _apply(mapping: StateMapLike | None, state: Tensor) -> Tensor:
    """``mapping(state)``, or NaN where no calibration could be fitted."""
    return mapping(state) if mapping is not None else torch.full_like(state, math.nan)


def _max_diff(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max())


@contextlib.contextmanager
def _noise_seed(model: Any, draw: int) -> Iterator[None]:
    """The model's initial-state noise seed moved by ``draw`` (restored afterwards)."""
    cfg = model.cfg
    seed = cfg.state_init_seed
    cfg.state_init_seed = seed + 1_000_003 * draw
    try:
        yield
    finally:
        cfg.state_init_seed = seed


def _accumulate(values: Any, more: Any) -> Any:
    """Per-example values of two evaluations added, cell by cell."""
    if isinstance(values, Tensor):
        return values + more
    return {key: _accumulate(value, more[key]) for key, value in values.items()}


def _reorder(values: Any, order: Tensor) -> Any:
    if isinstance(values, Tensor):
        return values[order]
    return {key: _reorder(value, order) for key, value in values.items()}


def _scale(values: Any, factor: float) -> Any:
    if isinstance(values, Tensor):
        return values * factor
    return {key: _scale(value, factor) for key, value in values.items()}


def _mean_entropy(logits: Float[Tensor, "n d_vocab"], temperature: float) -> float:
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


def _matching_temperature(logits: Float[Tensor, "n d_vocab"], entropy: float) -> float:
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


# The most positions one CPU readout call takes when it groups several conditions.
CPU_READOUT_ROWS = 2048


@dataclass(frozen=True)
class _Reference:
    """Full depth's side of every metric of one evaluation batch, computed once for the
    batch's conditions: log-probabilities, probabilities, top-1 and the targets."""

    log_probs: Float[Tensor, "batch pos d_vocab"]
    probs: Float[Tensor, "batch pos d_vocab"]
    top1: Int[Tensor, "batch pos"]
    targets: Int[Tensor, "batch pos"]

    @classmethod
    def of(cls, full_logits: Tensor, targets: Tensor) -> _Reference:
        log_probs = reference_log_probs(full_logits)
        return cls(log_probs, log_probs.exp(), log_probs.argmax(-1), targets)

    def score(self, logits: Tensor, metrics: Sequence[str]) -> dict[str, Tensor]:
        """`per_example_metrics` of ``logits`` against this reference: [batch] per metric."""
        return per_example_metrics(
            logits, self.log_probs, self.targets, metrics, self.top1, self.probs
        )


def _nan_max(a: float, b: float) -> float:
    """max(a, b), NaN if either is NaN: a non-finite null control never reads as passing."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


class _Pending:
    """Stands in for a map while `DepthControlProtocol.fit` asks the sweep what to fit."""

    def __call__(self, h: Tensor) -> Tensor:
        return h

    def inverse(self) -> _Pending:
        return self
