"""dcp-lens: the Depth Control Protocol for depth-recurrent transformers, on TransformerLens 4.

The names below are imported on first access, so that ``import dcp_lens.cli`` (the
``dcp-lens`` command) parses its arguments without loading torch and TransformerLens.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from dcp_lens.utils import registry as _registry

# The composition root: the report stage renders results for `ProtocolResults.report`,
# ``.figures`` and ``._repr_html_`` without the protocol importing a stage above it.
_registry.set_renderer(lambda: importlib.import_module("dcp_lens.report"))

if TYPE_CHECKING:
    from dcp_lens.model.config import RecurrentConfig
    from dcp_lens.model.hooked_recurrent_transformer import HookedRecurrentTransformer
    from dcp_lens.protocol.dcp import DepthControlProtocol, EvaluationSet
    from dcp_lens.protocol.probe import ResidualOODProbe
    from dcp_lens.zoo.registry import load

_EXPORTS = {
    "DepthControlProtocol": "dcp_lens.protocol.dcp",
    "EvaluationSet": "dcp_lens.protocol.dcp",
    "HookedRecurrentTransformer": "dcp_lens.model.hooked_recurrent_transformer",
    "RecurrentConfig": "dcp_lens.model.config",
    "ResidualOODProbe": "dcp_lens.protocol.probe",
    "load": "dcp_lens.zoo.registry",
}

__all__ = [
    "DepthControlProtocol",
    "EvaluationSet",
    "HookedRecurrentTransformer",
    "RecurrentConfig",
    "ResidualOODProbe",
    "load",
]


def __getattr__(name: str) -> object:
    """An exported name, or a submodule (``dcp_lens.hooks``), imported on first access."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if not name.startswith("_"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
