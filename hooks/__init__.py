"""Interventions of the Depth Control Protocol as TransformerLens hooks (``dcp_lens.hooks``)."""
