"""The protocol stage: evaluation sets, captured states, the sweep's conditions, calibration maps,
metrics, the residual-stream probe, the sweep itself, the decomposition and its results.

``from dcp_lens.protocol import DepthControlProtocol, EvaluationSet`` (imported on first access).
"""

from __future__ import annotations

_EXPORTS = {
    "DepthControlProtocol": "dcp",
    "EvaluationSet": "dcp",
    "task_data": "dcp",
    "ProtocolResults": "results",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if _EXPORTS.get(name) == "dcp":
        from dcp_lens.protocol import dcp

        return getattr(dcp, name)
    if _EXPORTS.get(name) == "results":
        from dcp_lens.protocol import results

        return getattr(results, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
