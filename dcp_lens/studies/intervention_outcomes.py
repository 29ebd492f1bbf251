"""Derived results of the controlled training intervention (docs/design.md §6): each run's numbers,
their aggregate over seeds, and the verdict on the prediction (`PREDICTION`). Pure functions over
numbers; `dcp_lens.studies.intervention` runs the trainings and writes the files,
`dcp_lens.studies.intervention_markdown` renders them in words.

Per regime, ``S``, ``B``, ``D`` are the means over seeds of each run's share of the gap's area and
``slope`` the mean of each run's classic truncation slope (`Decomposition.truncation_slope`); their
``_lo`` / ``_hi`` are a t-interval over seeds (mean +- t_{0.975, n-1} sd / sqrt(n)), or with a
single seed that run's own bootstrap interval over evaluation examples. A run whose truncation gap
has zero area (it predicts the same at every depth) has no shares; it is left out of them and
listed in ``undefined_seeds``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import NotRequired, TypedDict

import numpy as np

from dcp_lens.protocol.results import FACTORS, ProtocolResults
from dcp_lens.protocol.statistics import t_interval

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
# The ends of each run's S and D brackets (docs/bracket.md) in the metric's units, means over the
# share k grid like the above: the verdict compares brackets, so that a bound cannot reverse it.
BRACKET_ABSOLUTE = ("S_lower_abs", "S_upper_abs", "D_lower_abs", "D_upper_abs")
AGGREGATED = (*FACTORS, "slope", *ABSOLUTE, *BRACKET_ABSOLUTE)

# One run's numbers (`seed_numbers`): numbers by name, its seed, its own verdict and the k where
# its S is not identified.
SeedValue = float | int | str | bool | list[int] | None
SeedRow = dict[str, SeedValue]
# One regime over seeds (`aggregate`): numbers by name and the seed lists, counts and rows
# beside them.
RegimeValue = float | int | list[int] | list[str | None] | list[SeedRow] | dict[str, int] | None
Regime = Mapping[str, RegimeValue]


class Check(TypedDict):
    """A check of the verdict: its label (`LABELS`), why in words, what the measured values
    alone say where a compared value is a bound, and the slope a slope check predicted."""

    label: str
    why: str
    measured: NotRequired[str]
    predicted_slope: NotRequired[float]


def shared_metric(runs: Mapping[str, list[tuple[int, ProtocolResults]]]) -> str:
    """The protocol's first metric (its default: accuracy on tasks with answers), which every
    run must share."""
    metrics = {results.metrics[0] for per_regime in runs.values() for _, results in per_regime}
    if len(metrics) != 1:
        raise ValueError(f"the runs decomposed different first metrics {sorted(metrics)}.")
    return metrics.pop()


def validated_metrics(runs: Mapping[str, list[tuple[int, ProtocolResults]]]) -> list[str]:
    """The metrics every run decomposed and marked validated, in the first run's order."""
    everyone = [results for per_regime in runs.values() for _, results in per_regime]
    if not everyone:
        return []
    return [
        metric
        for metric in everyone[0].metrics
        if all(
            metric in results.decompositions and results.decompositions[metric].validated
            for results in everyone
        )
    ]


def seed_numbers(seed: int, results: ProtocolResults, metric: str) -> SeedRow:
    """One run's shares and slope (with bootstrap intervals), its gap and factors in the metric's
    units (means over the share k grid), and its accuracy at k = r and k = 1: a row of
    `aggregate`'s ``per_seed``."""
    decomposition = results.decompositions[metric]
    row: SeedRow = {"seed": seed, **decomposition.shares}
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
    in_grid = [k in decomposition.share_k_grid for k in decomposition.k_grid]
    for name in BRACKET_ABSOLUTE:
        end = name.removesuffix("_abs")
        if decomposition.bracket is None or not any(in_grid):
            value = math.nan
        else:
            value = float(np.asarray(decomposition.bracket[end], np.float64)[in_grid].mean())
        row.update({name: value, f"{name}_lo": math.nan, f"{name}_hi": math.nan})
    shares = decomposition.bracket_shares or {}
    row["dcp_verdict"] = shares.get("verdict")
    row["S_identified"] = shares.get("S_identified")
    # Where S is not identified (a wide bracket; before brackets: calibrated states that stay
    # distinguishable from full depth), S(k) is a lower bound and D(k) an upper bound.
    identified = decomposition.s_identified
    row["S_unidentified_k"] = (
        []
        if identified is None
        else [
            int(k)
            for k, ok, used_k in zip(decomposition.k_grid, identified, in_grid, strict=True)
            if used_k and not ok
        ]
    )
    accuracy = results.decompositions.get("accuracy")
    if accuracy is None:
        row.update(full_accuracy=math.nan, k1_accuracy=math.nan)
    else:
        truncated = dict(zip(accuracy.k_grid, accuracy.curves["truncate"], strict=True))
        row.update(full_accuracy=accuracy.full, k1_accuracy=float(truncated.get(1, math.nan)))
    return row


def aggregate(per_seed: Sequence[SeedRow]) -> dict[str, RegimeValue]:
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
        "S_bound_seeds", "per_seed"}``: ``n_seeds`` maps each quantity to the number of seeds it
        is taken over, ``undefined_seeds`` lists the seeds left out of any of them,
        ``S_bound_seeds`` the seeds whose S is not identified at some k of the share grid (there
        S is a lower bound and D an upper bound).
    """
    if not per_seed:
        raise ValueError("per_seed is empty; aggregate needs at least one seed's run.")
    summary: dict[str, RegimeValue] = {}
    counts: dict[str, int] = {}
    undefined: set[int] = set()
    for name in AGGREGATED:
        # A run made before the bracket has no bracket ends: NaN there, and not "undefined".
        defined = [row for row in per_seed if math.isfinite(number(row, name))]
        if name not in BRACKET_ABSOLUTE:
            undefined |= {_seed(row) for row in per_seed} - {_seed(r) for r in defined}
        values = np.array([number(row, name) for row in defined])
        counts[name] = len(defined)
        if not defined:
            low = high = mean = math.nan
        elif len(defined) == 1:
            mean, low, high = (number(defined[0], name + s) for s in ("", "_lo", "_hi"))
        else:
            mean = float(values.mean())
            low, high = t_interval(values, CONFIDENCE)
        summary.update({name: mean, f"{name}_lo": low, f"{name}_hi": high})
    summary["n_seeds"] = counts
    summary["seeds"] = [_seed(row) for row in per_seed]
    summary["S_bound_seeds"] = [
        _seed(row)
        for row in per_seed
        if (row.get("S_identified") is False)
        or (row.get("S_identified") is None and row.get("S_unidentified_k"))
    ]
    summary["verdicts"] = [_label(row.get("dcp_verdict")) for row in per_seed]
    summary["undefined_seeds"] = sorted(undefined)
    summary["per_seed"] = [dict(row) for row in per_seed]
    return summary


# ------------------------------------------------------------------------------ the verdict
# Each check returns its ``label`` and ``why`` (the reason in words);
# `dcp_lens.studies.intervention_markdown.explain_verdict` adds the numbers it compared.


def s_verdict(tested: Regime, fixed: Regime) -> Check:
    """Is S of ``tested`` lower than S of ``fixed``, in the metric's units (``S_abs``)?

    Where both regimes carry S brackets (``S_lower_abs``, ``S_upper_abs``: runs made with the
    bracket, docs/bracket.md) the brackets decide (`_s_on_brackets`); otherwise, on the point
    values:
    ``supported``: lower, and the intervals do not overlap (``S_abs_hi < fixed S_abs_lo``);
    ``not resolved``: lower but the intervals overlap, or a value is NaN, or lower while the
    tested regime's S is a lower bound (not identified in some seed), or not lower while
    fixed's S is a lower bound (a measured S that is a bound is only compared where the bound
    points the same way as the claim);
    ``not supported``: not lower.

    Returns:
        ``{"label", "why"}``.
    """
    if not _finite(tested, fixed, "S_abs"):
        return _check("not resolved", "a value is undefined (NaN)")
    if _bracketed(tested, fixed, "S"):
        return _s_on_brackets(tested, fixed)
    if number(tested, "S_abs") >= number(fixed, "S_abs"):
        measured = _check("not supported", "not lower")
        if fixed.get("S_bound_seeds"):  # fixed's S may be larger than measured
            return _on_bounds(measured, "fixed's S is a lower bound")
        return measured
    if number(tested, "S_abs_hi") < number(fixed, "S_abs_lo"):
        measured = _check("supported", "lower, the intervals do not overlap")
    else:
        measured = _check("not resolved", "lower, but the intervals overlap")
    if tested.get("S_bound_seeds"):  # its S may be larger than measured
        return _on_bounds(measured, "the tested regime's S is a lower bound")
    return measured


def d_verdict(tested: Regime, fixed: Regime) -> Check:
    """Does D (in the metric's units, ``D_abs``) stay? With D brackets in both regimes:
    ``supported`` when the brackets, their outer intervals included, overlap, ``not supported``
    when they are apart. Without: ``supported`` when the intervals of
    ``tested`` and ``fixed`` overlap, ``not supported`` when they do not, ``not resolved`` when a
    value is NaN or either regime's S is not identified in some seed (its D is then an upper
    bound, which neither claim can rest on).

    Returns:
        ``{"label", "why"}``.
    """
    if not _finite(tested, fixed, "D_abs"):
        return _check("not resolved", "a value is undefined (NaN)")
    if _bracketed(tested, fixed, "D"):
        low, high = (number(tested, "D_lower_abs_lo"), number(tested, "D_upper_abs_hi"))
        if low <= number(fixed, "D_upper_abs_hi") and number(fixed, "D_lower_abs_lo") <= high:
            return _check("supported", "the D brackets (intervals included) overlap")
        return _check("not supported", "the D brackets (intervals included) are apart")
    low, high = number(tested, "D_abs_lo"), number(tested, "D_abs_hi")
    if low <= number(fixed, "D_abs_hi") and number(fixed, "D_abs_lo") <= high:
        measured = _check("supported", "the intervals overlap")
    else:
        measured = _check("not supported", "the intervals do not overlap")
    if tested.get("S_bound_seeds") or fixed.get("S_bound_seeds"):
        return _on_bounds(measured, "D is an upper bound where S is not identified")
    return measured


def slope_verdict(tested: Regime, fixed: Regime) -> Check:
    """Does the slope flatten by about the change in S?

    If the regime removes ``fixed S_abs - tested S_abs`` from fixed's gap (``gap_abs``, both
    means over k), the slope (linear in the gap) scales by ``1 - that / fixed gap_abs``:
    predicted slope = fixed slope x that factor.
    ``supported``: the predicted slope lies in the tested slope's interval and the fixed slope
    does not; ``not resolved``: both lie in it (the change cannot be told from no change), or a
    value is NaN; ``not supported``: the predicted slope lies outside it.

    Returns:
        ``{"label", "why", "predicted_slope"}``.
    """
    gap = number(fixed, "gap_abs")
    removed = (number(fixed, "S_abs") - number(tested, "S_abs")) / gap if gap else math.nan
    predicted = number(fixed, "slope") * (1.0 - removed)
    values = [
        predicted,
        number(tested, "slope_lo"),
        number(tested, "slope_hi"),
        number(fixed, "slope"),
    ]
    if not all(math.isfinite(v) for v in values):
        check = _check("not resolved", "a value is undefined (NaN)")
        check["predicted_slope"] = predicted
        return check
    inside = number(tested, "slope_lo") <= predicted <= number(tested, "slope_hi")
    fixed_inside = (
        number(tested, "slope_lo") <= number(fixed, "slope") <= number(tested, "slope_hi")
    )
    if not inside:
        label, why = "not supported", "the prediction lies outside the interval"
    elif fixed_inside:
        label, why = "not resolved", "the interval also holds the fixed slope"
    else:
        label, why = "supported", "the prediction lies in the interval, the fixed slope does not"
    check = _check(label, why)
    check["predicted_slope"] = predicted
    return check


def prediction_checks(regimes: Mapping[str, Regime]) -> dict[str, dict[str, Check]]:
    """For each of `TESTED_REGIMES`: ``{"S_lower", "D_stays", "slope_follows_S"}``, each a
    ``{"label", "why"}`` (labels in `LABELS`; ``not tested`` when the regime or ``fixed``
    was not run). ``regimes`` maps a regime name to its `aggregate` (None read as NaN)."""
    checks: dict[str, Callable[[Regime, Regime], Check]] = {
        "S_lower": s_verdict,
        "D_stays": d_verdict,
        "slope_follows_S": slope_verdict,
    }
    result: dict[str, dict[str, Check]] = {}
    for regime in TESTED_REGIMES:
        missing = [name for name in (regime, BASELINE) if name not in regimes]
        if missing:
            why = f"no {' or '.join(missing)} runs"
            result[regime] = {name: _check("not tested", why) for name in checks}
            continue
        tested, fixed = _decoded(regimes[regime]), _decoded(regimes[BASELINE])
        result[regime] = {name: check(tested, fixed) for name, check in checks.items()}
    return result


def mean_over_seeds(row: Regime, name: str) -> float:
    """The mean of the per-seed number ``name`` of an `aggregate` over the seeds where it is
    defined (NaN when none is)."""
    per_seed = row["per_seed"]
    entries = per_seed if isinstance(per_seed, list) else []
    values = (number(entry, name) for entry in entries if isinstance(entry, dict))
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


# ----------------------------------------------------------------------------- internals


def _decoded(row: Regime) -> dict[str, RegimeValue]:
    """An aggregate with JSON's None read back as NaN (numbers only)."""
    return {key: math.nan if value is None else value for key, value in row.items()}


def _finite(tested: Regime, fixed: Regime, name: str) -> bool:
    keys = (name, f"{name}_lo", f"{name}_hi")
    return all(math.isfinite(number(row, key)) for row in (tested, fixed) for key in keys)


def _bracketed(tested: Regime, fixed: Regime, factor: str) -> bool:
    """Both regimes carry the ``factor`` bracket's ends in units, with intervals."""
    names = (f"{factor}_lower_abs", f"{factor}_upper_abs")
    keys = [f"{name}{suffix}" for name in names for suffix in ("", "_lo", "_hi")]
    if not all(key in row for row in (tested, fixed) for key in keys):
        return False  # runs made before the bracket
    return all(_finite(tested, fixed, name) for name in names)


def _s_on_brackets(tested: Regime, fixed: Regime) -> Check:
    """*S lower* on the S brackets in units: ``supported`` when the tested regime's whole bracket
    (its upper end's interval included) lies below fixed's (its lower end's interval included)
    and fixed's S is clearly above zero (a negative S, a map that costs quality, is not a shift
    that shrank);
    ``not supported`` when the tested bracket's lower end is at least fixed's upper end (no
    value in one bracket is lower than any in the other); otherwise ``not resolved``, with what
    the lower ends alone (the point estimates) say beside it."""
    if number(tested, "S_lower_abs") >= number(fixed, "S_upper_abs"):
        return _check("not supported", "the whole S bracket is at least fixed's")
    no_shift = not number(fixed, "S_lower_abs_lo") > 0
    if number(tested, "S_upper_abs_hi") < number(fixed, "S_lower_abs_lo") and not no_shift:
        return _check("supported", "the whole S bracket is lower, intervals included")
    if number(tested, "S_abs") >= number(fixed, "S_abs"):
        measured = _check("not supported", "not lower")
    elif number(tested, "S_abs_hi") < number(fixed, "S_abs_lo"):
        measured = _check("supported", "lower, the intervals do not overlap")
    else:
        measured = _check("not resolved", "lower, but the intervals overlap")
    if no_shift:  # a negative S (a map that costs accuracy) is not a readout shift that shrank
        return _on_bounds(measured, "fixed's S bracket reaches zero: it has no S to shrink")
    return _on_bounds(measured, "the S brackets overlap")


def _check(label: str, why: str) -> Check:
    return {"label": label, "why": why}


def number(row: Mapping[str, object], name: str) -> float:
    """The number ``name`` of a run or regime (None, JSON's NaN, and absent as NaN)."""
    value = row.get(name)
    if value is None:
        return math.nan
    if not isinstance(value, int | float):
        raise TypeError(f"{name}={value!r} is not a number.")
    return float(value)


def _seed(row: Mapping[str, object]) -> int:
    seed = row["seed"]
    if not isinstance(seed, int):
        raise TypeError(f"seed={seed!r} is not an integer.")
    return seed


def _label(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _on_bounds(measured: Check, bound: str) -> Check:
    """``not resolved`` where a compared value is a bound, keeping what the measured values
    alone would say (``measured``) for the reader."""
    return {
        "label": "not resolved",
        "why": f"{measured['why']} ({measured['label']} on the measured values); {bound}",
        "measured": measured["label"],
    }
