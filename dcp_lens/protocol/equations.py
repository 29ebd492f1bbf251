"""The DCP equations (docs/design.md §4), once: the factors of the truncation gap from the five
cell qualities, and a quantity's share of the gap's area over a k grid. `decomposition` applies
them to the measured cells, `bracket` to each end of the S bracket.

With ``a = truncate(k)``, ``b = calibrate_truncate(k)``, ``c = replay(k)``,
``d = calibrate_replay(k)``, ``e = full`` (qualities, higher is better)::

    gap  = e - a
    S    = ((b - a) + (d - c)) / 2
    B    = ((c - a) + (d - b)) / 2
    D    = e - d
    I_BS = (d - c) - (b - a)

so that ``gap = S + B + D`` exactly.
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Bool, Float


def factors(
    *,
    full: Float[np.ndarray, "*batch"],
    truncate: Float[np.ndarray, "*batch"],
    calibrate_truncate: Float[np.ndarray, "*batch"],
    replay: Float[np.ndarray, "*batch"],
    calibrate_replay: Float[np.ndarray, "*batch"],
) -> dict[str, Float[np.ndarray, "*batch"]]:
    """The DCP quantities from cell qualities (higher is better), elementwise.

    Returns:
        ``{"gap", "S", "B", "D", "I_BS"}``, each of the inputs' common shape.
    """
    a, b, c, d, e = truncate, calibrate_truncate, replay, calibrate_replay, full
    return {
        "gap": np.asarray(e - a),
        "S": np.asarray(((b - a) + (d - c)) / 2),
        "B": np.asarray(((c - a) + (d - b)) / 2),
        "D": np.asarray(e - d),
        "I_BS": order_difference(a, b, c, d),
    }


def order_difference(
    truncate: Float[np.ndarray, "*batch"],
    calibrate_truncate: Float[np.ndarray, "*batch"],
    replay: Float[np.ndarray, "*batch"],
    calibrate_replay: Float[np.ndarray, "*batch"],
) -> Float[np.ndarray, "*batch"]:
    """``I_BS = (d - c) - (b - a)`` elementwise: S taken after replay minus S taken first on
    truncate (equally, B taken after calibration minus B taken first)."""
    a, b, c, d = truncate, calibrate_truncate, replay, calibrate_replay
    return np.asarray((d - c) - (b - a))


def share_of_gap(
    quantity: Float[np.ndarray, "*batch k"],
    gap: Float[np.ndarray, "*batch k"],
    used: Bool[np.ndarray, " k"],
) -> Float[np.ndarray, "*batch"]:
    """``area(quantity) / area(gap)`` over the k in ``used`` (the area: the plain sum over k),
    NaN where the gap's area is exactly 0."""
    gap_area = gap[..., used].sum(axis=-1)
    area = quantity[..., used].sum(axis=-1)
    safe = np.where(gap_area == 0, 1.0, gap_area)
    return np.asarray(np.where(gap_area == 0, np.nan, area / safe))
