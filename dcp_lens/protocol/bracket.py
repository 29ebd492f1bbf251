"""Readout shift bracketed (docs/bracket.md): S as ``[S_lower, S_upper]``, B and D alike.

Pure functions of cell qualities (higher is better), no model. With, per k::

    a  = truncate(k)             b  = calibrate(truncate(k))     ta = translate(truncate(k))
    c  = replay(k)               d  = calibrate(replay(k))       tc = translate(replay(k))
    e  = full                    z  = base_rate  (no information about the example)

the two S-repaired cells of each end are::

    lower end:  b_low = a + discounted_gain(a, b, z)     d_low = c + discounted_gain(c, d, z)
    upper end:  b_up  = max(ta, b)                       d_up  = max(tc, d)
    discounted_gain(x, y, z) = min(y - x, max(0, y - max(x, z)))

and each end is the DCP decomposition (`dcp_lens.protocol.equations.factors`) with those cells
in place of the calibrated ones, so S + B + D = gap at both ends::

    S_end = ((b_end - a) + (d_end - c)) / 2
    B_end = ((c - a) + (d_end - b_end)) / 2
    D_end = e - d_end

``S_lower <= S_upper`` by construction (the discounted gain never exceeds the calibrated one,
and the upper cells are at least the calibrated ones). The B bracket is the pair
``min / max(B_at_lower, B_at_upper)``, the D bracket likewise. Intervals are percentile
intervals of the same quantities over paired bootstrap draws of the cells.

A bracket is *identified* when its width, taken at the upper end of its bootstrap interval, is at
most `BracketRule.tolerance` of the gap (per k: of gap(k); for shares: 0.1 of the area). The
verdict on the shares (`Verdict`) names a factor only when the gap is clearly above zero, full
depth is clearly better than the base rate, every share's interval is narrow enough and both
brackets are identified; otherwise it is ``"inconclusive"`` with the reasons.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from jaxtyping import Bool, Float

from dcp_lens.protocol.conditions import SUBSAMPLED_CONTROLS
from dcp_lens.protocol.equations import factors, order_difference, share_of_gap
from dcp_lens.protocol.statistics import (
    paired_bootstrap_means,
    partnered_estimates,
    percentile_interval,
    read_means,
)
from dcp_lens.protocol.verdicts import (
    BracketInputError,
    BracketRule,
    has_gap,  # noqa: F401  (re-exported: validate and the tests read it here)
    identified_area,
    identify_per_k,
    share_verdict,
)

# The cells a bracket reads, besides full depth, in the column order of `bracket_from_values`.
BRACKET_CONDITIONS = (
    "truncate",
    "calibrate_truncate",
    "replay",
    "calibrate_replay",
    "translate_truncate",
    "translate_replay",
    "base_rate",
)
# Per k and per share: each quantity, with ``_lo`` / ``_hi`` interval ends.
BRACKET_QUANTITIES = ("gap", "S_lower", "S_upper", "B_lower", "B_upper", "D_lower", "D_upper")

# Cell name -> qualities: ``[K]`` means or ``[n_bootstrap, K]`` draws (``full`` may be a scalar).
Cells = Mapping[str, np.ndarray | float]


@dataclass(frozen=True)
class Bracket:
    """The bracket of one metric: per k and as shares of the gap's area.

    Attributes:
        k_grid: the k of the per-k arrays.
        per_k: each of `BRACKET_QUANTITIES` with ``_lo`` / ``_hi``, plus ``S_width_hi`` and
            ``B_width_hi`` (upper interval end of each bracket's width), ``[K]`` float arrays,
            and ``S_identified`` / ``B_identified`` ``[K]`` bool arrays (False where the gap is
            not clearly above zero).
        shares: the same quantities as shares of the gap's area over the k where every cell is
            finite (``gap`` is the area itself), with ``S_width_hi`` and ``B_width_hi``.
        S_identified, B_identified: the brackets of the shares are narrow (see `BracketRule`).
        stable: the gap is clearly above zero, full depth is clearly above the base rate and
            every share's interval is at most ``max_share_interval`` wide.
        verdict: one of `dcp_lens.protocol.verdicts.VERDICTS`; reason: why, in one sentence per
            cause (`dcp_lens.protocol.verdicts.share_verdict` decides both).
        bound: what an inconclusive verdict still establishes (``"not_affine"``: most of the
            gap is not recovered by an affine change of frame), or None.
    """

    k_grid: tuple[int, ...]
    per_k: dict[str, np.ndarray]
    shares: dict[str, float]
    S_identified: bool
    B_identified: bool
    stable: bool
    verdict: str
    reason: str
    rule: BracketRule = field(default_factory=BracketRule)
    bound: str | None = None

    def record(self) -> dict[str, object]:
        """The shares' fields as a JSON-ready dict (``results.json``'s ``shares[metric]``)."""
        return {
            **{key: _json_float(value) for key, value in self.shares.items()},
            "S_identified": self.S_identified,
            "B_identified": self.B_identified,
            "stable": self.stable,
            "verdict": self.verdict,
            "reason": self.reason,
            "bound": self.bound,
        }


def discounted_gain(
    before: Float[np.ndarray, "*shape"],
    after: Float[np.ndarray, "*shape"],
    base_rate: Float[np.ndarray, "*shape"],
) -> Float[np.ndarray, "*shape"]:
    """The gain ``after - before`` less the part a map with no information could reach.

    A gain up to the base rate needs no information about the example, so it is not counted;
    a loss (``after < before``) is kept whole. Elementwise::

        min(after - before, max(0, after - max(before, base_rate)))
    """
    before, after, base_rate = np.asarray(before), np.asarray(after), np.asarray(base_rate)
    gain = np.minimum(after - before, np.maximum(0.0, after - np.maximum(before, base_rate)))
    return np.asarray(gain)


def bracket_ends(cells: Cells) -> dict[str, np.ndarray]:
    """The decomposition at both ends of the S bracket, elementwise over any common shape.

    Args:
        cells: ``full`` and every condition of `BRACKET_CONDITIONS`, qualities (higher is
            better), arrays of one common (broadcastable) shape.

    Returns:
        ``gap``, ``S_lower``, ``S_upper``, ``B_at_lower``, ``B_at_upper``, ``D_at_lower``,
        ``D_at_upper``, ``B_lower``, ``B_upper``, ``D_lower``, ``D_upper``.
    """
    missing = [name for name in ("full", *BRACKET_CONDITIONS) if name not in cells]
    if missing:
        raise BracketInputError(
            f"cells lack {missing}; a bracket needs full and all of {BRACKET_CONDITIONS}."
        )
    a, c, e, z = (np.asarray(cells[n]) for n in ("truncate", "replay", "full", "base_rate"))
    b, d = np.asarray(cells["calibrate_truncate"]), np.asarray(cells["calibrate_replay"])
    lower = (a + discounted_gain(a, b, z), c + discounted_gain(c, d, z))
    upper = (
        np.maximum(np.asarray(cells["translate_truncate"]), b),
        np.maximum(np.asarray(cells["translate_replay"]), d),
    )
    ends: dict[str, np.ndarray] = {}
    for end, (b_end, d_end) in (("lower", lower), ("upper", upper)):
        b_end, d_end = np.asarray(b_end), np.asarray(d_end)
        at_end = factors(
            full=e, truncate=a, calibrate_truncate=b_end, replay=c, calibrate_replay=d_end
        )
        ends["gap"] = at_end["gap"]
        ends[f"S_{end}"], ends[f"B_at_{end}"] = at_end["S"], at_end["B"]
        ends[f"D_at_{end}"] = at_end["D"]
    for factor in ("B", "D"):
        pair = (ends[f"{factor}_at_lower"], ends[f"{factor}_at_upper"])
        ends[f"{factor}_lower"], ends[f"{factor}_upper"] = np.minimum(*pair), np.maximum(*pair)
    return ends


def bracket(
    point: Cells,
    draws: Cells,
    k_grid: Sequence[int],
    *,
    rule: BracketRule | None = None,
    walk_gain: Sequence[float] | np.ndarray | None = None,
    replay_same: Sequence[bool] | np.ndarray | None = None,
) -> Bracket:
    """Bracket S (and B, D) of one metric from its cells' means and their bootstrap draws.

    Args:
        point: ``full`` and every condition of `BRACKET_CONDITIONS`, each ``[K]`` (``full`` may
            be a scalar): mean qualities over the evaluation examples, higher is better.
        draws: the same names, each ``[n_bootstrap, K]`` (``full``: ``[n_bootstrap]`` or
            ``[n_bootstrap, K]``): the cells' means over paired bootstrap draws (every cell from
            the same resampled examples).
        k_grid: the K iteration counts.
        rule: the tolerances (default `BracketRule()`).
        walk_gain: per k, replay's mean gain over truncate (quality units, as the cells) counted
            on the examples whose replay walks (see `BracketRule.walk_tolerance`), 0 elsewhere;
            None: not measured, B is judged on its bracket alone.
        replay_same: per k, whether replay(k) reads out as truncate(k) up to float error (B
            and I_BS are then 0 by construction, not measured); None: not known.

    Returns:
        A `Bracket`.
    """
    rule = rule or BracketRule()
    grid = tuple(int(k) for k in k_grid)
    point_cells = _checked(point, (len(grid),), "point")
    n_draws = _draw_count(draws)
    draw_cells = _checked(draws, (n_draws, len(grid)), "draws")
    ends, sampled = bracket_ends(point_cells), bracket_ends(draw_cells)
    walk = _walk(walk_gain, len(grid))
    # Replay's gain on walking examples may be the readout's computation, not the block's: it
    # may be D as well as B, so the B bracket reaches down and the D bracket up by it.
    for quantities in (ends, sampled):
        quantities["B_lower"] = quantities["B_lower"] - np.maximum(walk, 0.0)
        quantities["D_upper"] = quantities["D_upper"] + np.maximum(walk, 0.0)
    per_k = _with_intervals(ends, sampled, rule.confidence)
    per_k["S_width_hi"] = _upper(sampled["S_upper"] - sampled["S_lower"], rule.confidence)
    per_k["B_width_hi"] = _upper(sampled["B_upper"] - sampled["B_lower"], rule.confidence)
    # The order difference I_BS = (d - c) - (b - a): S taken first on truncate against S taken
    # after replay; its size (upper end of |I_BS|'s interval) is how far the two orders disagree.
    per_k["order_width_hi"] = _upper(np.abs(_order_difference(draw_cells)), rule.confidence)
    same = _replay_same(replay_same, len(grid))
    per_k.update(identify_per_k(per_k, walk, same, rule))

    used = np.isfinite(np.stack([ends[n] for n in ("gap", "S_lower", "S_upper")])).all(axis=0)
    shares = _shares(ends, sampled, point_cells, draw_cells, used, rule.confidence)
    gap_area = float(ends["gap"][used].sum())
    shares["walk_gain"] = float(walk[used].sum()) / gap_area if gap_area != 0 else math.nan
    shares.update(identified_area(per_k, same, used))
    decided = share_verdict(shares, rule)
    return Bracket(
        k_grid=grid,
        per_k=per_k,
        shares=shares,
        S_identified=decided.S_identified,
        B_identified=decided.B_identified,
        stable=decided.stable,
        verdict=decided.verdict,
        reason=decided.reason,
        rule=rule,
        bound=decided.bound,
    )


def bracket_from_values(
    values: Mapping[str, Float[np.ndarray, " n"] | Mapping[int, Float[np.ndarray, " n"]]],
    k_grid: Sequence[int],
    *,
    higher_is_better: bool = True,
    n_bootstrap: int = 1000,
    seed: int = 0,
    rule: BracketRule | None = None,
    walk_gain: Sequence[float] | np.ndarray | None = None,
    replay_same: Sequence[bool] | np.ndarray | None = None,
    read: Mapping[str, np.ndarray] | None = None,
) -> Bracket:
    """`bracket` from per-example values, paired over the same n evaluation examples.

    Args:
        values: ``{"full": [n], condition: {k: [n]}}`` for every condition of
            `BRACKET_CONDITIONS` (``base_rate`` may be one ``[n]`` vector: it has no k).
        higher_is_better: False for losses (negated into qualities here).
        n_bootstrap, seed: the paired bootstrap (`paired_bootstrap_means`), columns ``full``
            then each condition of `BRACKET_CONDITIONS` with its k in grid order.
        walk_gain: passed on to `bracket` (in the values' own units; negated here for losses).
        replay_same: passed on to `bracket`.
        read: per condition read on a subsample of the examples, ``[n]`` bool: where it was
            read (as `dcp_lens.protocol.decomposition.decompose` takes it).
    """
    grid = tuple(int(k) for k in k_grid)
    if n_bootstrap < 1:
        raise BracketInputError(f"n_bootstrap={n_bootstrap} must be >= 1 for the intervals.")
    columns = [_vector(values.get("full"), "values['full']")]
    n = columns[0].shape[0]
    for name in BRACKET_CONDITIONS:
        given = values.get(name)
        if given is None:
            raise BracketInputError(f"values lack {name!r}; expected all of {BRACKET_CONDITIONS}.")
        for k in grid:
            vector = given[k] if isinstance(given, Mapping) else given
            column = _vector(vector, f"values[{name!r}][{k}]")
            if column.shape[0] != n:
                raise BracketInputError(
                    f"values[{name!r}][{k}] has {column.shape[0]} examples, full has {n}: every"
                    " cell must be evaluated on the same examples (paired design)."
                )
            columns.append(column)
    matrix = np.stack(columns, axis=1) * (1.0 if higher_is_better else -1.0)
    where = read_matrix(read, BRACKET_CONDITIONS, grid, n)
    means, draws = cell_estimates(matrix, where, BRACKET_CONDITIONS, grid, n_bootstrap, seed)
    n_k = len(grid)

    def split(array: np.ndarray) -> dict[str, np.ndarray]:
        cells = {"full": np.repeat(array[..., :1], n_k, axis=-1)}
        for i, name in enumerate(BRACKET_CONDITIONS):
            cells[name] = array[..., 1 + i * n_k : 1 + (i + 1) * n_k]
        return cells

    if walk_gain is not None:
        walk_gain = np.asarray(walk_gain, dtype=np.float64) * (1.0 if higher_is_better else -1.0)
    return bracket(
        split(means), split(draws), grid, rule=rule, walk_gain=walk_gain, replay_same=replay_same
    )


def read_matrix(
    read: Mapping[str, object] | None, conditions: Sequence[str], grid: Sequence[int], n: int
) -> Bool[np.ndarray, "n columns"] | None:
    """``[n, 1 + len(conditions) * len(grid)]``: where each column (full, then each condition's
    k in grid order) was read, from ``read``'s ``[n]`` bool per condition read on a subsample
    (every k alike); None where every column was read on every example."""
    if not read:
        return None
    unknown = sorted(set(read) - set(conditions))
    if unknown:
        raise BracketInputError(
            f"read names {unknown}, not among the conditions {list(conditions)} (full depth is"
            " read on every example); name a condition read on a subsample."
        )
    where = np.ones((n, 1 + len(conditions) * len(grid)), bool)
    for i, name in enumerate(conditions):
        if name not in read:
            continue
        mask = np.asarray(_vector(read[name], f"read[{name!r}]")) != 0
        if mask.shape[0] != n:
            raise BracketInputError(
                f"read[{name!r}] has {mask.shape[0]} examples, full has {n}: one bool per example."
            )
        where[:, 1 + i * len(grid) : 1 + (i + 1) * len(grid)] = mask[:, None]
    return None if where.all() else where


def partner_columns(conditions: Sequence[str], grid: Sequence[int]) -> list[list[int]]:
    """Per column of the layout `read_matrix` describes, the columns a cell read on a
    subsample is compared with, in order of preference (`partnered_estimates`): its partner
    of `SUBSAMPLED_CONTROLS` at the same k where that was swept, then full depth (column 0)."""
    n_k = len(grid)
    partners: list[list[int]] = [[]]
    for name in conditions:
        partner = SUBSAMPLED_CONTROLS.get(name, "full")
        for j in range(n_k):
            named = [1 + conditions.index(partner) * n_k + j] if partner in conditions else []
            partners.append([*named, 0])
    return partners


def cell_estimates(
    matrix: Float[np.ndarray, "n_examples n_cells"],
    where: Bool[np.ndarray, "n_examples n_cells"] | None,
    conditions: Sequence[str],
    grid: Sequence[int],
    n_bootstrap: int,
    seed: int,
) -> tuple[Float[np.ndarray, " n_cells"], Float[np.ndarray, "n_bootstrap n_cells"]]:
    """Every cell's mean and paired bootstrap draws: plain means where every cell was read on
    every example (``where`` None, `read_matrix`), else each cell against its partners
    (`partner_columns`, `partnered_estimates`)."""
    if where is None:
        return read_means(matrix), paired_bootstrap_means(matrix, n_bootstrap, seed)
    partners = partner_columns(conditions, grid)
    return partnered_estimates(matrix, where, partners, n_bootstrap, seed)


# ----------------------------------------------------------------------------- internals


def _vector(vector: object, where: str) -> np.ndarray:
    if vector is None:
        raise BracketInputError(f"{where} is missing; pass one value per evaluation example.")
    if hasattr(vector, "detach"):  # a torch tensor
        vector = vector.detach().cpu().double().numpy()  # type: ignore[attr-defined]
    array = np.asarray(vector, dtype=np.float64)
    if array.ndim != 1 or array.shape[0] == 0:
        raise BracketInputError(f"{where} has shape {array.shape}; expected [n] with n >= 1.")
    return array


def _draw_count(draws: Cells) -> int:
    truncate = np.asarray(draws.get("truncate", np.empty((0, 0))))
    if truncate.ndim != 2 or truncate.shape[0] < 1:
        raise BracketInputError(
            f"draws['truncate'] has shape {truncate.shape}; expected [n_bootstrap >= 1, K]."
        )
    return int(truncate.shape[0])


def _checked(cells: Cells, shape: tuple[int, ...], name: str) -> dict[str, np.ndarray]:
    checked: dict[str, np.ndarray] = {}
    for condition in ("full", *BRACKET_CONDITIONS):
        if condition not in cells:
            raise BracketInputError(
                f"{name} lacks {condition!r}; a bracket needs full and all of {BRACKET_CONDITIONS}."
            )
        array = np.asarray(cells[condition], dtype=np.float64)
        if condition == "full" and array.shape in ((), shape[:-1]):
            array = np.broadcast_to(array[..., None], shape)
        if array.shape != shape:
            raise BracketInputError(
                f"{name}[{condition!r}] has shape {array.shape}; expected {shape}"
                " (draws: [n_bootstrap, K]; point: [K])."
            )
        checked[condition] = array
    return checked


def _upper(draws: np.ndarray, confidence: float) -> np.ndarray:
    return percentile_interval(draws, confidence)[1]


def _with_intervals(
    ends: dict[str, np.ndarray], sampled: dict[str, np.ndarray], confidence: float
) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name in BRACKET_QUANTITIES:
        low, high = percentile_interval(sampled[name], confidence)
        out.update({name: ends[name], f"{name}_lo": low, f"{name}_hi": high})
    return out


def _order_difference(cells: Cells) -> np.ndarray:
    """`order_difference` (I_BS) of the calibrated cells in ``cells``."""
    names = ("truncate", "calibrate_truncate", "replay", "calibrate_replay")
    return order_difference(*(np.asarray(cells[name]) for name in names))


def _replay_same(replay_same: Sequence[bool] | np.ndarray | None, n_k: int) -> np.ndarray:
    if replay_same is None:
        return np.zeros(n_k, bool)
    same = np.asarray(replay_same, dtype=bool)
    if same.shape != (n_k,):
        raise BracketInputError(f"replay_same has shape {same.shape}; expected one bool per k.")
    return same


def _walk(walk_gain: Sequence[float] | np.ndarray | None, n_k: int) -> np.ndarray:
    if walk_gain is None:
        return np.zeros(n_k)
    walk = np.asarray(walk_gain, dtype=np.float64)
    if walk.shape != (n_k,):
        raise BracketInputError(f"walk_gain has shape {walk.shape}; expected one value per k.")
    return walk


def _shares(
    ends: dict[str, np.ndarray],
    sampled: dict[str, np.ndarray],
    point: dict[str, np.ndarray],
    draws: dict[str, np.ndarray],
    used: np.ndarray,
    confidence: float,
) -> dict[str, float]:
    """Shares of the gap's area over the k in ``used``, with intervals; ``gap`` is the area and
    ``headroom`` the area of full depth over the base rate."""
    if not used.any():
        return dict.fromkeys(_SHARE_KEYS, math.nan)

    def area(array: np.ndarray) -> np.ndarray:
        return np.asarray(array[..., used].sum(axis=-1))

    def share(quantities: dict[str, np.ndarray], name: str) -> np.ndarray:
        return share_of_gap(quantities[name], quantities["gap"], used)

    shares: dict[str, float] = {}
    for name in BRACKET_QUANTITIES:
        value = area(ends["gap"]) if name == "gap" else share(ends, name)
        drawn = area(sampled["gap"]) if name == "gap" else share(sampled, name)
        low, high = percentile_interval(drawn[:, None], confidence)
        shares.update(
            {name: float(value), f"{name}_lo": float(low[0]), f"{name}_hi": float(high[0])}
        )
    for factor in ("S", "B"):
        width = share(sampled, f"{factor}_upper") - share(sampled, f"{factor}_lower")
        shares[f"{factor}_width_hi"] = float(_upper(width[:, None], confidence)[0])
    shares["headroom"] = float(area(point["full"] - point["base_rate"]))
    shares["headroom_lo"] = float(
        percentile_interval(area(draws["full"] - draws["base_rate"])[:, None], confidence)[0][0]
    )
    # The point estimate with its interval, and that interval's width: the decomposition at the
    # end whose S share is S_lower once the ends are in order (`_ordered`): the lower end's (S
    # discounted, and the B and D that go with it), or the upper end's where the gap's area is
    # negative, since dividing by it flips which end's share is the smaller.
    side = "upper" if float(area(ends["gap"])) < 0 else "lower"
    for factor, end in (("S", f"S_{side}"), ("B", f"B_at_{side}"), ("D", f"D_at_{side}")):
        low, high = percentile_interval(share(sampled, end)[:, None], confidence)
        shares[f"{factor}_point"] = float(share(ends, end))
        shares[f"{factor}_point_lo"], shares[f"{factor}_point_hi"] = float(low[0]), float(high[0])
        shares[f"{factor}_point_interval"] = float(high[0] - low[0])
    # S and B in both orders (calibrated cells, undiscounted): S first on truncate (b - a) or
    # after replay (d - c); B first by replay (c - a) or after calibration (d - b).
    orders = {
        "S_first": ("calibrate_truncate", "truncate"),
        "S_after_B": ("calibrate_replay", "replay"),
        "B_first": ("replay", "truncate"),
        "B_after_S": ("calibrate_replay", "calibrate_truncate"),
    }
    for name, (after, before) in orders.items():
        point_order = {"gap": ends["gap"], name: point[after] - point[before]}
        drawn_order = {"gap": sampled["gap"], name: draws[after] - draws[before]}
        low, high = percentile_interval(share(drawn_order, name)[:, None], confidence)
        shares.update(
            {
                name: float(share(point_order, name)),
                f"{name}_lo": float(low[0]),
                f"{name}_hi": float(high[0]),
            }
        )
    # Each factor in the worse order at every k (no cancellation between k's): S as
    # min(b - a, d - c), B as min(c - a, d - b), summed over k, as shares, with intervals.
    worse = {
        "S_worse_order": (("calibrate_truncate", "truncate"), ("calibrate_replay", "replay")),
        "B_worse_order": (("replay", "truncate"), ("calibrate_replay", "calibrate_truncate")),
    }
    for name, ((after_1, before_1), (after_2, before_2)) in worse.items():
        point_worse = np.minimum(point[after_1] - point[before_1], point[after_2] - point[before_2])
        drawn_worse = np.minimum(draws[after_1] - draws[before_1], draws[after_2] - draws[before_2])
        low, high = percentile_interval(
            share({"gap": sampled["gap"], name: drawn_worse}, name)[:, None], confidence
        )
        shares[name] = float(share({"gap": ends["gap"], name: point_worse}, name))
        shares[f"{name}_lo"], shares[f"{name}_hi"] = float(low[0]), float(high[0])
    drawn_difference = share({"gap": sampled["gap"], "I": _order_difference(draws)}, "I")
    shares["order_difference"] = float(
        share({"gap": ends["gap"], "I": _order_difference(point)}, "I")
    )
    shares["order_width_hi"] = float(_upper(np.abs(drawn_difference)[:, None], confidence)[0])
    # The orders' span summed per k, so that differences of opposite sign at two k's do not
    # cancel: area(|I_BS|) / area(gap), with the upper end of its interval.
    point_span = {"gap": ends["gap"], "I": np.abs(_order_difference(point))}
    drawn_span = share({"gap": sampled["gap"], "I": np.abs(_order_difference(draws))}, "I")
    shares["order_span"] = float(share(point_span, "I"))
    shares["order_span_hi"] = float(_upper(drawn_span[:, None], confidence)[0])
    return _ordered(shares)


_SHARE_KEYS = (
    *(f"{n}{s}" for n in BRACKET_QUANTITIES for s in ("", "_lo", "_hi")),
    "S_width_hi",
    "B_width_hi",
    "headroom",
    "headroom_lo",
    *(f"{f}_point{s}" for f in ("S", "B", "D") for s in ("", "_lo", "_hi", "_interval")),
    *(
        f"{n}{s}"
        for n in ("S_first", "S_after_B", "B_first", "B_after_S")
        for s in ("", "_lo", "_hi")
    ),
    "order_difference",
    "order_width_hi",
    "order_span",
    "order_span_hi",
    *(f"{n}{s}" for n in ("S_worse_order", "B_worse_order") for s in ("", "_lo", "_hi")),
)


def _ordered(shares: dict[str, float]) -> dict[str, float]:
    """The shares with every bracket's ends in order: where the gap's area is negative, dividing
    by it flips them, so lower and upper (each with its interval) trade places."""
    if not shares["gap"] < 0:
        return shares
    ordered = dict(shares)
    for factor in ("S", "B", "D"):
        for suffix in ("", "_lo", "_hi"):
            lower, upper = f"{factor}_lower{suffix}", f"{factor}_upper{suffix}"
            ordered[lower], ordered[upper] = shares[upper], shares[lower]
    return ordered


def _json_float(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None
