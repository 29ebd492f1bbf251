"""`dcp-lens validate`: DCP on every planted model of known ground truth, on every metric, judged
by the bracket rule (docs/bracket.md, docs/validation.md).

Each row is judged by the rules of `dcp_lens.studies.validation_rules`.

`coverage` replicates planted models with different seeds and reports how often each 95%
interval covers the truth.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from dcp_lens.protocol.bracket import BracketRule
from dcp_lens.protocol.budget import GIB, budget_bytes
from dcp_lens.protocol.config import COMMAND_DEFAULTS, ProtocolConfig
from dcp_lens.protocol.dcp import DepthControlProtocol
from dcp_lens.protocol.metrics import METRICS
from dcp_lens.protocol.results import FACTORS, decode_json, encode_json
from dcp_lens.protocol.verdicts import share_verdict
from dcp_lens.studies.bench_memory import peak_memory
from dcp_lens.studies.validation_rules import (
    CLAIMED_SHARE,
    COVERAGE_TARGET,
    FALSE_ALARM_RATE,
    NARROW_WIDTH,
    POINT_TOLERANCE,
    TRUTH_SLACK,
    VERDICT_RATE,
    Judgement,
    ValidationRow,
    bracket_of,
    judge_bracket,
    judge_run,
    per_k_of,
    point_rule_passes,
    shares_of,
    suite_passed,
    summarize,
)
from dcp_lens.utils.errors import ConfigError
from dcp_lens.utils.files import write_text_atomically
from dcp_lens.utils.folders import OutputFolder
from dcp_lens.zoo import planted
from dcp_lens.zoo.planted.embedding import check_width, embed

# The planted mixtures, the models `coverage` replicates by default.
MIXTURES = tuple(name for name in planted.BRACKET_PLANTED if "+" in planted.EXPECTED_FACTOR[name])


# The protocol settings of `dcp-lens validate`: sixteen models on every metric, so fewer bootstrap
# draws and probe points than a single run (`COMMAND_DEFAULTS`).
VALIDATE_CONFIG = ProtocolConfig(**COMMAND_DEFAULTS["validate"])


def validate(
    models: Sequence[str] | None = None,
    metrics: Sequence[str] | None = None,
    *,
    config: ProtocolConfig | None = None,
    n_eval: int = 512,
    n_calibration: int = 512,
    progress: bool = False,
    width: int | None = None,
    **settings: object,
) -> list[ValidationRow]:
    """Run DCP on each planted model (default: all of `dcp_lens.zoo.planted.BRACKET_PLANTED`,
    built with the config's seed) on each metric (default: every metric of
    `dcp_lens.protocol.metrics.METRICS`) and judge each row by the bracket rule.

    Args:
        models: planted model names.
        metrics: metric names (replace ``config.metrics``).
        config: the protocol settings (default: `VALIDATE_CONFIG`).
        n_eval, n_calibration: evaluation and calibration sequences of each planted task.
        progress: progress bars.
        width: embed each planted model in a stream of this many coordinates
            (`dcp_lens.zoo.planted.embedding.embed`; default: the models as built).
        **settings: fields of `ProtocolConfig` that replace the config's (``seed=1``,
            ``n_bootstrap=100``, ``calibration_mode="diag"``, ...).

    Returns:
        One `ValidationRow` per (model, metric), models in the given order.
    """
    names = _models(models)
    check_width([planted.BUILDERS[name] for name in names], width)
    config = _suite_budget(_config(config, metrics, settings))
    rows = []
    for name in names:
        run, expected = _run_planted(name, config, n_eval, n_calibration, progress, width)
        for metric in config.metrics or ():
            rows.append(_row(name, metric, run, expected[metric]))
    return rows


def coverage(
    models: Sequence[str] | None = None,
    metrics: Sequence[str] | None = None,
    *,
    replicates: int,
    config: ProtocolConfig | None = None,
    n_eval: int = 512,
    n_calibration: int = 512,
    progress: bool = False,
    width: int | None = None,
    **settings: object,
) -> dict[str, Any]:
    """How often each 95% interval covers the truth over ``replicates`` runs of each planted
    model (default: the mixtures of `planted.BRACKET_PLANTED`), replicate i built and run with
    seed ``config.seed + i`` (model weights, data and bootstrap alike).

    Returns:
        ``{"replicates", "seeds", "target", "models": {model: {metric: {quantity: {...}}}},
        "passed", "draws"}``: per quantity (the point S, B, D; each bracket end ``S_lower``
        ... ``D_upper``; each whole bracket ``S_bracket`` ... from its lower end's ``_lo`` to
        its upper end's ``_hi``), ``covers_truth`` (the fraction of replicates whose interval
        holds that replicate's truth) and, where the quantity has a point estimate,
        ``covers_debiased`` (the fraction that holds the truth plus the estimate's mean error
        over the replicates: coverage of the estimator's own target, bias aside) and
        ``spread_ratio`` (the standard
        deviation of the estimate's error over the replicates against the mean bootstrap standard
        error, the interval's width / 3.92; about 1 when the interval is honest). ``passed``:
        every counted quantity (`coverage_counted`) of every validated metric covers the truth
        at least `COVERAGE_TARGET` of the time. ``draws``: every replicate's record, per model
        and metric in seed order (its shares, bracket ends with their intervals and truths), to
        see which replicates an interval missed and by how much. ``width``: as for `validate`.
    """
    if replicates < 2:
        raise ConfigError(
            f"coverage needs at least 2 replicates, got {replicates}; pass --coverage 2 or more."
        )
    names = _models(models or MIXTURES)
    check_width([planted.BUILDERS[name] for name in names], width)
    config = _suite_budget(_config(config, metrics, settings))
    seeds = [config.seed + i for i in range(replicates)]
    found: dict[str, dict[str, list[dict[str, float]]]] = {}
    validated: dict[str, bool] = {}
    for name in names:
        for seed in seeds:
            run, expected = _run_planted(
                name, config.replace(seed=seed), n_eval, n_calibration, progress, width
            )
            for metric in config.metrics or ():
                record = run.get("metrics", {}).get(metric, {})
                validated[metric] = record.get("validated", True) is not False
                found.setdefault(name, {}).setdefault(metric, []).append(
                    {
                        **shares_of(run, metric),
                        **bracket_of(run, metric),
                        **{f"truth_{f}": expected[metric][f] for f in FACTORS},
                    }
                )
    return coverage_table(found, validated, seeds)


def coverage_table(
    draws: Mapping[str, Mapping[str, Sequence[Mapping[str, float]]]],
    validated: Mapping[str, bool],
    seeds: Sequence[int],
) -> dict[str, Any]:
    """`coverage`'s record from its draws: ``draws[model][metric]`` the replicates in seed order
    (each `shares_of` and `bracket_of` merged, with the truths), ``validated[metric]`` whether
    the metric is validated, ``seeds`` the replicates' seeds (``replicates``: the fewest
    replicates of any model)."""
    counts = [len(per) for per_metric in draws.values() for per in per_metric.values()]
    if not counts or min(counts) < 2:
        raise ConfigError(
            f"coverage needs at least 2 replicates of every model, got {min(counts or [0])}."
        )
    table = {
        name: {metric: coverage_of(replicates) for metric, replicates in per_metric.items()}
        for name, per_metric in draws.items()
    }
    passed = all(
        entry["covers_truth"] >= COVERAGE_TARGET
        for name, per_metric in table.items()
        for metric, quantities in per_metric.items()
        if validated[metric]
        for quantity, entry in quantities.items()
        if quantity in coverage_counted(name)
    )
    return {
        "replicates": min(counts),
        "seeds": list(seeds),
        "target": COVERAGE_TARGET,
        "validated_metrics": [m for m, ok in validated.items() if ok],
        "models": table,
        "passed": passed,
        "draws": {name: {m: list(r) for m, r in per.items()} for name, per in draws.items()},
    }


def coverage_counted(name: str) -> tuple[str, ...]:
    """The quantities whose coverage of the truth ``validate --coverage`` requires on planted
    model ``name``: each whole bracket, and on identifiable models the point S, B, D too (on an
    ambiguous model the point share estimates the bracket's lower end, not the truth)."""
    brackets = tuple(f"{factor}_bracket" for factor in FACTORS)
    return (*FACTORS, *brackets) if planted.IDENTIFIABLE.get(name, False) else brackets


def coverage_of(replicates: Sequence[Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Coverage per quantity over replicated runs of one model and metric (`coverage`'s
    ``"models"`` entries); each replicate: `shares_of` and `bracket_of` merged, with the truth
    as ``truth_S``, ``truth_B``, ``truth_D``."""
    table: dict[str, dict[str, float]] = {}
    for factor in FACTORS:
        quantities = {
            factor: (factor, f"{factor}_lo", f"{factor}_hi"),
            f"{factor}_lower": (f"{factor}_lower", f"{factor}_lower_lo", f"{factor}_lower_hi"),
            f"{factor}_upper": (f"{factor}_upper", f"{factor}_upper_lo", f"{factor}_upper_hi"),
            f"{factor}_bracket": (None, f"{factor}_lower_lo", f"{factor}_upper_hi"),
        }
        for name, (point, low, high) in quantities.items():
            truths = [r[f"truth_{factor}"] for r in replicates]
            lows, highs = [r[low] for r in replicates], [r[high] for r in replicates]
            entry = {"covers_truth": _fraction(lows, highs, truths)}
            if point is not None:
                # Each replicate has its own model and truth: judge the estimates by their errors.
                errors = [r[point] - t for r, t in zip(replicates, truths, strict=True)]
                bias = statistics.fmean(errors)
                entry["covers_debiased"] = _fraction(lows, highs, [t + bias for t in truths])
                standard_error = statistics.fmean(
                    (h - lo) / (2 * 1.96) for lo, h in zip(lows, highs, strict=True)
                )
                spread = statistics.stdev(errors)
                # An interval of width 0 is honest only where the errors do not move.
                entry["spread_ratio"] = (
                    spread / standard_error
                    if standard_error > 0
                    else (1.0 if spread == 0 else math.inf)
                )
            table[name] = entry
    return table


def rows_from_json(document: Mapping[str, Any]) -> list[ValidationRow]:
    """The rows of a ``validation.json`` document (what `save` wrote) as `ValidationRow`."""
    rows = []
    for entry in document["rows"]:
        fields = decode_json({key: value for key, value in entry.items() if key != "judgement"})
        rows.append(ValidationRow(**fields, judgement=Judgement(**entry["judgement"])))
    return rows


def rejudge(rows: Sequence[ValidationRow]) -> list[ValidationRow]:
    """``rows`` judged again by the rules as they are now: each row's verdict decided afresh
    from its bracket record (`dcp_lens.protocol.verdicts.share_verdict`), then the bracket rule
    and the verdict count. The protocol's numbers are not recomputed: this follows a change to
    the verdict or the judge, not to the protocol."""
    judged = []
    for row in rows:
        record = dict(row.record)
        if record:
            numbers = {k: float(v) for k, v in record.items() if isinstance(v, int | float)}
            decided = share_verdict(numbers, BracketRule())
            record.update(
                verdict=decided.verdict,
                reason=decided.reason,
                bound=decided.bound,
                stable=decided.stable,
                S_identified=decided.S_identified,
                B_identified=decided.B_identified,
            )
        judgement = judge_bracket(
            row.bracket, row.shares, row.per_k, row.expected, row.identifiable, record or None
        )
        judged.append(
            dataclasses.replace(row, judgement=judgement, passed=judgement.passed, record=record)
        )
    return judged


def rejudge_file(path: str | Path) -> Path:
    """Rewrite the ``validation.json`` at ``path`` with its rows judged again (`rejudge`),
    keeping its settings and coverage."""
    path = Path(path)
    document = json.loads(path.read_text())
    rows = rejudge(rows_from_json(document))
    document.update(
        rows=[dataclasses.asdict(row) for row in rows],
        summary=summarize(rows),
        passed=suite_passed(rows) and (document.get("coverage") or {}).get("passed", True),
    )
    document.setdefault("rules", {}).update(verdict_rate=VERDICT_RATE, claimed_share=CLAIMED_SHARE)
    path.write_text(json.dumps(encode_json(document), indent=2, allow_nan=False) + "\n")
    return path


def save(
    rows: Sequence[ValidationRow],
    out: Path,
    settings: dict[str, object],
    coverage_table: dict[str, Any] | None = None,
) -> None:
    """Write ``out/validation.json`` (settings, rules, rows, the summary per metric, coverage
    where measured, verdict) and ``out/validation.md``, each whole or not at all, into a new
    folder or one validate wrote (`dcp_lens.utils.folders.OutputFolder`)."""
    document: dict[str, Any] = {
        "settings": settings,
        "rules": {
            "truth_slack": TRUTH_SLACK,
            "narrow_width": NARROW_WIDTH,
            "point_tolerance": POINT_TOLERANCE,
            "false_alarm_rate": FALSE_ALARM_RATE,
            "coverage_target": COVERAGE_TARGET,
            "verdict_rate": VERDICT_RATE,
            "claimed_share": CLAIMED_SHARE,
        },
        "rows": [asdict(row) for row in rows],
        "summary": summarize(rows),
        "passed": suite_passed(rows) and (coverage_table or {}).get("passed", True),
    }
    if coverage_table is not None:
        document["coverage"] = coverage_table
    text = json.dumps(encode_json(document), indent=2, allow_nan=False)
    lines = markdown(rows) if rows else []
    if coverage_table is not None:
        lines += ([""] if lines else []) + coverage_markdown(coverage_table)
    with OutputFolder(out, "validate", on_finished="replace") as folder:
        write_text_atomically(folder / "validation.json", text + "\n")
        write_text_atomically(folder / "validation.md", "\n".join(lines) + "\n")


def run_validation(
    models: Sequence[str] | None,
    *,
    config: ProtocolConfig,
    n_eval: int,
    n_calibration: int,
    replicates: int | None = None,
    out: Path | None = None,
    progress: bool = True,
    width: int | None = None,
) -> bool:
    """``dcp-lens validate``: the suite (or, with ``replicates``, the coverage
    table) printed, then written to ``out`` (checked before the work starts), each planted
    model embedded at ``width`` where given. Returns whether it passed."""
    if out is not None:
        OutputFolder(out, "validate", on_finished="replace").plan()
    started = time.perf_counter()
    table = None
    rows: list[ValidationRow] = []
    if replicates is not None:
        mixtures = [n for n in MIXTURES if n not in (models or ())]
        table = coverage(
            [*mixtures, *(models or ())],
            config=config,
            replicates=replicates,
            n_eval=n_eval,
            n_calibration=n_calibration,
            progress=progress,
            width=width,
        )
        print("\n".join(coverage_markdown(table)))
    else:
        rows = validate(
            models,
            config=config,
            n_eval=n_eval,
            n_calibration=n_calibration,
            progress=progress,
            width=width,
        )
        print("\n".join(markdown(rows)))
    seconds, peak = time.perf_counter() - started, peak_memory(torch.device("cpu"))[0]
    if out is not None:
        settings = {
            "seed": config.seed,
            "n_eval": n_eval,
            "n_calibration": n_calibration,
            "n_bootstrap": config.n_bootstrap,
            "config": config.to_dict(),
            **({} if width is None else {"width": width}),
            "seconds": round(seconds, 1),
            "peak_rss_mib": round(peak),
        }
        save(rows, out, settings, table)
        print(f"wrote {out / 'validation.json'} and {out / 'validation.md'}")
    return bool(table["passed"]) if table is not None else suite_passed(rows)


def markdown(rows: Sequence[ValidationRow]) -> list[str]:
    """The lines of the validation table in markdown, then one summary line per metric."""
    lines = [
        "| planted model | metric | identifiable | truth S / B / D | point S / B / D "
        "| S bracket | B bracket | D bracket | S width | flags below r | verdict | result |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        truth = " / ".join(_number(row.expected[f], 2) for f in FACTORS)
        point = " / ".join(_number(row.shares[f], 2) for f in FACTORS)
        brackets = [_bracket(row.bracket, f) for f in FACTORS]
        width = _number(row.bracket["S_width_hi"], 2)
        lines.append(
            f"| {row.model} | {row.metric} | {'yes' if row.identifiable else 'no'} | {truth} "
            f"| {point} | " + " | ".join(brackets) + f" | {width} | {_flag_cell(row)} "
            f"| {row.judgement.verdict} | {_result(row)} |"
        )
    lines.append("")
    for metric, s in summarize(rows).items():
        lines.append(
            f"{metric}: {s['rows_passed']} of {s['rows']} rows pass"
            + (f" (failing: {', '.join(s['failing'])})" if s["failing"] else "")
            + f"; false alarms {s['false_alarms']} of {s['alarm_ks']} identifiable k's"
            f" ({s['false_alarm_rate']:.1%}, at most {FALSE_ALARM_RATE:.0%})"
            f"; verdicts right {s['verdicts_right']} of {s['verdicts_judged']} identifiable rows"
            f" ({s['verdict_rate']:.0%}, at least {VERDICT_RATE:.0%})"
            + (
                f"; confidently wrong: {', '.join(s['confidently_wrong'])}"
                if s["confidently_wrong"]
                else ""
            )
            + ("" if s["counted"] else "; not validated, not counted")
            + f": {'pass' if s['passed'] else 'FAIL'}."
        )
    return lines


def coverage_markdown(table: Mapping[str, Any]) -> list[str]:
    """The coverage table in markdown: per model and metric, each quantity's coverage of the
    truth (and, where it has a point estimate, of the truth plus its mean error, with the spread
    ratio)."""
    lines = [
        f"Coverage of the 95% intervals over {table['replicates']} replicates (seeds "
        f"{table['seeds'][0]}-{table['seeds'][-1]}; target {table['target']:.0%} on the starred "
        "quantities of validated metrics): covers truth / covers truth + mean error / spread "
        "ratio.",
        "",
        "| planted model | metric | quantity | covers truth | covers debiased | spread ratio |",
        "|---|---|---|---|---|---|",
    ]
    for name, per_metric in table["models"].items():
        for metric, quantities in per_metric.items():
            for quantity, entry in quantities.items():
                star = "*" if quantity in coverage_counted(name) else ""
                mean = entry.get("covers_debiased")
                ratio = entry.get("spread_ratio")
                lines.append(
                    f"| {name} | {metric} | {quantity}{star} | {entry['covers_truth']:.2f} "
                    f"| {'-' if mean is None else f'{mean:.2f}'} "
                    f"| {'-' if ratio is None else _number(ratio, 1)} |"
                )
    lines.append("")
    lines.append(f"coverage: {'pass' if table['passed'] else 'FAIL'}.")
    return lines


def _suite_budget(config: ProtocolConfig) -> ProtocolConfig:
    """``config`` with its memory budget read once for the whole suite (where not given): every
    planted model is planned against what the machine could give when the suite started, so a
    model late in the suite is not refused because another process took memory meanwhile."""
    if config.memory_budget is not None:
        return config
    budget = budget_bytes(None, torch.device("cpu"))  # planted models run on the CPU
    return config if budget is None else config.replace(memory_budget=budget / GIB)


def _models(models: Sequence[str] | None) -> tuple[str, ...]:
    names = tuple(models) if models else planted.BRACKET_PLANTED
    unknown = [name for name in names if name not in planted.BUILDERS]
    if unknown:
        raise ConfigError(
            f"unknown planted models {unknown}; choose from {planted.BRACKET_PLANTED}."
        )
    return names


def _config(
    config: ProtocolConfig | None, metrics: Sequence[str] | None, settings: dict[str, object]
) -> ProtocolConfig:
    config = (config or VALIDATE_CONFIG).replace(**settings)
    wanted = tuple(metrics) if metrics else (config.metrics or tuple(METRICS))
    if any(metric not in METRICS for metric in wanted):
        raise ConfigError(f"metrics {list(wanted)} must be a subset of {METRICS}.")
    return config.replace(metrics=wanted)


def _run_planted(
    name: str,
    config: ProtocolConfig,
    n_eval: int,
    n_calibration: int,
    progress: bool,
    width: int | None = None,
) -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
    """One planted model built and run with ``config.seed`` (embedded at ``width`` where
    given): its results.json run and the true shares per metric."""
    model = planted.BUILDERS[name](seed=config.seed)
    if width is not None:
        model = embed(model, width, seed=config.seed)
    task = model.planted_task
    evaluation, calibration = task.evaluation(n_eval), task.calibration(n_calibration)
    protocol = DepthControlProtocol(model, config, spec=f"planted:{name}", progress=progress)
    run = protocol.run(evaluation, calibration).to_results_json()
    expected = {
        metric: planted.expected_shares(name, model, evaluation, metric, protocol.context.k_grid)
        for metric in config.metrics or ()
    }
    return run, expected


def _row(
    name: str, metric: str, run: Mapping[str, Any], expected: dict[str, float]
) -> ValidationRow:
    identifiable = planted.IDENTIFIABLE[name]
    shares = shares_of(run, metric)
    judgement = judge_run(run, metric, expected, identifiable)
    validated = run.get("metrics", {}).get(metric, {}).get("validated", True)
    return ValidationRow(
        model=name,
        metric=metric,
        planted=planted.EXPECTED_FACTOR[name],
        identifiable=identifiable,
        shares=shares,
        bracket=bracket_of(run, metric),
        expected=expected,
        per_k=per_k_of(run, metric),
        judgement=judgement,
        passed=judgement.passed,
        point_rule_passed=point_rule_passes(planted.EXPECTED_FACTOR[name], shares, expected),
        counted=validated is not False,
        flags=_flags(run, metric),
        record=dict(run.get("bracket", {}).get(metric) or {}),
    )


def _flags(run: Mapping[str, Any], metric: str) -> dict[str, object]:
    """The verdict, stability and validation record the results carry for ``metric``."""
    shares = {**run["shares"][metric], **run.get("bracket", {}).get(metric, {})}
    flags = {key: shares[key] for key in ("verdict", "bound", "stable") if key in shares}
    record = run.get("metrics", {}).get(metric, {})
    if "validated" in record:
        flags["validated"] = record["validated"]
        if record.get("reason") and not record["validated"]:
            flags["reason"] = record["reason"]
    return flags


def _flag_cell(row: ValidationRow) -> str:
    j = row.judgement
    if row.identifiable:
        return f"S unidentified at {j.false_alarms} of {j.alarm_ks} k"
    return "flagged at every k" if j.flagged_every_k else f"unflagged at k={j.unflagged_ks}"


def _result(row: ValidationRow) -> str:
    """pass / FAIL with the failed tests, and whether the row is counted."""
    j = row.judgement
    why = [f"truth outside {','.join(j.outside)}"] if j.outside else []
    if row.identifiable:
        why += [] if j.narrow else ["S bracket wide"]
        why += [] if j.point_ok else ["point off"]
    elif not j.flagged_every_k:
        why.append("not flagged")
    if j.confident_wrong:
        why.append(f"verdict {j.verdict} names a factor below {CLAIMED_SHARE:g} of the gap")
    text = "pass" if row.passed else f"FAIL ({'; '.join(why)})"
    return text + ("" if row.counted else " (not validated)")


def _fraction(lows: Sequence[float], highs: Sequence[float], values: Sequence[float]) -> float:
    return sum(lo <= v <= h for lo, h, v in zip(lows, highs, values, strict=True)) / len(values)


def _number(value: float, digits: int = 3) -> str:
    return "nan" if math.isnan(value) else f"{round(value, digits) + 0.0:.{digits}f}"


def _bracket(bracket: Mapping[str, float], factor: str) -> str:
    low, high = bracket[f"{factor}_lower_lo"], bracket[f"{factor}_upper_hi"]
    return f"[{_number(low, 2)}, {_number(high, 2)}]"
