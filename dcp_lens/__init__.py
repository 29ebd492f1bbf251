"""dcp-lens: the Depth Control Protocol for depth-recurrent transformers, on TransformerLens 4."""

from dcp_lens.config import RecurrentConfig
from dcp_lens.hooked_recurrent_transformer import HookedRecurrentTransformer
from dcp_lens.probe import ResidualOODProbe
from dcp_lens.protocol import DepthControlProtocol, EvaluationSet
from dcp_lens.registry import load

__all__ = [
    "DepthControlProtocol",
    "EvaluationSet",
    "HookedRecurrentTransformer",
    "RecurrentConfig",
    "ResidualOODProbe",
    "load",
]
