"""The controlled training intervention (DESIGN.md §6): does the training regime set S?

Models are trained identically apart from the regime (`dcp_lens.training.REGIMES`: ``fixed``,
``sampled``, ``every-iteration``, and the matched ``dense`` model as the negative control), several
seeds each; DCP runs on every trained model on its own task, and the shares of the truncation gap
are set against the prediction (`PREDICTION`).

``run_training_intervention(out_dir, ...)`` writes::

    out_dir/runs/{regime}-seed{seed}/      the training run (`dcp_lens.training.train`)
    out_dir/runs/{regime}-seed{seed}/dcp/  its `ProtocolResults` (``ProtocolResults.load`` reads it)
    out_dir/intervention.json              per-regime shares and slope over seeds, the verdict
    out_dir/intervention.md                the prediction, a table and the verdict, for people

A rerun on the same ``out_dir`` continues: finished trainings and DCP runs are read back, an
interrupted training resumes from its checkpoint, so the result is the same as one uninterrupted
run.

Per regime, ``S``, ``B``, ``D`` are the means over seeds of each run's share of the gap's area and
``slope`` the mean of each run's classic truncation slope (`Decomposition.truncation_slope`); their
``_lo`` / ``_hi`` are a t-interval over seeds (mean +- t_{0.975, n-1} sd / sqrt(n)), or with a
single seed that run's own bootstrap interval over evaluation examples. A run whose truncation gap
has zero area (it predicts the same at every depth) has no shares; it is left out of them and
listed in ``undefined_seeds``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from dcp_lens.decomposition import FACTORS, ProtocolResults, _to_json
from dcp_lens.devices import check_device
from dcp_lens.protocol import DepthControlProtocol, task_data
from dcp_lens.registry import load
from dcp_lens.statistics import t_interval
from dcp_lens.training import PRESETS, REGIMES, TrainConfig, train
from dcp_lens.training import preset as training_preset
from dcp_lens.training.trainer import CONFIG_FILE, MODEL_DIR, TABLE_FILE, config_differences

RUNS_DIR, DCP_DIR = "runs", "dcp"
JSON_FILE, MARKDOWN_FILE = "intervention.json", "intervention.md"
BASELINE, NEGATIVE_CONTROL = "fixed", "dense"
# The regimes the prediction is about: both put every depth's readout in distribution in training.
TESTED_REGIMES = ("every-iteration", "sampled")
CONFIDENCE = 0.95
LABELS = ("supported", "not resolved", "not supported", "not tested")
PREDICTION = (
    "regimes that put every depth's readout in distribution (every-iteration, sampled) shrink S "
    "relative to fixed and flatten the truncation slope by about S, while D, set by the task's "
    "hop counts, stays"
)
# Per-run numbers averaged over seeds; each run also carries its bootstrap interval for them.
# Shares of the gap's area (S, B, D; what intervention.json promises), the truncation slope, and
# the same factors in the metric's own units: the mean over the k grid of gap(k), S(k), B(k), D(k).
# The verdict reads the absolute ones: a share of a gap near zero (a model that needs no depth)
# is unstable, while its absolute S is simply near zero.
ABSOLUTE = ("gap_abs", "S_abs", "B_abs", "D_abs")
AGGREGATED = (*FACTORS, "slope", *ABSOLUTE)


def run_training_intervention(
    out_dir: str | Path,
    preset: str = "default",
    seeds: Sequence[int] = (0, 1, 2),
    regimes: Sequence[str] = REGIMES,
    *,
    dense_seeds: Sequence[int] | None = None,
    n_eval: int = 512,
    n_calibration: int = 512,
    n_bootstrap: int = 200,
    batch_size: int = 64,
    probe: str = "trajectory",
    device: str = "cpu",
    jobs: int = 1,
    progress: bool = True,
) -> dict[str, Any]:
    """Train preset ``preset`` in every regime x seed, run DCP on each model, aggregate.

    Args:
        out_dir: the experiment folder (see the module docstring); an existing one is continued.
        preset: a training preset of `dcp_lens.training.PRESETS` (``tiny`` for smoke runs).
        seeds: training seeds of the recurrent regimes.
        dense_seeds: training seeds of the dense negative control; None: the first of
            ``seeds`` (the control is one model; more seeds give it an interval too).
        regimes: any of `dcp_lens.training.REGIMES`; the verdict needs ``fixed`` and the
            regime it tests.
        n_eval, n_calibration: DCP evaluation and calibration sequences from the task's own
            splits (the same examples for every model).
        n_bootstrap: DCP's paired bootstrap draws per run.
        batch_size: DCP sequences per forward pass.
        probe: DCP's probe, ``"trajectory"`` or ``"none"`` (faster; no probe in the results).
        device: where to train and run DCP (bit-reproducible training on CPU only).
        jobs: trainings run at once, each in its own process on one thread (the runs are the
            same bytes as with ``jobs=1``); the DCP runs follow one at a time. With the default
            preset on a 2-core machine, ``jobs=2`` took 24 minutes (the ten trainings took 46
            CPU-minutes between them, 3.7 to 5.2 minutes each).
        progress: progress bars.

    Returns:
        The content of ``intervention.json`` (NaN as None): ``preset``, ``metric``, ``settings``,
        ``regimes`` (per regime `aggregate` plus ``n_iterations``), ``prediction`` and
        ``verdict``.
    """
    check_device(device)
    seeds, regimes = _check_arguments(preset, seeds, regimes, probe)
    dense_seeds = (
        seeds[:1]
        if dense_seeds is None
        else _check_arguments(preset, dense_seeds, regimes, probe)[0]
    )
    for name, value, minimum in (
        ("n_eval", n_eval, 1),
        ("n_calibration", n_calibration, 1),
        ("n_bootstrap", n_bootstrap, 0),
        ("batch_size", batch_size, 1),
        ("jobs", jobs, 1),
    ):
        if value < minimum:
            raise ValueError(f"{name}={value} must be >= {minimum}.")
    out = Path(out_dir)
    settings = {
        "n_eval": n_eval,
        "n_calibration": n_calibration,
        "n_bootstrap": n_bootstrap,
        "probe": probe,
        "confidence": CONFIDENCE,
    }
    runs: dict[str, list[tuple[int, ProtocolResults]]] = {regime: [] for regime in regimes}
    plan = [
        (regime, seed)
        for regime in regimes
        for seed in (dense_seeds if regime == NEGATIVE_CONTROL else seeds)
    ]
    overrides = {} if device == "cpu" else {"device": device}  # a run field: resumable anywhere
    configs = {
        (regime, seed): training_preset(preset, regime=regime, seed=seed, **overrides)
        for regime, seed in plan
    }
    pending = [
        (out / RUNS_DIR / f"{regime}-seed{seed}", config)
        for (regime, seed), config in configs.items()
        if not _finished(out / RUNS_DIR / f"{regime}-seed{seed}", config)
    ]
    if jobs > 1 and len(pending) > 1:
        _train_in_parallel(pending, jobs, progress)
    for regime, seed in tqdm(plan, desc="intervention", disable=not progress):
        folder = out / RUNS_DIR / f"{regime}-seed{seed}"
        config = configs[(regime, seed)]
        results = _dcp_results(
            folder, config, settings, batch_size=batch_size, seed=seed, progress=progress
        )
        runs[regime].append((seed, results))

    metric = _metric(runs)
    summary = {
        regime: aggregate([_per_seed(seed, results, metric) for seed, results in per_regime])
        for regime, per_regime in runs.items()
    }
    for regime, per_regime in runs.items():
        summary[regime]["n_iterations"] = per_regime[0][1].n_iterations
    document = _to_json(
        {
            "preset": preset,
            "metric": metric,
            "settings": settings,
            "regimes": summary,
            "prediction": PREDICTION,
            "verdict": verdict(summary),
        }
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / JSON_FILE).write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
    (out / MARKDOWN_FILE).write_text(format_markdown(document))
    return document


def aggregate(per_seed: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One regime over seeds: the mean of ``S, B, D, slope`` and a 95% interval for each.

    Each quantity is taken over the seeds where it is defined (the shares are NaN in a run whose
    truncation gap has zero area, e.g. a model that predicts the same at every depth): with two
    or more such seeds, the t-interval over them; with one, that run's own bootstrap interval over
    evaluation examples; with none, NaN.

    Args:
        per_seed: one dict per seed with ``seed`` and, for each name of ``S, B, D, slope``, the
            run's value and its bootstrap interval (``S_lo``, ``S_hi``, ...).

    Returns:
        ``{"S", "S_lo", "S_hi", ..., "slope_hi", "n_seeds", "seeds", "undefined_seeds",
        "per_seed"}``: ``n_seeds`` maps each quantity to the number of seeds it is taken over,
        ``undefined_seeds`` lists the seeds left out of any of them.
    """
    if not per_seed:
        raise ValueError("per_seed is empty; aggregate needs at least one seed's run.")
    summary: dict[str, Any] = {}
    counts: dict[str, int] = {}
    undefined: set[int] = set()
    for name in AGGREGATED:
        defined = [row for row in per_seed if math.isfinite(float(row[name]))]
        undefined |= {int(row["seed"]) for row in per_seed if not math.isfinite(float(row[name]))}
        values = np.array([float(row[name]) for row in defined])
        counts[name] = len(defined)
        if not defined:
            low = high = mean = math.nan
        elif len(defined) == 1:
            mean, low, high = (float(defined[0][name + s]) for s in ("", "_lo", "_hi"))
        else:
            mean = float(values.mean())
            low, high = t_interval(values, CONFIDENCE)
        summary.update({name: mean, f"{name}_lo": low, f"{name}_hi": high})
    summary["n_seeds"] = counts
    summary["seeds"] = [int(row["seed"]) for row in per_seed]
    summary["undefined_seeds"] = sorted(undefined)
    summary["per_seed"] = [dict(row) for row in per_seed]
    return summary


# ------------------------------------------------------------------------------ the verdict


def s_verdict(tested: dict[str, Any], fixed: dict[str, Any]) -> dict[str, str]:
    """Is S of ``tested`` lower than S of ``fixed``, in the metric's units (``S_abs``)?

    ``supported``: lower, and the intervals do not overlap (``S_abs_hi < fixed S_abs_lo``);
    ``not resolved``: lower but the intervals overlap, or a value is NaN;
    ``not supported``: not lower.

    Returns:
        ``{"label", "reason"}``.
    """
    numbers = f"S {_interval(tested, 'S_abs')} against fixed {_interval(fixed, 'S_abs')}"
    if not _finite(tested, fixed, "S_abs"):
        return _verdict("not resolved", f"{numbers}: a value is undefined (NaN)")
    if tested["S_abs"] >= fixed["S_abs"]:
        return _verdict("not supported", f"{numbers}: not lower")
    if tested["S_abs_hi"] < fixed["S_abs_lo"]:
        return _verdict("supported", f"{numbers}: lower, the intervals do not overlap")
    return _verdict("not resolved", f"{numbers}: lower, but the intervals overlap")


def d_verdict(tested: dict[str, Any], fixed: dict[str, Any]) -> dict[str, str]:
    """Does D (in the metric's units, ``D_abs``) stay? ``supported`` when the intervals of
    ``tested`` and ``fixed`` overlap, ``not supported`` when they do not, ``not resolved`` when a
    value is NaN.

    Returns:
        ``{"label", "reason"}``.
    """
    numbers = f"D {_interval(tested, 'D_abs')} against fixed {_interval(fixed, 'D_abs')}"
    if not _finite(tested, fixed, "D_abs"):
        return _verdict("not resolved", f"{numbers}: a value is undefined (NaN)")
    if tested["D_abs_lo"] <= fixed["D_abs_hi"] and fixed["D_abs_lo"] <= tested["D_abs_hi"]:
        return _verdict("supported", f"{numbers}: the intervals overlap")
    return _verdict("not supported", f"{numbers}: the intervals do not overlap")


def slope_verdict(tested: dict[str, Any], fixed: dict[str, Any]) -> dict[str, Any]:
    """Does the slope flatten by about the change in S?

    If the regime removes ``fixed S_abs - tested S_abs`` from fixed's gap (``gap_abs``, both
    means over k), the slope (linear in the gap) scales by ``1 - that / fixed gap_abs``:
    predicted slope = fixed slope x that factor.
    ``supported``: the predicted slope lies in the tested slope's interval and the fixed slope
    does not; ``not resolved``: both lie in it (the change cannot be told from no change), or a
    value is NaN; ``not supported``: the predicted slope lies outside it.

    Returns:
        ``{"label", "reason", "predicted_slope"}``.
    """
    removed = (
        (fixed["S_abs"] - tested["S_abs"]) / fixed["gap_abs"] if fixed["gap_abs"] else math.nan
    )
    predicted = fixed["slope"] * (1.0 - removed)
    numbers = (
        f"slope {_interval(tested, 'slope')}, predicted {_number(predicted)} from fixed "
        f"slope {_number(fixed['slope'])} and the change in S"
    )
    result = {"predicted_slope": predicted}
    values = [predicted, tested["slope_lo"], tested["slope_hi"], fixed["slope"]]
    if not all(math.isfinite(float(v)) for v in values):
        return {**_verdict("not resolved", f"{numbers}: a value is undefined (NaN)"), **result}
    inside = tested["slope_lo"] <= predicted <= tested["slope_hi"]
    fixed_inside = tested["slope_lo"] <= fixed["slope"] <= tested["slope_hi"]
    if not inside:
        label, why = "not supported", "the prediction lies outside the interval"
    elif fixed_inside:
        label, why = "not resolved", "the interval also holds the fixed slope"
    else:
        label, why = "supported", "the prediction lies in the interval, the fixed slope does not"
    return {**_verdict(label, f"{numbers}: {why}"), **result}


def verdict(regimes: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """For each of `TESTED_REGIMES`: ``{"S_lower", "D_stays", "slope_follows_S"}``, each a
    ``{"label", "reason"}`` (labels in `LABELS`; ``not tested`` when the regime or ``fixed``
    was not run). ``regimes`` maps a regime name to its `aggregate`."""
    checks: dict[str, Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]] = {
        "S_lower": s_verdict,
        "D_stays": d_verdict,
        "slope_follows_S": slope_verdict,
    }
    result: dict[str, dict[str, dict[str, Any]]] = {}
    for regime in TESTED_REGIMES:
        missing = [name for name in (regime, BASELINE) if name not in regimes]
        if missing:
            reason = f"no {' or '.join(missing)} runs"
            result[regime] = {name: _verdict("not tested", reason) for name in checks}
            continue
        tested, fixed = _decoded(regimes[regime]), _decoded(regimes[BASELINE])
        result[regime] = {name: check(tested, fixed) for name, check in checks.items()}
    return result


def format_markdown(document: dict[str, Any]) -> str:
    """``intervention.md`` from the content of ``intervention.json``: the prediction, a table
    of every regime and the verdict."""
    metric = document["metric"]
    lines = [
        f"# Training intervention: preset `{document['preset']}`, metric `{metric}`",
        "",
        f"**Prediction.** {document['prediction'][0].upper()}{document['prediction'][1:]}.",
        "",
        *markdown_table(document["regimes"]),
        "",
        f"S, B, D: shares of the truncation gap's area over k ({metric}); slope: the classic "
        "truncation slope (quality against k / r); gap, S, B, D in units: their means over k "
        f"in {metric} itself, which the verdict reads (a share of a gap near zero is unstable; "
        "single-seed rows have no interval for these). Each is the mean over the seeds where it is "
        f"defined, with a {CONFIDENCE:.0%} t-interval over them (defined in one seed only: that "
        "run's bootstrap interval over evaluation examples). Shares are undefined in a run whose "
        "truncation gap has zero area (the same predictions at every depth).",
    ]
    if NEGATIVE_CONTROL in document["regimes"]:
        lines.append(
            "The dense row is the negative control: a dense model of distinct layers, whose S is "
            "that of truncating its own layers."
        )
    lines += ["", "## Verdict", ""]
    names = {
        "S_lower": "S lower than fixed",
        "D_stays": "D stays",
        "slope_follows_S": "slope flattens by about the change in S",
    }
    for regime, checks in document["verdict"].items():
        lines.append(f"- **{regime}**")
        for key, check in checks.items():
            lines.append(f"  - {names[key]}: **{check['label']}** ({check['reason']})")
    return "\n".join(lines) + "\n"


def markdown_table(regimes: dict[str, dict[str, Any]]) -> list[str]:
    """The lines of a markdown table: regime, seeds, then the shares S, B, D, the slope, the gap
    and S, B, D in the metric's units (means over k), each with its interval, and the accuracy at
    full depth and at k = 1 (means over seeds)."""
    lines = [
        "| regime | seeds | S [lo, hi] | B [lo, hi] | D [lo, hi] | slope [lo, hi] "
        "| gap, units | S, units | B, units | D, units | accuracy full / k=1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for regime, row in regimes.items():
        decoded = _decoded(row)
        cells = [_interval(decoded, name) for name in AGGREGATED]
        seeds = ",".join(str(seed) for seed in row["seeds"])
        if row["undefined_seeds"]:
            seeds += f" (undefined: {','.join(str(seed) for seed in row['undefined_seeds'])})"
        accuracy = [_number(_finite_mean(entry[key] for entry in row["per_seed"])) for key in
                    ("full_accuracy", "k1_accuracy")]  # fmt: skip
        cells.append(" / ".join(accuracy))
        lines.append(f"| {regime} | {seeds} | " + " | ".join(cells) + " |")
    return lines


# ----------------------------------------------------------------------------- internals


def _check_arguments(
    preset_name: str,
    seeds: Sequence[int],
    regimes: Sequence[str],
    probe: str,
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    if preset_name not in PRESETS:
        raise ValueError(f"unknown preset {preset_name!r}; presets: {sorted(PRESETS)}.")
    if isinstance(regimes, str):
        raise ValueError(f"regimes={regimes!r} must be a list of names, not one string.")
    regimes = tuple(regimes)
    if not regimes:
        raise ValueError(f"regimes is empty; pass some of {REGIMES}.")
    unknown = [regime for regime in regimes if regime not in REGIMES]
    if unknown:
        raise ValueError(f"unknown regimes {unknown}; expected some of {REGIMES}.")
    seeds = tuple(seeds)
    if not seeds:
        raise ValueError("seeds is empty; pass at least one training seed (e.g. 0, 1, 2).")
    if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0 for s in seeds):
        raise ValueError(f"seeds={list(seeds)} must be integers >= 0.")
    for name, values in (("regimes", regimes), ("seeds", seeds)):
        repeated = sorted({str(v) for v in values if values.count(v) > 1})
        if repeated:
            raise ValueError(f"{name} repeat {repeated}; list each once.")
    if probe not in ("trajectory", "none"):
        raise ValueError(f"probe={probe!r} must be 'trajectory' or 'none'.")
    return tuple(int(s) for s in seeds), regimes


def _dcp_results(
    folder: Path,
    config: TrainConfig,
    settings: dict[str, Any],
    *,
    batch_size: int,
    seed: int,
    progress: bool,
) -> ProtocolResults:
    """The DCP results of the run in ``folder``: read back when saved with the same settings,
    else computed (after training, or finishing the training of, the model) and saved."""
    # Recorded with the results: a saved DCP run is reused only under the same settings.
    recorded = {**settings, "seed": seed}
    if _finished(folder, config):
        if (folder / DCP_DIR / "results.json").is_file():
            saved = ProtocolResults.load(folder / DCP_DIR)
            if saved.metadata.get("intervention") == recorded:
                return saved
    else:
        train(config, folder, resume=True, progress=progress)
    # Always the saved model, so a fresh run and a rerun diagnose the same bytes.
    model = load(str(folder / MODEL_DIR)).to(config.device).eval()
    evaluation, calibration = task_data(
        model, None, settings["n_eval"], settings["n_calibration"], seed
    )
    protocol = DepthControlProtocol(
        model,
        n_bootstrap=settings["n_bootstrap"],
        batch_size=batch_size,
        seed=seed,
        probe=settings["probe"],
        spec=folder.name,
        progress=progress,
    )
    results = protocol.run(evaluation, calibration)
    metadata = {**results.metadata, "intervention": recorded}
    results = dataclasses.replace(results, metadata=metadata)
    results.save(folder / DCP_DIR)
    return results


def _train_in_parallel(pending: list[tuple[Path, TrainConfig]], jobs: int, progress: bool) -> None:
    """Train every ``(folder, config)`` of ``pending``, ``jobs`` at a time, each in a fresh
    process (``spawn``: no state shared with this one) on its config's thread count."""
    context = multiprocessing.get_context("spawn")
    workers = min(jobs, len(pending))
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        futures = [pool.submit(_train_quietly, config, folder) for folder, config in pending]
        for future in tqdm(
            as_completed(futures), total=len(futures), desc="training", disable=not progress
        ):
            future.result()  # re-raises a worker's error here


def _train_quietly(config: TrainConfig, folder: Path) -> None:
    train(config, folder, resume=True, progress=False)


def _finished(folder: Path, config: TrainConfig) -> bool:
    """Whether ``folder`` holds a finished training run of ``config``. (`train` on a finished
    run would save the model and evaluate its table again; this avoids rewriting them.)"""
    saved_config = folder / CONFIG_FILE
    if not (saved_config.is_file() and (folder / TABLE_FILE).is_file()):
        return False
    if not (folder / MODEL_DIR).is_dir():
        return False
    differ = config_differences(saved_config, config)
    if differ:
        raise ValueError(
            f"{folder} holds a run of another config (fields {differ} differ); use another "
            "out folder for another preset, or remove that run to retrain it."
        )
    return True


def _metric(runs: dict[str, list[tuple[int, ProtocolResults]]]) -> str:
    """The protocol's first metric (its default: accuracy on tasks with answers), which every
    run must share."""
    metrics = {results.metrics[0] for per_regime in runs.values() for _, results in per_regime}
    if len(metrics) != 1:
        raise ValueError(f"the runs decomposed different first metrics {sorted(metrics)}.")
    return metrics.pop()


def _per_seed(seed: int, results: ProtocolResults, metric: str) -> dict[str, Any]:
    """One run's shares and slope (with bootstrap intervals) and its accuracy at k = r and 1."""
    decomposition = results.decompositions[metric]
    row: dict[str, Any] = {"seed": seed, **decomposition.shares}
    row.update(
        slope=decomposition.truncation_slope,
        slope_lo=decomposition.truncation_slope_lo,
        slope_hi=decomposition.truncation_slope_hi,
    )
    table = decomposition.table()
    used = table[table["k"].isin(decomposition.share_k_grid)]
    for name in ABSOLUTE:
        column = name.removesuffix("_abs")
        value = float(used[column].mean()) if len(used) else math.nan
        # No bootstrap interval for these: over seeds they get the t-interval.
        row.update({name: value, f"{name}_lo": math.nan, f"{name}_hi": math.nan})
    accuracy = results.decompositions.get("accuracy")
    if accuracy is None:
        row.update(full_accuracy=math.nan, k1_accuracy=math.nan)
    else:
        truncated = dict(zip(accuracy.k_grid, accuracy.curves["truncate"], strict=True))
        row.update(full_accuracy=accuracy.full, k1_accuracy=float(truncated.get(1, math.nan)))
    return row


def _finite_mean(values: Iterable[float | None]) -> float:
    finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(finite) / len(finite) if finite else math.nan


def _decoded(row: dict[str, Any]) -> dict[str, Any]:
    """An aggregate with JSON's None read back as NaN (numbers only)."""
    return {key: math.nan if value is None else value for key, value in row.items()}


def _finite(tested: dict[str, Any], fixed: dict[str, Any], name: str) -> bool:
    keys = (name, f"{name}_lo", f"{name}_hi")
    return all(math.isfinite(float(row[key])) for row in (tested, fixed) for key in keys)


def _verdict(label: str, reason: str) -> dict[str, str]:
    return {"label": label, "reason": reason}


def _number(value: float) -> str:
    return "nan" if value is None or math.isnan(value) else f"{value:.3f}"


def _interval(row: dict[str, Any], name: str) -> str:
    return f"{_number(row[name])} [{_number(row[f'{name}_lo'])}, {_number(row[f'{name}_hi'])}]"
