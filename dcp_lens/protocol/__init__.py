"""The protocol stage: evaluation sets, captured states, the sweep's conditions, calibration maps,
metrics, the residual-stream probe, the sweep itself, the decomposition and its results.

``from dcp_lens.protocol import DepthControlProtocol, EvaluationSet`` (imported on first access).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DepthControlProtocol": "dcp_lens.protocol.dcp",
    "EvaluationSet": "dcp_lens.protocol.dcp",
    "task_data": "dcp_lens.protocol.dcp",
    "ProtocolResults": "dcp_lens.protocol.results",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
