"""dcp-lens: the Depth Control Protocol for depth-recurrent transformers, on TransformerLens 4."""

from dcp_lens.config import RecurrentConfig

__all__ = ["RecurrentConfig"]
