"""`DepthControlProtocol`: every condition of DCP at every k, fast, and the decomposition.

The protocol orchestrates five stages, each its own module with a typed hand-off:
`dcp_lens.protocol.fit` (calibration maps -> `FittedMaps`), `dcp_lens.protocol.confidence`
(temperatures -> `Temperatures`), `dcp_lens.protocol.sweep` (every condition at every k ->
`SweepOutput`), `dcp_lens.protocol.probe` (`probe_run`) and
`dcp_lens.protocol.decomposition` (`decompose`); `dcp_lens.protocol.verdicts` turns the probe
and the sweep into validity flags. Its settings are one `ProtocolConfig`.

The sweep is fast by construction. One full-depth pass per batch records every iteration's state
s_0..s_r; every condition of `dcp_lens.protocol.conditions.SWEEP` is then a readout of the state its
closed form builds from them (`Condition.readout_input`):

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

import dataclasses
import math
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from dcp_lens.protocol.budget import (
    MemoryEstimate,
    check_estimate,
    in_smaller_chunks,
    largest_fitting_batch,
    stage_stop_message,
)
from dcp_lens.protocol.calibration import CALIBRATION_MAPS, FittedMap
from dcp_lens.protocol.conditions import SWEEP, Condition, Full, ProtocolModel
from dcp_lens.protocol.confidence import ConfidenceMatching, Temperatures
from dcp_lens.protocol.config import ProtocolConfig, check_k
from dcp_lens.protocol.context import RunContext
from dcp_lens.protocol.decomposition import decompose
from dcp_lens.protocol.evaluation_set import EvaluationSet as EvaluationSet
from dcp_lens.protocol.evaluation_set import as_evaluation_set
from dcp_lens.protocol.evaluation_set import task_data as task_data
from dcp_lens.protocol.fit import FittedMaps, fit_maps
from dcp_lens.protocol.metrics import HIGHER_IS_BETTER, METRICS, NEEDS_ANSWERS, VALIDATION
from dcp_lens.protocol.probe import ResidualOODProbe, probe_run, s_rank_correlation
from dcp_lens.protocol.records import CalibrationRecord, NullControlRecord, ProbeSummaryRecord
from dcp_lens.protocol.results import ProtocolResults
from dcp_lens.protocol.states import capture_states
from dcp_lens.protocol.sweep import Sweep, SweepOutput, evaluate_with_noise
from dcp_lens.protocol.verdicts import (
    B_IDENTIFICATION_TOLERANCE,
    RunEvidence,
    scored_metrics,
    validity,
)
from dcp_lens.utils import distributed
from dcp_lens.utils.checks import check_targets
from dcp_lens.utils.errors import ConfigError, InputTypeError
from dcp_lens.utils.locks import model_in_use
from dcp_lens.utils.snapshots import Checkpoint

# The settings that `DepthControlProtocol` also takes as keyword arguments (they build a config).
SETTINGS = tuple(f.name for f in dataclasses.fields(ProtocolConfig))


class DepthControlProtocol:
    """Run DCP on one model (recurrent or dense) and decompose its truncation gap.

    Args:
        model: a `HookedRecurrentTransformer`, or any `dcp_lens.protocol.conditions.ProtocolModel`
            (``n_iterations``, ``is_dense``, ``state_hook_name``, ``readout_hook_name``,
            ``readout``, ``run_with_hooks``), e.g. a dense TransformerLens bridge.
        config: every setting of the protocol (`ProtocolConfig`: k grid, metrics, calibration
            mode, confidence matching, noise draws, batch size, bootstrap draws, seed, probe).
        **settings: the fields of `ProtocolConfig` as keyword arguments (``k_grid=[1, 2]``,
            ``n_bootstrap=200``, ...), which build the config (or replace its fields).
        spec: the model's name in the results (default: the spec it was loaded with,
            ``model.spec``, else ``"model"``).
        progress: progress bars.
        checkpoint: where the calibration and evaluation loops snapshot what they have
            accumulated, and resume from (`dcp_lens.utils.snapshots.Checkpoint`); None: no
            snapshots.
    """

    def __init__(
        self,
        model: Any,  # a ProtocolModel: checked below, with an error that says what to pass
        config: ProtocolConfig | None = None,
        *,
        spec: str | None = None,
        progress: bool = True,
        checkpoint: Checkpoint | None = None,
        **settings: Any,
    ) -> None:
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise ConfigError(
                f"unknown protocol settings {unknown}; expected fields of ProtocolConfig: "
                f"{list(SETTINGS)}."
            )
        if config is not None and not isinstance(config, ProtocolConfig):
            raise ConfigError(
                f"config must be a ProtocolConfig, got {type(config).__name__}; build one with "
                "ProtocolConfig(...) or pass the settings as keyword arguments."
            )
        if config is None:
            config = ProtocolConfig.from_dict(settings)
        elif settings:
            config = config.replace(**settings)
        if not isinstance(model, ProtocolModel):
            raise InputTypeError(
                f"model must be a model DCP can run (HookedRecurrentTransformer, a loaded or "
                f"planted model, a bridged TransformerLens model), got {type(model).__name__}; "
                "load one with dcp_lens.load(SPEC)."
            )
        self.config = config
        self.model = model
        self.r = int(model.n_iterations)
        self.context = RunContext(
            model,
            config,
            config.grid(self.r),
            tuple(config.metrics or METRICS),
            progress,
            checkpoint,
        )
        self.spec = spec if spec is not None else str(getattr(model, "spec", None) or "model")
        self.confidence = ConfidenceMatching(self.context)
        # Per (sweep condition, k): the temperature that gives its readout full depth's mean
        # entropy on the calibration split (loss metrics only; empty without matching).
        self.temperatures: Temperatures = {}
        self.maps: FittedMaps | None = None
        self.probe: ResidualOODProbe | None = None
        self.sweep: Sweep | None = None

    @property
    def calibrations(self) -> dict[str, FittedMap | None] | None:
        """The fitted maps by source condition's label (None before `fit`)."""
        return None if self.maps is None else self.maps.maps

    @property
    def calibration_null(self) -> FittedMap | None:
        return None if self.maps is None else self.maps.null

    # ------------------------------------------------------------------------ public API

    def run(self, evaluation: object, calibration: object) -> ProtocolResults:
        """Fit the calibrations on ``calibration``, evaluate every condition on ``evaluation``
        and decompose. The two sets must not share an example. Task batches
        (`dcp_lens.tasks.TaskBatch`) are converted with `EvaluationSet.from_task_batch`."""
        evaluation = as_evaluation_set(evaluation, "evaluation")
        calibration = as_evaluation_set(calibration, "calibration")
        self._check_sets(evaluation, calibration)
        self.check_memory(evaluation, calibration)
        was_training = getattr(self.model, "training", False)
        with model_in_use(self.model):
            self.model.eval()
            try:
                results = self._run_on(evaluation, calibration)
            finally:
                self.model.train(was_training)
        return results

    def _run_on(self, evaluation: EvaluationSet, calibration: EvaluationSet) -> ProtocolResults:
        with torch.no_grad():
            maps = self._fit(calibration)
            self.temperatures = {}
            if self.context.matches_confidence():
                self.fit_temperatures(calibration)
            self.sweep = Sweep(self.context, maps, self.temperatures)
            swept = evaluate_with_noise(self.sweep, evaluation)
            if distributed.is_main():
                probe_summary = self._probe(maps.probe_reference, swept)
        if not distributed.is_main():  # rank 0 decomposes; every rank returns its results
            return distributed.broadcast_from_main(None)
        results = self._decompose(swept, probe_summary, evaluation, calibration)
        return distributed.broadcast_from_main(results)

    def estimate(self, evaluation: object, calibration: object = None) -> MemoryEstimate:
        """This run's peak memory by term and stage (`dcp_lens.protocol.budget`), from the
        model's shape and the settings alone: nothing is read or allocated. Sized on the longer
        of the two sets' sequences."""
        data = as_evaluation_set(evaluation, "evaluation")
        if calibration is not None:
            other = as_evaluation_set(calibration, "calibration")
            if other.tokens.shape[1] > data.tokens.shape[1]:
                data = other
        return self.context.estimate(data)

    def check_memory(self, evaluation: EvaluationSet, calibration: EvaluationSet) -> None:
        """Refuse, before any batch is read, a run whose estimated peak exceeds its budget
        (`ProtocolConfig.memory_budget`), naming the largest batch size that fits."""
        budget = self.context.budget()
        estimate = self.estimate(evaluation, calibration)
        if budget is None or estimate.peak_bytes <= budget:
            return
        largest = self.largest_fitting_batch(evaluation, calibration)
        advice = (
            f"Pass batch_size={largest} (--batch-size {largest}), the largest that fits,"
            if largest
            else "No batch size fits: pass"
        )
        check_estimate(
            estimate,
            budget,
            str(self.context.device()),
            f"{advice} calibration_groups=0 (--calibration-groups 0: no jackknife) or a larger "
            "memory_budget (--memory-budget GIB).",
        )

    def use_batch_size(self, batch_size: int) -> None:
        """Run with ``batch_size`` sequences per forward from now on (a batch chosen from the
        budget, `largest_fitting_batch`); every other setting stays."""
        self.config = self.config.replace(batch_size=batch_size)
        self.context.config = self.config

    def largest_fitting_batch(self, evaluation: EvaluationSet, calibration: EvaluationSet) -> int:
        """The largest batch size up to the configured one whose estimated peak fits the
        budget (0: none; the configured one where the budget is unknown)."""
        budget = self.context.budget()
        if budget is None:
            return self.config.batch_size
        seq = max(int(evaluation.tokens.shape[1]), int(calibration.tokens.shape[1]))

        def fits(size: int) -> bool:
            return self.context.estimate_at(size, seq, budget).peak_bytes <= budget

        return largest_fitting_batch(fits, self.config.batch_size)

    @torch.no_grad()
    def fit(self, calibration: EvaluationSet) -> Tensor | None:
        """Fit every calibration map the sweep's conditions ask for on the calibration split
        (the fit stage, `dcp_lens.protocol.fit.fit_maps`).

        Returns the probe's reference subsample of full-depth readout inputs (or None)."""
        return self._fit(calibration).probe_reference

    @torch.no_grad()
    def fit_temperatures(self, calibration: EvaluationSet) -> Temperatures:
        """The confidence-matching stage (`ConfidenceMatching.fit`) over the fitted maps."""
        self.temperatures = self.confidence.fit(calibration, self._require_maps())
        return self.temperatures

    @torch.no_grad()
    def evaluate(self, evaluation: EvaluationSet, stage: str = "evaluation.0") -> SweepOutput:
        """The sweep stage over the fitted maps and temperatures (one noise draw)."""
        self.sweep = Sweep(self.context, self._require_maps(), self.temperatures)
        return self.sweep.evaluate(evaluation, stage)

    def fitted(self, source: Condition) -> FittedMap | None:
        """The map fitted from ``source``'s readout inputs to full depth's (None: non-finite)."""
        return self._require_maps().fitted(source)

    def condition(self, name: str, k: int) -> Condition:
        """The condition ``name`` (``"full"`` or a `SWEEP` entry) at ``k``, with fitted maps."""
        if name == "full":
            return Full()
        if name not in SWEEP:
            raise ValueError(f"unknown condition {name!r}; expected full or one of {tuple(SWEEP)}.")
        check_k(k, self.r)
        built = SWEEP[name].build(k, self._require_maps())
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
        return capture_states(self.model, tokens.to(self.context.device()))

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
            return self.model.run_with_hooks(tokens.to(self.context.device()), fwd_hooks=fwd_hooks)
        states, logits = self.states(tokens)
        known = logits if isinstance(built, Full) else built.logits_from_full(logits)
        return known if known is not None else self.model.readout(built.readout_input(states))

    # ------------------------------------------------------------------------ stages

    def _fit(self, calibration: EvaluationSet) -> FittedMaps:
        matching = self.context.matches_confidence()
        self.maps = fit_maps(self.context, calibration, self.confidence if matching else None)
        return self.maps

    def _probe(self, reference: Tensor | None, swept: SweepOutput) -> dict[str, Any]:
        if self.config.probe == "none":
            return {"reference_auroc": math.nan, "trajectory": []}
        device = self.context.device()

        def attempt(on: torch.device) -> tuple[dict[str, Any], ResidualOODProbe | None]:
            return probe_run(
                None if reference is None else reference.to(on),
                swept.probe_samples.to(on),
                n_iterations=self.r,
                points=self.config.probe_points,
                seed=self.config.seed,
                progress=self.context.each,
            )

        # Out of memory on an accelerator, the probe is fitted on the host (its samples are few).
        (summary, probe), _ = in_smaller_chunks(
            attempt,
            device,
            lambda on: None if on.type == "cpu" else torch.device("cpu"),
            device,
            lambda _: stage_stop_message(
                "probe",
                str(device),
                "on the host",
                "--resume does not evaluate again: it probes the evaluation's last snapshot "
                "(with a --resume snapshot folder).",
                "--probe-points N (fewer samples) or --probe none",
            ),
        )
        if probe is not None:
            self.probe = probe
        return summary

    def _decompose(
        self,
        swept: SweepOutput,
        probe_summary: dict[str, Any],
        evaluation: EvaluationSet,
        calibration: EvaluationSet,
    ) -> ProtocolResults:
        """The decompose stage: one `decompose` per metric, their validity decided
        (`dcp_lens.protocol.verdicts.validity`), and the results with their metadata."""
        config, context, maps = self.config, self.context, self._require_maps()
        k_grid, replay_difference = context.k_grid, swept.replay_difference
        evidence = RunEvidence(
            k_grid=k_grid,
            probe=ProbeSummaryRecord.from_json(probe_summary),
            replay_difference=replay_difference,
            calibration_mode=config.calibration_mode,
            lower_bound=CALIBRATION_MAPS[config.calibration_mode].lower_bound,
            validation={metric: VALIDATION[metric] for metric in context.metrics},
        )
        decomposed = {
            metric: decompose(
                swept.values[metric],
                k_grid,
                n_iterations=self.r,
                metric=metric,
                higher_is_better=HIGHER_IS_BETTER[metric],
                n_bootstrap=config.n_bootstrap,
                seed=config.seed,
                walked=swept.walked,
                jackknife_rows=swept.jackknife_rows,
                jackknife=[cells.get(metric, {}) for cells in swept.jackknife],
                replay_same=evidence.replay_same(),
                read=swept.read,
            )
            for metric in context.metrics
        }
        decompositions = validity(decomposed, evidence)
        first = decompositions[context.metrics[0]]
        probe_summary["s_rank_correlation"] = s_rank_correlation(
            probe_summary, first.k_grid, first.cells["S"]
        )
        return ProtocolResults(
            model=self.spec,
            architecture="dense" if self.model.is_dense else "recurrent",
            n_iterations=self.r,
            decompositions=decompositions,
            null_control=NullControlRecord.from_json(swept.null_control),
            probe=ProbeSummaryRecord.from_json(probe_summary),
            calibration=CalibrationRecord.of_run(
                config.calibration_mode,
                config.skip_first_position,
                self.temperatures,
                CALIBRATION_MAPS[config.calibration_mode].describe(config),
            ),
            metadata={
                "k_grid": list(k_grid),
                "calibration_mode": config.calibration_mode,
                "n_evaluation": len(evaluation),
                "examples_read": examples_read(swept, len(evaluation)),
                "n_calibration": len(calibration),
                "seed": config.seed,
                "skip_first_position": config.skip_first_position,
                "calibration_failures": maps.failures(),
                "noise_draws": context.noise_draws(),
                "replay_truncate_max_abs_logit_diff": {
                    str(k): replay_difference.get(k, math.nan) for k in k_grid
                },
                "b_identification_tolerance": B_IDENTIFICATION_TOLERANCE,
                "calibration_fallbacks": maps.fallbacks(),
                "translators_replaced_by_the_mean": maps.mean_translators(),
                "translator_gate": maps.gate_record(),
                "calibration_maps_fitted": maps.fitted_record(),
                "config": config.replace(k_grid=k_grid, metrics=context.metrics).to_dict(),
                **_model_caveats(self.model),
            },
        )

    # ------------------------------------------------------------------------ checks

    def _require_maps(self) -> FittedMaps:
        if self.maps is None:
            raise RuntimeError("fit the calibrations first: protocol.fit(calibration_set).")
        return self.maps

    def _check_sets(self, evaluation: EvaluationSet, calibration: EvaluationSet) -> None:
        for name, data in (("evaluation", evaluation), ("calibration", calibration)):
            if not isinstance(data, EvaluationSet):
                raise TypeError(f"{name} must be an EvaluationSet, got {type(data).__name__}.")
        self.context.metrics = scored_metrics(
            self.config.metrics, tuple(METRICS), tuple(NEEDS_ANSWERS), evaluation.has_answers
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


__all__ = ["DepthControlProtocol", "EvaluationSet", "ProtocolConfig", "task_data"]


def _model_caveats(model: object) -> dict[str, object]:
    """``{"model_caveats": ...}`` when the model names features that break a protocol assumption
    (its ``protocol_caveats``, set by its loader), else nothing."""
    caveats = getattr(model, "protocol_caveats", None)
    return {"model_caveats": dict(caveats)} if caveats else {}


def examples_read(swept: SweepOutput, n: int) -> dict[str, int]:
    """Per condition of the sweep, the evaluation examples it was read on: ``n`` but for the
    controls read on a subsample (`SweepOutput.read`)."""
    conditions = next(iter(swept.values.values()), {})
    return {
        name: int(swept.read[name].sum()) if name in swept.read else n
        for name in conditions
        if name != "full"
    }
