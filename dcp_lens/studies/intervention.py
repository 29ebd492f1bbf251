"""The controlled training intervention (docs/design.md §6): does the training regime set S?

Models are trained identically apart from the regime (`dcp_lens.training.REGIMES`: ``fixed``,
``sampled``, ``every-iteration``, and the matched ``dense`` model as the negative control), several
seeds each; DCP runs on every trained model on its own task, and the shares of the truncation gap
are set against the prediction (`PREDICTION`).

``run_training_intervention(out_dir, ...)`` writes::

    out_dir/runs/{regime}-seed{seed}/      the training run (`dcp_lens.training.train`)
    out_dir/runs/{regime}-seed{seed}/dcp/  its `ProtocolResults` (``ProtocolResults.load`` reads it)
    out_dir/intervention.json              per-regime shares and slope over seeds, the verdict
    out_dir/intervention.md                the prediction, a table and the verdict, for people
    out_dir/intervention.html              the regimes side by side (one seed each): truncation
                                           curves, S/B/D per k, the probe trajectory

A rerun on the same ``out_dir`` continues: finished trainings and DCP runs are read back, an
interrupted training resumes from its checkpoint, so the result is the same as one uninterrupted
run.

The shares, their aggregate over seeds and the verdict are
`dcp_lens.studies.intervention_outcomes`'s; `dcp_lens.studies.intervention_markdown` writes
``intervention.md``.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import numpy as np

from dcp_lens.protocol.config import COMMAND_DEFAULTS, ProtocolConfig
from dcp_lens.protocol.dcp import DepthControlProtocol, task_data
from dcp_lens.protocol.results import ProtocolResults, encode_json
from dcp_lens.report.html import write_report
from dcp_lens.studies.intervention_markdown import (
    explain_verdict,
    format_markdown,
    markdown_table,
)
from dcp_lens.studies.intervention_outcomes import (
    CONFIDENCE,
    NEGATIVE_CONTROL,
    PREDICTION,
    aggregate,
    prediction_checks,
    seed_numbers,
    shared_metric,
    validated_metrics,
)
from dcp_lens.training import PRESETS, REGIMES, TrainConfig, train
from dcp_lens.training import preset as training_preset
from dcp_lens.training.config import MODEL_DIR, TABLE_FILE, TRAIN_CONFIG_FILE
from dcp_lens.training.state import config_differences
from dcp_lens.utils.devices import check_device
from dcp_lens.utils.files import write_text_atomically
from dcp_lens.utils.folders import OutputFolder
from dcp_lens.utils.progress import progress as progress_display
from dcp_lens.utils.signals import die_with_parent
from dcp_lens.zoo.registry import load

RUNS_DIR, DCP_DIR = "runs", "dcp"
JSON_FILE, MARKDOWN_FILE, HTML_FILE = "intervention.json", "intervention.md", "intervention.html"


# DCP's settings in the intervention: ten runs, so fewer bootstrap draws than a single run.
INTERVENTION_CONFIG = ProtocolConfig(**COMMAND_DEFAULTS["experiment"])


def run_training_intervention(
    out_dir: str | Path,
    preset: str = "default",
    seeds: Sequence[int] = (0, 1, 2),
    regimes: Sequence[str] = REGIMES,
    *,
    dense_seeds: Sequence[int] | None = None,
    n_eval: int = 512,
    n_calibration: int = 512,
    protocol_config: ProtocolConfig | None = None,
    n_bootstrap: int | None = None,
    batch_size: int | None = None,
    probe: str | None = None,
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
        protocol_config: DCP's settings (default `INTERVENTION_CONFIG`); each model's seed replaces
            its ``seed``.
        n_bootstrap, batch_size, probe: replace the config's ``n_bootstrap`` (paired
            bootstrap draws per run), ``batch_size`` (sequences per forward pass) and ``probe``
            (``"trajectory"`` or ``"none"``: faster, no probe in the results) when given.
        device: where to train and run DCP (bit-reproducible training on CPU only).
        jobs: trainings run at once, each in its own process on one thread (the runs are the
            same bytes as with ``jobs=1``); the DCP runs follow one at a time (docs/intervention.md
            has the measured times).
        progress: progress bars.

    Returns:
        The content of ``intervention.json`` (NaN as None): ``preset``, ``metric``, ``settings``,
        ``regimes`` (per regime `aggregate` plus ``n_iterations``), ``prediction`` and
        ``verdict``.
    """
    check_device(device)
    given: dict[str, Any] = {"n_bootstrap": n_bootstrap, "batch_size": batch_size, "probe": probe}
    protocol_config = (protocol_config or INTERVENTION_CONFIG).replace(
        **{k: v for k, v in given.items() if v is not None}
    )
    n_bootstrap, batch_size = protocol_config.n_bootstrap, protocol_config.batch_size
    probe = protocol_config.probe
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
    # A saved DCP run is reused only under the same settings: the others, where not default.
    default = INTERVENTION_CONFIG.to_dict()
    others = {
        key: value
        for key, value in protocol_config.to_dict().items()
        if key not in (*given, "seed") and value != default[key]
    }
    if others:
        settings["protocol"] = others
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
    # After every check: a refused experiment leaves no folder. A new folder or an
    # experiment's (resumed); files added to it are kept. A training run started on its own
    # in runs/ (interrupted, say) is continued, not refused as the user's.
    target = OutputFolder(
        Path(out), "experiment", resume=True, on_finished="continue", nests=("train",)
    )
    target.open()
    try:
        out = target.prepare()
        pending = [
            (out / RUNS_DIR / f"{regime}-seed{seed}", config)
            for (regime, seed), config in configs.items()
            if not _finished(out / RUNS_DIR / f"{regime}-seed{seed}", config)
        ]
        if jobs > 1 and len(pending) > 1:
            _train_in_parallel(pending, jobs, progress)
        # Runs written by worker processes (this command's, or those of one killed before it
        # recorded them) are recorded as the folder's own, as far as their manifests prove.
        for regime, seed in plan:
            target.adopt(out / RUNS_DIR / f"{regime}-seed{seed}")
        for regime, seed in progress_display(plan, desc="intervention", enabled=progress):
            folder = out / RUNS_DIR / f"{regime}-seed{seed}"
            config = configs[(regime, seed)]
            results = _dcp_results(
                folder, config, settings, protocol_config.replace(seed=seed), progress
            )
            runs[regime].append((seed, results))

        metric = shared_metric(runs)
        validated = validated_metrics(runs)
        by_metric = {
            name: _regimes_and_verdict(runs, name) for name in dict.fromkeys([metric, *validated])
        }
        document = encode_json(
            {
                "preset": preset,
                "metric": metric,
                "settings": settings,
                **by_metric[metric],
                "prediction": PREDICTION,
                # Every other metric validated on planted models, with its own table and verdict.
                "validated_metrics": validated,
                "other_metrics": {name: by_metric[name] for name in validated if name != metric},
            }
        )
        write_text_atomically(
            out / JSON_FILE, json.dumps(document, indent=2, allow_nan=False) + "\n"
        )
        write_text_atomically(out / MARKDOWN_FILE, format_markdown(document))
        # The regimes side by side (one seed each): curves, S/B/D per k, the probe per regime.
        side_by_side = [
            dataclasses.replace(per_regime[0][1], model=f"{regime} (seed {per_regime[0][0]})")
            for regime, per_regime in runs.items()
        ]
        write_report(side_by_side, out / HTML_FILE)
    except BaseException:
        target.close()
        raise
    target.finish()
    return document


def print_summary(document: dict[str, Any], out: Path) -> None:
    """What ``dcp-lens experiment`` prints at its end: the shares over seeds per regime, the
    verdicts and the files written."""
    print(f"\n{document['metric']} shares over seeds (preset {document['preset']}):")
    print("\n".join(markdown_table(document["regimes"])))
    for regime, checks in document["verdict"].items():
        labels = ", ".join(f"{name} {check['label']}" for name, check in checks.items())
        print(f"{regime}: {labels}")
    written = ", ".join(str(out / name) for name in (JSON_FILE, MARKDOWN_FILE))
    print(f"wrote {written}; open {out / HTML_FILE}")


# ----------------------------------------------------------------------------- internals


def _regimes_and_verdict(
    runs: dict[str, list[tuple[int, ProtocolResults]]], metric: str
) -> dict[str, Any]:
    """``{"regimes": per-regime aggregate over seeds, "verdict": the explained verdict}`` of
    ``metric``."""
    summary = {
        regime: aggregate([seed_numbers(seed, results, metric) for seed, results in per_regime])
        for regime, per_regime in runs.items()
    }
    for regime, per_regime in runs.items():
        summary[regime]["n_iterations"] = per_regime[0][1].n_iterations
    return {"regimes": summary, "verdict": explain_verdict(prediction_checks(summary), summary)}


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
    protocol_config: ProtocolConfig,
    progress: bool,
) -> ProtocolResults:
    """The DCP results of the run in ``folder``: read back when saved with the same settings,
    else computed (after training, or finishing the training of, the model) and saved."""
    # Recorded with the results: a saved DCP run is reused only under the same settings.
    seed = protocol_config.seed
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
    protocol = DepthControlProtocol(model, protocol_config, spec=folder.name, progress=progress)
    results = protocol.run(evaluation, calibration)
    metadata = {**results.metadata, "intervention": recorded}
    results = dataclasses.replace(results, metadata=metadata)
    results.save(folder / DCP_DIR)
    return results


def _train_in_parallel(pending: list[tuple[Path, TrainConfig]], jobs: int, progress: bool) -> None:
    """Train every ``(folder, config)`` of ``pending``, ``jobs`` at a time, each in a fresh
    process (``spawn``: no state shared with this one) on its config's thread count; a worker
    ends when this process does, however it ends (`dcp_lens.utils.signals.die_with_parent`)."""
    context = multiprocessing.get_context("spawn")
    workers = min(jobs, len(pending))
    pool = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=context,
        initializer=die_with_parent,
        initargs=(os.getpid(),),
    )
    with pool:
        futures = [pool.submit(_train_quietly, config, folder) for folder, config in pending]
        for future in progress_display(
            as_completed(futures), total=len(futures), desc="training", enabled=progress
        ):
            future.result()  # re-raises a worker's error here


def _train_quietly(config: TrainConfig, folder: Path) -> None:
    train(config, folder, resume=True, progress=False)


def _finished(folder: Path, config: TrainConfig) -> bool:
    """Whether ``folder`` holds a finished training run of ``config``. (`train` on a finished
    run would save the model and evaluate its table again; this avoids rewriting them.)"""
    saved_config = folder / TRAIN_CONFIG_FILE
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
