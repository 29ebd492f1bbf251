"""The run-level records (dcp_lens.protocol.records): exact JSON round trips, the order the
protocol writes their keys in, keys no field names, strict-JSON floats, and refused input."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dcp_lens.protocol.records import (
    CalibrationRecord,
    ConfidenceMatchingRecord,
    NullControlRecord,
    ProbeSummaryRecord,
    decode_float,
    decode_json,
    encode_json,
    plain,
)


def test_the_null_control_writes_the_translators_checks_after_the_maps_identity_deviation():
    record = {
        "max_abs_logit_diff": 1e-7,
        "calibrate_full_max_abs_logit_diff": 2e-7,
        "calibrate_full_identity_deviation": 0.0,
        "translate_truncate_at_r_max_abs_logit_diff": 3e-7,
        "calibrate_full_halves_max_abs_logit_diff": 0.25,
    }
    null = NullControlRecord.from_json(record)
    assert null.other == {"translate_truncate_at_r_max_abs_logit_diff": 3e-7}
    assert list(null.to_json()) == list(record)  # the order written is the order read
    assert null.to_json() == record
    assert null["calibrate_full_halves_max_abs_logit_diff"] == 0.25  # reads as its JSON object


def test_a_record_without_a_required_key_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"needs \['max_abs_logit_diff'\]"):
        NullControlRecord.from_json({"calibrate_full_max_abs_logit_diff": 0.0})
    with pytest.raises(ValueError, match=r"needs \['what'\]"):
        ConfidenceMatchingRecord.from_json({"temperatures": {}})


def test_the_probe_summary_keeps_nan_and_infinity_through_strict_json():
    summary = ProbeSummaryRecord.from_json(
        {
            "reference_auroc": 0.5,
            "trajectory": [{"iteration": 0, "auroc": math.nan}],
            "replay_mahalanobis": [math.inf, -math.inf, 2.5],
        }
    )
    text = json.dumps(encode_json(summary.to_json()), allow_nan=False)
    back = ProbeSummaryRecord.from_json(json.loads(text))
    assert math.isnan(back.trajectory[0]["auroc"])
    assert back.other["replay_mahalanobis"] == [math.inf, -math.inf, 2.5]
    assert back.to_json().keys() == summary.to_json().keys()


def test_the_calibration_record_of_a_run_nests_its_temperatures_by_condition_and_k():
    temperatures = {("truncate", 1): 0.5, ("replay", 1): 2.0, ("truncate", 2): 1.5}
    record = CalibrationRecord.of_run("full", True, temperatures, {"ridge": 0.1})
    assert record.mode == "full" and record.skip_first_position is True
    assert isinstance(record.confidence_matching, ConfidenceMatchingRecord)
    assert record.confidence_matching.temperatures == {
        "truncate": {"1": 0.5, "2": 1.5},
        "replay": {"1": 2.0},
    }
    assert record.other == {"ridge": 0.1}  # what the map describes of itself
    assert CalibrationRecord.from_json(record.to_json()).to_json() == record.to_json()
    plain_record = CalibrationRecord.of_run("mixture", False, {}, {})
    assert plain_record.confidence_matching is None
    assert "confidence_matching" not in plain_record.to_json()


def test_plain_reads_numpy_and_refuses_what_json_cannot_hold():
    assert plain({"a": np.float32(0.5), "b": np.array([1, 2]), "c": np.bool_(True)}, "x") == {
        "a": 0.5,
        "b": [1, 2],
        "c": True,
    }
    assert math.isnan(plain(None, "x"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"x\['k'\] is a set"):
        plain({"k": {1}}, "x")
    with pytest.raises(ValueError, match="has key 1; JSON keys must be str"):
        plain({1: 0.0}, "y")


@pytest.mark.parametrize(
    ("value", "encoded"),
    [(math.nan, None), (math.inf, "Infinity"), (-math.inf, "-Infinity"), (1.5, 1.5)],
)
def test_floats_encode_to_strict_json_and_decode_back(value, encoded):
    assert encode_json([value]) == [encoded]
    decoded = decode_json([encoded])
    assert isinstance(decoded, list)
    assert decoded[0] == value or (math.isnan(decoded[0]) and math.isnan(value))


def test_decode_float_refuses_what_is_not_a_number():
    with pytest.raises(ValueError, match="'0.5' is not a number of results.json"):
        decode_float("0.5")
    with pytest.raises(ValueError, match="True is not a number"):
        decode_float(True)
