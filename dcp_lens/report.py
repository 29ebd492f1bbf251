"""Every rendering of dcp-lens results: console summaries and markdown (the HTML report builds on
these). Functions here read results objects and never recompute science."""

from __future__ import annotations

from dcp_lens.results import ProtocolResults


def format_summary(results: ProtocolResults) -> str:
    """The console summary of one run: model, depth, shares with intervals, the null control."""
    lines = [f"\n{results.model} ({results.architecture}, r = {results.n_iterations})"]
    if not results.replay_realizable:
        lines.append("  replay: not realizable as the same model (dense network)")
    shares = results.shares()
    lines.append(shares.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    lines.append(
        f"  null control max |logit diff|: {results.null_control['max_abs_logit_diff']:.2e}"
    )
    return "\n".join(lines)
