"""The argument helpers: lists parse or are refused naming their flag, counts below their
minimum and seeds past int64 are refused before any work, errors print on one line."""

from __future__ import annotations

import argparse

import pytest

from dcp_lens.cli.arguments import check_values, ints, names, one_line, path_argument
from dcp_lens.utils.errors import ConfigError


def test_lists_parse_and_empty_or_bad_ones_are_refused_naming_the_flag() -> None:
    assert ints("1, 2,") == [1, 2]
    assert ints(None) is None
    assert names(" accuracy , nll ") == ("accuracy", "nll")
    with pytest.raises(ConfigError, match="--seeds must be comma-separated integers"):
        ints("0,a", "--seeds")
    with pytest.raises(ConfigError, match="--models ' , ' names nothing"):
        names(" , ", "--models")
    with pytest.raises(argparse.ArgumentTypeError, match="an empty path"):
        path_argument("  ")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"n_eval": 0}, "--n-eval 0 must be >= 1"),
        ({"vocab": 1}, "--vocab 1 must be >= 2"),
        ({"seed": 2**63}, "--seed 9223372036854775808 is past 2\\*\\*63-1"),
        ({"seeds": "0,-1"}, "--seeds seeds must lie in 0..2\\*\\*63-1"),
        ({"model": " "}, "--model is empty"),
    ],
)
def test_values_out_of_range_are_refused_naming_the_flag(values, message) -> None:
    with pytest.raises(ConfigError, match=message):
        check_values(argparse.Namespace(**values))


def test_values_in_range_pass() -> None:
    check_values(argparse.Namespace(n_eval=1, vocab=2, seed=2**63 - 1, seeds="0,1", model="m"))


def test_errors_are_one_line_and_a_failed_allocation_says_what_to_lower() -> None:
    assert one_line(ConfigError("bad\n  value")) == "bad value"
    assert one_line(KeyError("k")) == "KeyError: 'k'"
    assert one_line(MemoryError()).startswith("could not allocate memory (MemoryError)")
    assert "lower the batch" in one_line(RuntimeError("CUDA out of memory. Tried"))
