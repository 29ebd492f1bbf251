"""Property-based and fuzz tests (hypothesis): any input works or raises dcp-lens's own error
with a message, never an AttributeError, KeyError, ZeroDivisionError, AssertionError or a raw
JSON, safetensors or torch error.

`outcome` (conftest) runs each input and counts what happened; the counts are printed at the end
of the test session. The default profile keeps these tests under a minute; the ``*_long``
variants, marked slow, run many more inputs.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import data_path, outcome, save_tiny_model, tiny_config, write_llama2c
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from dcp_lens import HookedRecurrentTransformer, load
from dcp_lens.model.config import INJECTIONS, SERIALISED_FIELDS, STATE_INITS, RecurrentConfig
from dcp_lens.tasks import get_task
from dcp_lens.zoo.loaders.huginn import HUGINN_SOURCE_FIELDS as HUGINN_FIELDS
from dcp_lens.zoo.loaders.huginn import huginn_config
from dcp_lens.zoo.loaders.ouro import OURO_SOURCE_FIELDS as OURO_FIELDS
from dcp_lens.zoo.loaders.ouro import ouro_config
from dcp_lens.zoo.loaders.tokenizer import Llama2cTokenizer

LONG = 600  # examples per test in the slow profile
BASE_FIELDS = tiny_config().to_dict()

# Values of every kind a JSON config or a careless caller can hand over.
JUNK = st.one_of(
    st.integers(min_value=-3, max_value=12),
    st.integers(min_value=-(2**63), max_value=2**63),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=8),
    st.sampled_from([*INJECTIONS, *STATE_INITS, "LN", "RMS", "pre", "rotary_interleaved", "own"]),
    st.lists(st.integers(min_value=-2, max_value=4), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
# The same, with integers that are cheap as iteration counts (a model of 1024 iterations, the
# bound, takes seconds to unroll) and the out-of-bound ones that must be refused.
CHEAP_JUNK = st.one_of(
    st.integers(min_value=-3, max_value=12),
    st.sampled_from([1025, 10**4, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=8),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=8,
)


def build_if_small(cfg: RecurrentConfig) -> None:
    """Build the model of a config that was accepted, on meta (shapes only) when it is small."""
    if cfg.layers_for(cfg.n_iterations) <= 64:
        with torch.device("meta"):
            HookedRecurrentTransformer(cfg)


# ----------------------------------------------------------------------------- RecurrentConfig


def recurrent_config_fields(data: st.DataObject) -> None:
    changes = data.draw(st.dictionaries(st.sampled_from(SERIALISED_FIELDS), JUNK, max_size=4))
    fields = {**BASE_FIELDS, **changes}

    def build() -> None:
        build_if_small(RecurrentConfig.from_dict(fields))

    outcome(build, "RecurrentConfig fields")


@given(st.data())
def test_recurrent_config_fields_work_or_raise_our_error(data):
    recurrent_config_fields(data)


@pytest.mark.slow
@settings(max_examples=LONG)
@given(st.data())
def test_recurrent_config_fields_long(data):
    recurrent_config_fields(data)


def config_documents(data: st.DataObject, folder: Path) -> None:
    """config.json replaced by any JSON value, or by a config with junk fields."""
    document = data.draw(
        st.one_of(
            JSON_VALUES,
            st.builds(
                lambda changes: {**BASE_FIELDS, **changes},
                st.dictionaries(
                    st.sampled_from([*SERIALISED_FIELDS, "bogus"]), CHEAP_JUNK, max_size=3
                ),
            ),
        )
    )
    (folder / "config.json").write_text(json.dumps(document))
    outcome(lambda: HookedRecurrentTransformer.from_pretrained(folder), "config.json documents")


@given(st.data())
def test_config_json_documents_work_or_raise_our_error(tmp_path_factory, data):
    config_documents(data, save_tiny_model(tmp_path_factory.mktemp("model")))


# ----------------------------------------------------------------------------- model specs


SPEC_KINDS = ["planted", "huginn", "ouro", "llama2c", "bridge", "default", "", "nope"]


def model_specs(data: st.DataObject, folder: Path) -> None:
    spec = data.draw(
        st.one_of(
            st.text(max_size=12),
            st.builds(
                lambda kind, argument: f"{kind}:{argument}",
                st.sampled_from(SPEC_KINDS),
                st.sampled_from(["", ".", "/", "readout_shift", "block_count", "nope", str(folder)])
                | st.text(max_size=6),
            ),
            st.sampled_from(["default", "default-dense", str(folder), f"ouro:{folder}"]),
        )
    )
    # device is a typed parameter (a string or torch.device: beartype checks it under test);
    # every other override is data, checked by dcp-lens whatever its type.
    keys = st.sampled_from(["n_iterations", "seed", "dtype"])
    overrides = data.draw(st.dictionaries(keys, CHEAP_JUNK))
    if data.draw(st.booleans()):
        overrides["device"] = data.draw(st.sampled_from(["cpu", "", "cuda:99", "nope", "meta"]))
    if spec in ("default", "default-dense", str(folder)) or spec.startswith("ouro:"):
        outcome(lambda: load(spec, **overrides), "model specs")
    else:
        outcome(lambda: load(spec), "model specs")


@given(st.data())
def test_model_specs_work_or_raise_our_error(tmp_path_factory, data):
    model_specs(data, save_tiny_model(tmp_path_factory.mktemp("model")))


@pytest.mark.slow
@settings(max_examples=LONG)
@given(st.data())
def test_model_specs_long(tmp_path_factory, data):
    model_specs(data, save_tiny_model(tmp_path_factory.mktemp("model")))


# ----------------------------------------------------------------------------- loader configs


def source_configs(data: st.DataObject, data_dir: Path) -> None:
    for kind, fields, build in (
        ("huginn", HUGINN_FIELDS, huginn_config),
        ("ouro", OURO_FIELDS, ouro_config),
    ):
        base = json.loads((data_dir / "fixtures" / f"{kind}_tiny" / "config.json").read_text())
        changes = data.draw(st.dictionaries(st.sampled_from(sorted(fields)), JUNK, max_size=3))
        config = {**base, **changes}

        def convert(config: dict[str, Any] = config, build: Any = build) -> None:
            build_if_small(build(config, source="config.json"))

        outcome(convert, f"{kind} config.json fields")


@given(st.data())
def test_loader_source_configs_work_or_raise_our_error(data):
    source_configs(data, data_path())


@pytest.mark.slow
@settings(max_examples=LONG)
@given(st.data())
def test_loader_source_configs_long(data):
    source_configs(data, data_path())


@given(
    st.dictionaries(st.text(max_size=12), JUNK, max_size=4),
    st.sampled_from(["variable_binding", "char_lm", "x"]),
)
def test_task_parameters_work_or_raise_our_error(parameters, name):
    parameters.pop("name", None)
    outcome(lambda: get_task(name, **parameters), "task parameters")


# ----------------------------------------------------------------------------- file parsing


def mutate_safetensors(data: st.DataObject, raw: bytes) -> bytes:
    """A valid safetensors file made invalid in one of the ways files get damaged."""
    header_length = struct.unpack("<Q", raw[:8])[0]
    header = raw[8 : 8 + header_length].decode()
    kind = data.draw(st.sampled_from(["truncate", "declared size", "flip", "dtype", "junk"]))
    if kind == "truncate":
        return raw[: data.draw(st.integers(0, len(raw) - 1))]
    if kind == "declared size":
        size = data.draw(st.integers(0, 2**64 - 1))
        return struct.pack("<Q", size) + raw[8:]
    if kind == "flip":
        position = data.draw(st.integers(0, len(raw) - 1))
        return (
            raw[:position]
            + bytes([raw[position] ^ data.draw(st.integers(1, 255))])
            + raw[position + 1 :]
        )
    if kind == "dtype":
        dtype = data.draw(
            st.sampled_from(["C64", "I32", "I64", "BOOL", "F8_E4M3", "F8_E5M2", "U8", "XYZ"])
        )
        edited = header.replace('"F32"', f'"{dtype}"', 1).encode()
        return struct.pack("<Q", len(edited)) + edited + raw[8 + header_length :]
    return data.draw(st.binary(max_size=256))


def damaged_safetensors(data: st.DataObject, folder: Path) -> None:
    weights = folder / "model.safetensors"
    if not hasattr(damaged_safetensors, "raw"):
        damaged_safetensors.raw = weights.read_bytes()  # type: ignore[attr-defined]
    raw: bytes = damaged_safetensors.raw  # type: ignore[attr-defined]
    weights.write_bytes(mutate_safetensors(data, raw))
    outcome(lambda: HookedRecurrentTransformer.from_pretrained(folder), "safetensors files")
    weights.write_bytes(raw)


@given(st.data())
def test_damaged_safetensors_files_work_or_raise_our_error(tmp_path_factory, data):
    damaged_safetensors(data, save_tiny_model(tmp_path_factory.mktemp("model")))


@pytest.mark.slow
@settings(max_examples=LONG)
@given(st.data())
def test_damaged_safetensors_files_long(tmp_path_factory, data):
    damaged_safetensors(data, save_tiny_model(tmp_path_factory.mktemp("model")))


def test_nan_filled_weights_load_and_their_null_control_is_nan(tmp_path):
    save_tiny_model(tmp_path)
    from safetensors.torch import load_file

    state = {
        k: torch.full_like(v, math.nan)
        for k, v in load_file(tmp_path / "model.safetensors").items()
    }
    save_file(state, tmp_path / "model.safetensors")
    assert (
        outcome(lambda: HookedRecurrentTransformer.from_pretrained(tmp_path), "safetensors files")
        == "works"
    )


def damaged_llama2c(data: st.DataObject, folder: Path) -> None:
    path = folder / "model.bin"
    kind = data.draw(st.sampled_from(["header", "truncate", "nan", "junk"]))
    if kind == "header":
        values = data.draw(
            st.lists(st.integers(-(2**31), 2**31 - 1) | st.integers(-2, 64), min_size=7, max_size=7)
        )
        body = data.draw(st.binary(max_size=512))
        path.write_bytes(struct.pack("<7i", *values) + body)
    elif kind == "truncate":
        raw = write_llama2c(path).read_bytes()
        path.write_bytes(raw[: data.draw(st.integers(0, len(raw) - 1))])
    elif kind == "nan":
        position = data.draw(st.integers(0, 3))
        write_llama2c(path, tables=lambda t: t.index_fill_(0, torch.tensor([position]), math.nan))
    else:
        path.write_bytes(data.draw(st.binary(max_size=256)))
    outcome(lambda: load(f"llama2c:{path}"), "llama2.c files")


@given(st.data())
def test_damaged_llama2c_files_work_or_raise_our_error(tmp_path_factory, data):
    damaged_llama2c(data, tmp_path_factory.mktemp("llama2c"))


@pytest.mark.slow
@settings(max_examples=LONG)
@given(st.data())
def test_damaged_llama2c_files_long(tmp_path_factory, data):
    damaged_llama2c(data, tmp_path_factory.mktemp("llama2c"))


@given(st.binary(max_size=300))
def test_tokenizer_files_work_or_raise_our_error(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("tokenizer") / "tok.bin"
    path.write_bytes(raw)
    outcome(lambda: Llama2cTokenizer.from_file(path, vocab_size=None), "tokenizer files")


# ----------------------------------------------------------------------------- CLI arguments


COUNTS = st.one_of(st.integers(-2, 3).map(str), st.sampled_from(["", "x", "1.5", "10**9"]))
LISTS = st.one_of(
    st.sampled_from(["", ",", "1", "1,2", "0", "-1", "1,a", "99", " "]),
    st.text(alphabet="0123456789,- a", max_size=6),
)


def cli_arguments(data: st.DataObject, out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``dcp-lens run`` on the tiny planted model with fuzzed flags: exit 0, or 2 with one line."""
    from dcp_lens.cli import main

    argv = ["run", "--out", str(out), "--quiet", "--probe", "none", "--bootstrap", "3"]
    argv += ["--model", data.draw(st.sampled_from(["planted:readout_shift", "", "planted:", "x"]))]
    for flag, values in (
        ("--k", LISTS),
        ("--n-eval", COUNTS),
        ("--n-calibration", COUNTS),
        ("--batch-size", COUNTS),
        ("--metrics", st.sampled_from(["", "accuracy", "nope", "accuracy,accuracy", "kl"])),
        ("--device", st.sampled_from(["cpu", "", "cuda:99", "meta", "cpu:0", "nope"])),
        ("--calibration-mode", st.sampled_from(["full", "diag", "mean", "bad"])),
    ):
        if data.draw(st.booleans()):
            argv += [flag, data.draw(values)]
    capsys.readouterr()

    def run() -> None:
        try:
            code = main(argv)
        except SystemExit as exit:  # argparse: a usage error
            code = exit.code
        err = capsys.readouterr().err.strip()
        assert code in (0, 2), (argv, code, err)
        if code == 2:
            assert len(err.splitlines()) == 1 and "Traceback" not in err, err
            from dcp_lens.utils.errors import ConfigError

            raise ConfigError(err)

    outcome(run, "CLI arguments")


@settings(max_examples=25)
@given(st.data())
def test_cli_arguments_exit_0_or_2_with_one_line(tmp_path_factory, capsys, data):
    cli_arguments(data, tmp_path_factory.mktemp("out"), capsys)


@pytest.mark.slow
@settings(max_examples=200)
@given(st.data())
def test_cli_arguments_long(tmp_path_factory, capsys, data):
    cli_arguments(data, tmp_path_factory.mktemp("out"), capsys)
