"""The controlled training intervention: `dcp-lens experiment training-intervention` end to end on
the tiny preset (trained once for the module), its aggregation read back from the saved runs,
resuming, and the verdict on hand-made numbers."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest

from dcp_lens.cli import main
from dcp_lens.protocol.results import ProtocolResults
from dcp_lens.protocol.statistics import t_interval
from dcp_lens.studies.intervention import run_training_intervention
from dcp_lens.studies.intervention_outcomes import (
    LABELS,
    PREDICTION,
    aggregate,
    d_verdict,
    prediction_checks,
    s_verdict,
    slope_verdict,
)
from dcp_lens.training import REGIMES, preset, train

SEEDS = (0, 1)
# Small DCP settings: the tiny models are for plumbing, not science.
SETTINGS = {"n_eval": 256, "n_calibration": 256, "n_bootstrap": 100, "probe": "none"}
CLI_SETTINGS = [
    "--n-eval", "256", "--n-calibration", "256", "--bootstrap", "100", "--probe", "none"
]  # fmt: skip


@pytest.fixture(scope="module")
def experiment(tmp_path_factory) -> tuple[Path, str]:
    """The experiment folder and what the CLI printed."""
    out = tmp_path_factory.mktemp("intervention")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(
            [
                "experiment",
                "training-intervention",
                "--preset",
                "tiny",
                "--seeds",
                "0,1",
                "--dense-seeds",
                "0,1",
                "--jobs",
                "2",
                *CLI_SETTINGS,
                "--quiet",
                "--out",
                str(out),
            ]
        )
    assert code == 0
    return out, printed.getvalue()


def _document(out: Path) -> dict:
    return json.loads((out / "intervention.json").read_text())


def _saved_run(out: Path, regime: str, seed: int) -> ProtocolResults:
    return ProtocolResults.load(out / "runs" / f"{regime}-seed{seed}" / "dcp")


def _finite(value) -> bool:
    return value is not None and math.isfinite(value)


def test_the_json_has_every_regime_with_intervals_and_seeds(experiment):
    out, printed = experiment
    document = _document(out)
    assert document["preset"] == "tiny" and document["metric"] == "accuracy"
    assert document["prediction"] == PREDICTION
    assert list(document["regimes"]) == list(REGIMES)
    keys = {"S", "S_lo", "S_hi", "B", "B_lo", "B_hi", "D", "D_lo", "D_hi", "slope", "slope_lo",
            "slope_hi", "seeds", "per_seed"}  # fmt: skip
    defined = 0
    for regime, row in document["regimes"].items():
        assert keys <= set(row), regime
        assert row["seeds"] == list(SEEDS)
        assert [entry["seed"] for entry in row["per_seed"]] == list(SEEDS)
        for name in ("S", "B", "D", "slope"):
            if _finite(row[name]):
                defined += 1
                assert row[f"{name}_lo"] <= row[name] <= row[f"{name}_hi"], (regime, name)
    assert defined >= 4  # at least the slopes: the checks above are not vacuous
    assert set(document["verdict"]) == {"every-iteration", "sampled"}
    for checks in document["verdict"].values():
        assert set(checks) == {"S_lower", "D_stays", "slope_follows_S"}
        assert all(check["label"] in LABELS and check["reason"] for check in checks.values())
    assert "| regime | seeds | S [lo, hi]" in printed and "| dense |" in printed


def test_regime_numbers_are_recomputed_from_the_saved_runs(experiment):
    out, _ = experiment
    document = _document(out)
    checked = 0
    for regime, row in document["regimes"].items():
        runs = [_saved_run(out, regime, seed).decompositions["accuracy"] for seed in SEEDS]
        per_seed = {
            "S": [run.shares["S"] for run in runs],
            "D": [run.shares["D"] for run in runs],
            "slope": [run.truncation_slope for run in runs],
            # the factor in accuracy units: its mean over the k where the shares are taken
            "S_abs": [
                float(
                    np.mean(
                        [
                            s
                            for k, s in zip(run.k_grid, run.cells["S"], strict=True)
                            if k in run.share_k_grid
                        ]
                    )
                )
                for run in runs
            ],
        }
        for name, values in per_seed.items():
            for entry, value in zip(row["per_seed"], values, strict=True):
                assert entry[name] == (value if math.isfinite(value) else None)
            finite = [v for v in values if math.isfinite(v)]
            assert row["n_seeds"][name] == len(finite)
            if not finite:
                assert row[name] is None
                continue
            assert row[name] == pytest.approx(np.mean(finite), abs=1e-12)
            if len(finite) >= 2:
                low, high = t_interval(finite, 0.95)
                assert (row[f"{name}_lo"], row[f"{name}_hi"]) == pytest.approx((low, high))
            checked += 1
        full = [run.full for run in runs]
        assert [entry["full_accuracy"] for entry in row["per_seed"]] == full
    assert checked >= 4


def test_the_markdown_states_prediction_table_and_verdict(experiment):
    out, _ = experiment
    text = (out / "intervention.md").read_text()
    assert PREDICTION in text.replace("**Prediction.** R", "**Prediction.** r")
    header = "| regime | seeds | S [lo, hi] | B [lo, hi] | D [lo, hi] | slope [lo, hi] "
    assert (
        header
        + (
            "| gap, units | S, units | B, units | D, units | S bracket, units | D bracket, units "
            "| DCP verdict per seed | accuracy full / k=1 |"
        )
        in text
    )
    # Each run's bracket ends in units and its own verdict reach the summary.
    for row in _document(out)["regimes"].values():
        assert len(row["verdicts"]) == len(row["seeds"])
        for entry in row["per_seed"]:
            assert entry["dcp_verdict"] in ("S", "B", "D", "mixed", "inconclusive")
            assert entry["S_lower_abs"] <= entry["S_upper_abs"] + 1e-12
    for regime in REGIMES:
        assert f"| {regime} | 0,1" in text
    assert "## Verdict" in text and "negative control" in text
    labels = [
        check["label"] for checks in _document(out)["verdict"].values() for check in checks.values()
    ]
    assert all(f"**{label}**" in text for label in labels)


def test_a_rerun_resumes_without_retraining_and_writes_the_same_json(experiment):
    out, _ = experiment
    before = (out / "intervention.json").read_text()
    files = [p for p in (out / "runs").rglob("*") if p.is_file()]
    assert any(p.name == "model.safetensors" for p in files)
    stamps = {p: p.stat().st_mtime_ns for p in files}
    returned = run_training_intervention(
        out, "tiny", SEEDS, dense_seeds=SEEDS, progress=False, **SETTINGS
    )
    assert {p: p.stat().st_mtime_ns for p in files} == stamps
    assert (out / "intervention.json").read_text() == before
    assert returned == json.loads(before)


def test_an_interrupted_training_continues_and_one_seed_keeps_its_bootstrap_interval(
    experiment, tmp_path
):
    out, _ = experiment
    run = tmp_path / "runs" / "fixed-seed0"
    train(preset("tiny", regime="fixed", seed=0), run, stop_at_step=30, progress=False)
    assert not (run / "model").exists()
    document = run_training_intervention(
        tmp_path, "tiny", (0,), ("fixed",), progress=False, **SETTINGS
    )
    # Resumed bit-identically: the model is the one the module's experiment trained without
    # interruption, in a parallel worker process (--jobs 2).
    reference = out / "runs" / "fixed-seed0" / "model" / "model.safetensors"
    assert (run / "model" / "model.safetensors").read_bytes() == reference.read_bytes()
    row = document["regimes"]["fixed"]
    (seed_row,) = row["per_seed"]
    assert seed_row == _document(out)["regimes"]["fixed"]["per_seed"][0]
    for name in ("S", "B", "D", "slope"):
        for suffix in ("", "_lo", "_hi"):
            assert row[name + suffix] == seed_row[name + suffix]
    assert document["verdict"]["sampled"]["S_lower"]["label"] == "not tested"


def _row(**values: float) -> dict[str, float]:
    """An aggregate with ``X, X_lo, X_hi`` from ``X=(value, lo, hi)`` triples."""
    row: dict[str, float] = {}
    for name, (value, low, high) in values.items():
        row.update({name: value, f"{name}_lo": low, f"{name}_hi": high})
    return row


FIXED = _row(
    S_abs=(0.6, 0.5, 0.7), D_abs=(0.2, 0.1, 0.3), slope=(1.0, 0.9, 1.1), gap_abs=(1.0, 0.9, 1.1)
)


@pytest.mark.parametrize(
    "tested,label",
    [
        (_row(S_abs=(0.2, 0.1, 0.3)), "supported"),
        (_row(S_abs=(0.45, 0.3, 0.55)), "not resolved"),
        (_row(S_abs=(0.6, 0.5, 0.7)), "not supported"),
        (_row(S_abs=(0.8, 0.75, 0.85)), "not supported"),
        (_row(S_abs=(math.nan, math.nan, math.nan)), "not resolved"),
    ],
)
def test_s_verdict_labels(tested, label):
    assert s_verdict(tested, FIXED)["label"] == label


@pytest.mark.parametrize(
    "tested,label",
    [
        (_row(D_abs=(0.25, 0.15, 0.35)), "supported"),
        (_row(D_abs=(0.5, 0.31, 0.7)), "not supported"),
        (_row(D_abs=(math.nan, 0.1, 0.3)), "not resolved"),
    ],
)
def test_d_verdict_labels(tested, label):
    assert d_verdict(tested, FIXED)["label"] == label


def test_a_bound_is_not_read_as_a_value():
    """Where S is not identified (a lower bound, D an upper bound), a comparison that the bound
    could reverse is not resolved; what the measured values say is kept beside it."""
    lower = _row(S_abs=(0.1, 0.05, 0.15), D_abs=(0.25, 0.15, 0.35))
    bound = {**lower, "S_bound_seeds": [0]}
    assert s_verdict(lower, FIXED)["label"] == "supported"
    result = s_verdict(bound, FIXED)  # the tested S could be larger than measured
    assert (result["label"], result["measured"]) == ("not resolved", "supported")
    # Fixed's S a lower bound does not weaken "lower": its true S is at least what was measured.
    assert s_verdict(lower, {**FIXED, "S_bound_seeds": [0, 1]})["label"] == "supported"
    # ... but it does weaken "not lower".
    higher = _row(S_abs=(0.9, 0.8, 1.0))
    assert s_verdict(higher, FIXED)["label"] == "not supported"
    assert s_verdict(higher, {**FIXED, "S_bound_seeds": [0]})["label"] == "not resolved"
    for tested, fixed in ((bound, FIXED), (lower, {**FIXED, "S_bound_seeds": [2]})):
        result = d_verdict(tested, fixed)
        assert (result["label"], result["measured"]) == ("not resolved", "supported")


@pytest.mark.parametrize(
    "tested,label",
    [
        # S drops 0.6 -> 0.2: predicted slope 1.0 * (1 - 0.4) = 0.6.
        (_row(S_abs=(0.2, 0.1, 0.3), slope=(0.62, 0.5, 0.7)), "supported"),
        (_row(S_abs=(0.2, 0.1, 0.3), slope=(0.8, 0.5, 1.2)), "not resolved"),
        (_row(S_abs=(0.2, 0.1, 0.3), slope=(1.0, 0.95, 1.05)), "not supported"),
        (_row(S_abs=(0.2, 0.1, 0.3), slope=(math.nan, math.nan, math.nan)), "not resolved"),
    ],
)
def test_slope_verdict_labels(tested, label):
    result = slope_verdict(tested, FIXED)
    assert result["label"] == label
    assert result["predicted_slope"] == pytest.approx(0.6)


def test_verdict_covers_the_tested_regimes_and_marks_missing_ones():
    tested = _row(S_abs=(0.2, 0.1, 0.3), D_abs=(0.25, 0.15, 0.35), slope=(0.62, 0.5, 0.7))
    result = prediction_checks({"fixed": FIXED, "every-iteration": tested})
    assert {name: check["label"] for name, check in result["every-iteration"].items()} == {
        "S_lower": "supported",
        "D_stays": "supported",
        "slope_follows_S": "supported",
    }
    assert {check["label"] for check in result["sampled"].values()} == {"not tested"}
    assert {
        check["label"] for check in prediction_checks({"sampled": tested})["sampled"].values()
    } == {"not tested"}


def test_aggregate_t_interval_single_seed_and_undefined_seeds():
    def seed_row(seed: int, value: float) -> dict[str, float]:
        names = ("S", "B", "D", "slope", "gap_abs", "S_abs", "B_abs", "D_abs")
        return {"seed": seed, **_row(**{n: (value, value - 1, value + 1) for n in names})}

    three = aggregate([seed_row(0, 1.0), seed_row(1, 2.0), seed_row(2, 3.0)])
    # mean 2, sd 1, t_{0.975, 2} = 4.3027: 2 -+ 4.3027 / sqrt(3).
    assert three["S"] == 2.0
    assert three["S_lo"] == pytest.approx(2 - 4.302653 / math.sqrt(3), abs=1e-5)
    assert three["S_hi"] == pytest.approx(2 + 4.302653 / math.sqrt(3), abs=1e-5)
    one = aggregate([seed_row(4, 0.5)])
    assert (one["S"], one["S_lo"], one["S_hi"]) == (0.5, -0.5, 1.5)
    partly = aggregate([seed_row(0, 1.0), seed_row(1, math.nan)])
    assert (partly["S"], partly["S_lo"], partly["S_hi"]) == (1.0, 0.0, 2.0)
    assert partly["undefined_seeds"] == [1] and partly["n_seeds"]["S"] == 1
    assert math.isnan(aggregate([seed_row(0, math.nan)])["S"])


@pytest.mark.parametrize(
    "df,quantile", [(1, 12.706205), (2, 4.302653), (4, 2.776445), (10, 2.228139), (30, 2.042272)]
)
def test_t_interval_uses_the_tabulated_student_quantile(df, quantile):
    values = np.zeros(df + 1)
    values[0], values[1] = 1.5, -1.5  # mean 0, sd sqrt(4.5 / df)
    low, high = t_interval(values, 0.95)
    half = quantile * math.sqrt(4.5 / df) / math.sqrt(df + 1)
    assert low == pytest.approx(-half, abs=1e-5) and high == pytest.approx(half, abs=1e-5)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"regimes": ("fixed", "looped")}, "unknown regimes ['looped']"),
        ({"preset": "huge"}, "unknown preset 'huge'"),
        ({"seeds": ()}, "seeds is empty"),
        ({"seeds": (0, 0)}, "seeds repeat"),
        ({"seeds": (-1,)}, "must be integers >= 0"),
        ({"regimes": ()}, "regimes is empty"),
        ({"n_eval": 0}, "n_eval=0"),
        ({"jobs": 0}, "jobs=0"),
    ],
)
def test_bad_input_is_refused_before_training(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        run_training_intervention(tmp_path / "out", **{"preset": "tiny", **kwargs})
    assert not (tmp_path / "out").exists()


def test_the_cli_reports_bad_input(tmp_path, capsys):
    out = str(tmp_path / "out")
    base = ["experiment", "training-intervention", "--preset", "tiny", "--out", out]
    assert main([*base, "--regimes", "fixed,looped"]) == 2
    assert "unknown regimes ['looped']" in capsys.readouterr().err
    assert main([*base, "--seeds", ""]) == 2
    assert "seeds is empty" in capsys.readouterr().err
    assert main([*base, "--seeds", "0,x"]) == 2
    assert "--seeds must be comma-separated integers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["experiment", "another-experiment", "--out", out])


def test_the_dense_control_defaults_to_the_first_seed(tmp_path):
    document = run_training_intervention(
        tmp_path, "tiny", (3, 4), ("dense",), progress=False, **SETTINGS
    )
    assert document["regimes"]["dense"]["seeds"] == [3]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["dense-seed3"]


# ------------------------------------------------------------------ language modelling


def _lm_experiment(out: Path, preset_name: str, seeds: list[int], settings: list[str]) -> dict:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(
            [
                "experiment",
                "training-intervention",
                "--preset",
                preset_name,
                "--seeds",
                ",".join(map(str, seeds)),
                "--jobs",
                "2",
                *settings,
                "--quiet",
                "--out",
                str(out),
            ]
        )
    assert code == 0
    assert str(out / "intervention.html") in printed.getvalue()
    return _document(out)


def _check_lm_document(document: dict, out: Path, seeds: list[int]) -> None:
    # Reported on validated metrics only: accuracy first, top-1 agreement beside it.
    assert document["metric"] == "accuracy"
    assert document["validated_metrics"] == ["accuracy", "top1_agreement"]
    assert list(document["other_metrics"]) == ["top1_agreement"]
    for section in (document, document["other_metrics"]["top1_agreement"]):
        assert list(section["regimes"]) == list(REGIMES)
        for regime, row in section["regimes"].items():
            assert row["seeds"] == (seeds[:1] if regime == "dense" else seeds), regime
            assert isinstance(row["S_bound_seeds"], list)
        for regime in ("every-iteration", "sampled"):
            checks = section["verdict"][regime]
            assert set(checks) == {"S_lower", "D_stays", "slope_follows_S"}
            assert all(check["label"] in LABELS[:3] for check in checks.values()), checks
    markdown = (out / "intervention.md").read_text()
    assert "# Metric `top1_agreement`" in markdown and "cross_entropy" not in markdown
    # The regimes side by side in one self-contained page, one seed of each.
    html = (out / "intervention.html").read_text()
    for regime in REGIMES:
        assert f"{regime} (seed {seeds[0]})" in html, regime
    assert "figure-decomposition_accuracy" in html and "figure-probe" in html


def test_the_lm_tiny_intervention_runs_end_to_end(tmp_path):
    """`--preset lm-tiny`: character-level language modelling of the bundled tinyshakespeare in
    every regime, DCP on each, the verdict on both validated metrics. One seed: the `tiny`
    experiment above covers the aggregation over two, and the full `lm` test (slow) over three."""
    out = tmp_path / "lm-tiny"
    settings = ["--n-eval", "64", "--n-calibration", "64", "--bootstrap", "50"]
    document = _lm_experiment(out, "lm-tiny", [0], settings)
    assert document["preset"] == "lm-tiny"
    _check_lm_document(document, out, [0])


@pytest.mark.slow
def test_the_lm_intervention_finds_readout_shift_in_the_fixed_regime(tmp_path):
    """The full `--preset lm` experiment (about half an hour with --jobs 2 on 2 cores): the fixed
    model's S on accuracy has a 95% interval over its 3 seeds that excludes 0."""
    out = tmp_path / "lm"
    document = _lm_experiment(out, "lm", [0, 1, 2], [])
    _check_lm_document(document, out, [0, 1, 2])
    fixed = document["regimes"]["fixed"]
    assert fixed["S_lo"] > 0 and fixed["S_abs_lo"] > 0, fixed


FIXED_BRACKETED = {
    **FIXED,
    **_row(S_lower_abs=(0.6, 0.5, 0.7), S_upper_abs=(0.65, 0.55, 0.75)),
    **_row(D_lower_abs=(0.15, 0.05, 0.25), D_upper_abs=(0.2, 0.1, 0.3)),
}


@pytest.mark.parametrize(
    "s_lower,s_upper,label",
    [
        # The whole tested bracket (interval included) below fixed's lower end's interval.
        ((0.1, 0.05, 0.15), (0.2, 0.15, 0.45), "supported"),
        # The point is lower, but the tested bracket's upper end reaches fixed's bracket.
        ((0.1, 0.05, 0.15), (0.55, 0.45, 0.6), "not resolved"),
        # Every value of the tested bracket is at least every value of fixed's.
        ((0.7, 0.6, 0.8), (0.8, 0.7, 0.9), "not supported"),
    ],
)
def test_s_verdict_compares_brackets_where_both_runs_have_them(s_lower, s_upper, label):
    """With brackets, a comparison is decided only where no value of one bracket could reverse
    it: a wide bracket leaves it open whatever the point values say."""
    tested = {
        **_row(S_abs=s_lower, D_abs=(0.2, 0.1, 0.3)),
        **_row(S_lower_abs=s_lower, S_upper_abs=s_upper),
    }
    result = s_verdict(tested, FIXED_BRACKETED)
    assert result["label"] == label
    if label == "not resolved":  # the point values alone would have said "supported"
        assert result["measured"] == "supported" and "brackets overlap" in result["why"]


def test_s_lower_needs_a_readout_shift_in_fixed_to_shrink():
    """A fixed regime whose S bracket reaches zero has no S to shrink: a tested regime whose S
    is negative (calibration costs quality) is not 'lower' in the prediction's sense."""
    fixed = {
        **FIXED_BRACKETED,
        **_row(S_lower_abs=(0.0, -0.002, 0.003), S_upper_abs=(0.002, 0.0, 0.007)),
    }
    tested = {
        **_row(S_abs=(-0.008, -0.011, -0.004), D_abs=(0.2, 0.1, 0.3)),
        **_row(S_lower_abs=(-0.008, -0.011, -0.004), S_upper_abs=(-0.008, -0.011, -0.004)),
    }
    result = s_verdict(tested, fixed)
    assert result["label"] == "not resolved" and "no S to shrink" in result["why"]


def test_d_verdict_compares_brackets_where_both_runs_have_them():
    near = {
        **_row(S_abs=(0.2, 0.1, 0.3), D_abs=(0.35, 0.32, 0.4)),
        **_row(D_lower_abs=(0.3, 0.28, 0.4), D_upper_abs=(0.35, 0.3, 0.45)),
    }
    # Point intervals apart (0.32 > fixed's 0.3), brackets with their intervals overlapping.
    assert d_verdict(near, FIXED)["label"] == "not supported"
    assert d_verdict(near, FIXED_BRACKETED)["label"] == "supported"
    far = {**near, **_row(D_lower_abs=(0.6, 0.5, 0.7), D_upper_abs=(0.7, 0.6, 0.8))}
    assert d_verdict(far, FIXED_BRACKETED)["label"] == "not supported"
