"""`dcp-lens validate`: DCP on every planted model of known ground truth, on every metric.

A row per (planted model, metric): the planted factor(s), each share with its interval, the
true shares (`dcp_lens.zoo.planted.expected_shares`) and whether DCP recovered them:

- a single-factor model passes when its factor carries >= 0.9 of the gap's area and every other
  factor lies within +-0.1 (the contract of `dcp_lens.zoo.planted`: S 1.4 with B -0.4 is no
  recovery);
- a mixture passes when every share is within 0.1 of the true share.

A metric the results mark ``validated: false`` (``runs[].metrics[metric]``) is reported with its
verdict but not counted as a failure of the suite. Flags the results carry (``stable`` beside the
shares, ``S_identified`` / ``B_identified`` in the decomposition rows) are read when present and
shown. This module runs the protocol and judges; the numbers come from `DepthControlProtocol`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dcp_lens.protocol.config import COMMAND_DEFAULTS, ProtocolConfig
from dcp_lens.protocol.dcp import DepthControlProtocol
from dcp_lens.protocol.metrics import METRICS
from dcp_lens.protocol.results import FACTORS, encode_json
from dcp_lens.zoo import planted

SINGLE_FACTOR_PASS = 0.9  # the planted factor's least share of the gap's area
MIXTURE_TOLERANCE = 0.1  # the largest |share - true share| of a mixture


@dataclass(frozen=True)
class ValidationRow:
    """DCP against the truth on one planted model and one metric."""

    model: str
    metric: str
    planted: str  # "S", "B", "D", or a mixture's "S+D"
    shares: dict[str, float]  # S, B, D and each _lo / _hi
    expected: dict[str, float]  # the true S, B, D
    passed: bool
    counted: bool  # False where the results mark the metric not validated
    flags: dict[str, Any] = field(default_factory=dict)


def judge(planted_factor: str, shares: dict[str, float], expected: dict[str, float]) -> bool:
    """The suite's rule: a single factor >= 0.9 of the gap and the others within +-0.1; a
    mixture's shares each within 0.1 of the truth."""
    if planted_factor in FACTORS:
        others = [f for f in FACTORS if f != planted_factor]
        return shares[planted_factor] >= SINGLE_FACTOR_PASS and all(
            abs(shares[f]) <= MIXTURE_TOLERANCE for f in others
        )
    return all(abs(shares[f] - expected[f]) <= MIXTURE_TOLERANCE for f in FACTORS)


# The protocol settings of `dcp-lens validate`: eleven models on every metric, so fewer bootstrap
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
    **settings: Any,
) -> list[ValidationRow]:
    """Run DCP on each planted model (default: all of `dcp_lens.zoo.planted.PLANTED`, built with
    the config's seed) on each metric (default: every metric of
    `dcp_lens.protocol.metrics.METRICS`).

    Args:
        models: planted model names.
        metrics: metric names (replace ``config.metrics``).
        config: the protocol settings (default: `VALIDATE_CONFIG`).
        n_eval, n_calibration: evaluation and calibration sequences of each planted task.
        progress: progress bars.
        **settings: fields of `ProtocolConfig` that replace the config's (``seed=1``,
            ``n_bootstrap=100``, ``calibration_mode="diag"``, ...).

    Returns:
        One `ValidationRow` per (model, metric), models in the given order.
    """
    names = tuple(models) if models else planted.PLANTED
    unknown = [name for name in names if name not in planted.BUILDERS]
    if unknown:
        raise ValueError(f"unknown planted models {unknown}; choose from {planted.PLANTED}.")
    config = (config or VALIDATE_CONFIG).replace(**settings)
    wanted = tuple(metrics) if metrics else (config.metrics or tuple(METRICS))
    if any(metric not in METRICS for metric in wanted):
        raise ValueError(f"metrics {list(wanted)} must be a subset of {METRICS}.")
    config = config.replace(metrics=wanted)
    rows = []
    for name in names:
        model = planted.BUILDERS[name](seed=config.seed)
        task = model.planted_task
        evaluation, calibration = task.evaluation(n_eval), task.calibration(n_calibration)
        protocol = DepthControlProtocol(model, config, spec=f"planted:{name}", progress=progress)
        run = protocol.run(evaluation, calibration).to_results_json()
        for metric in wanted:
            shares = _shares(run, metric)
            expected = planted.expected_shares(name, model, evaluation, metric, protocol.k_grid)
            validated = run.get("metrics", {}).get(metric, {}).get("validated", True)
            rows.append(
                ValidationRow(
                    model=name,
                    metric=metric,
                    planted=planted.EXPECTED_FACTOR[name],
                    shares=shares,
                    expected=expected,
                    passed=judge(planted.EXPECTED_FACTOR[name], shares, expected),
                    counted=validated is not False,
                    flags=_flags(run, metric),
                )
            )
    return rows


def suite_passed(rows: Sequence[ValidationRow]) -> bool:
    """True when every counted row passed."""
    return all(row.passed for row in rows if row.counted)


def save(rows: Sequence[ValidationRow], out: Path, settings: dict[str, Any]) -> None:
    """Write ``out/validation.json`` (settings, rows, verdict) and ``out/validation.md``."""
    out.mkdir(parents=True, exist_ok=True)
    document = {
        "settings": settings,
        "rules": {"single_factor_min": SINGLE_FACTOR_PASS, "mixture_tolerance": MIXTURE_TOLERANCE},
        "rows": [asdict(row) for row in rows],
        "passed": suite_passed(rows),
    }
    text = json.dumps(encode_json(document), indent=2, allow_nan=False)
    (out / "validation.json").write_text(text + "\n")
    (out / "validation.md").write_text("\n".join(markdown(rows)) + "\n")


def markdown(rows: Sequence[ValidationRow]) -> list[str]:
    """The lines of the validation table in markdown."""
    lines = [
        "| planted model | metric | planted | S [lo, hi] | B [lo, hi] | D [lo, hi] "
        "| expected S / B / D | result | flags |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [_interval(row.shares, factor) for factor in FACTORS]
        expected = " / ".join(_number(row.expected[factor]) for factor in FACTORS)
        result = ("pass" if row.passed else "FAIL") + ("" if row.counted else " (not validated)")
        flags = ", ".join(f"{key}={value}" for key, value in row.flags.items()) or "-"
        lines.append(
            f"| {row.model} | {row.metric} | {row.planted} | " + " | ".join(cells)
            + f" | {expected} | {result} | {flags} |"
        )  # fmt: skip
    counted = [row for row in rows if row.counted]
    failed = [row for row in counted if not row.passed]
    lines.append("")
    lines.append(
        f"{len(counted) - len(failed)} of {len(counted)} counted rows pass"
        + (f"; failing: {', '.join(f'{r.model}/{r.metric}' for r in failed)}" if failed else "")
        + (f"; {len(rows) - len(counted)} not validated" if len(rows) > len(counted) else "")
        + "."
    )
    return lines


def _shares(run: dict[str, Any], metric: str) -> dict[str, float]:
    point = run["shares"][metric]
    interval = run["share_intervals"][metric]
    return {key: _float(value) for key, value in {**point, **interval}.items() if key[0] in "SBD"}


def _flags(run: dict[str, Any], metric: str) -> dict[str, Any]:
    """The flags the results carry for ``metric``, where the protocol writes them."""
    flags: dict[str, Any] = {}
    stable = run["shares"][metric].get("stable")
    if stable is not None:
        flags["stable"] = stable
    # At k = r every factor is 0 by construction; the flags speak of the k below r.
    rows = [
        row
        for row in run["decomposition"]
        if row["metric"] == metric and row["k"] < run["n_iterations"]
    ]
    for name in ("S_identified", "B_identified"):
        values = [row[name] for row in rows if name in row]
        if values:
            unidentified = [row["k"] for row in rows if row.get(name) is False]
            flags[name] = "all k" if not unidentified else f"not at k={unidentified}"
    record = run.get("metrics", {}).get(metric, {})
    if "validated" in record:
        flags["validated"] = record["validated"]
        if record.get("reason") and not record["validated"]:
            flags["reason"] = record["reason"]
    return flags


def _float(value: Any) -> float:
    return math.nan if value is None else float(value)


def _number(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:.3f}"


def _interval(shares: dict[str, float], factor: str) -> str:
    low, high = shares.get(f"{factor}_lo", math.nan), shares.get(f"{factor}_hi", math.nan)
    return f"{_number(shares[factor])} [{_number(low)}, {_number(high)}]"
