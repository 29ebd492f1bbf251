"""The command line's option tables agree with what they stand for: the dtypes offered are those
the model computes in, the kinds of local paths are registered loaders, the tasks read from a
file are registered tasks; and parsed options build the config they name."""

from __future__ import annotations

import argparse

from dcp_lens.cli.options import (
    DTYPES,
    PATH_KINDS,
    TASK_FILES,
    add_protocol_options,
    protocol_config,
)
from dcp_lens.protocol.config import COMMAND_DEFAULTS, ProtocolConfig
from dcp_lens.tasks import TASKS
from dcp_lens.utils.checks import WEIGHT_DTYPES
from dcp_lens.zoo.registry import LOADERS, _import_builtin_kinds


def test_the_tables_name_what_the_registries_hold() -> None:
    _import_builtin_kinds()
    assert sorted(DTYPES) == sorted(WEIGHT_DTYPES)
    assert set(PATH_KINDS) <= set(LOADERS), set(PATH_KINDS) - set(LOADERS)
    assert set(TASK_FILES) <= set(TASKS)


def test_no_option_given_is_the_commands_defaults_and_given_ones_round_trip() -> None:
    parser = argparse.ArgumentParser()
    add_protocol_options(parser, "validate")
    defaults = protocol_config(parser.parse_args([]), "validate")
    assert defaults == ProtocolConfig.from_dict(COMMAND_DEFAULTS["validate"])
    given = parser.parse_args(["--k", "1,2", "--metrics", "accuracy", "--bootstrap", "7"])
    config = protocol_config(given, "validate")
    assert (config.k_grid, config.metrics, config.n_bootstrap) == ((1, 2), ("accuracy",), 7)
    assert config.replace(k_grid=None, metrics=None, n_bootstrap=defaults.n_bootstrap) == (
        defaults.replace(k_grid=None, metrics=None)
    )
