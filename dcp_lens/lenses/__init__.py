"""Lenses over the iterations (logit, calibrated, per-iteration trajectories) and the glue to
tools that think in blocks (patching results, sparse autoencoders)."""
