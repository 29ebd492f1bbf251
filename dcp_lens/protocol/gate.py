"""The paired translators' held-out gate: each translator's ridge chosen on held-out folds, and
the translator judged by what the readout does with its held-out predictions (docs/bracket.md,
"A translator is judged by what the readout reads").

A paired translator is the ridge least-squares affine map from a source's readout inputs to each
example's own full-depth state s_r. Its worth is not its squared error over every coordinate of
the state: most coordinates of a real model's stream carry content its readout barely reads, and
an error there says nothing about the upper end of S. So the gate weighs, on every held-out
fold, the errors of the refit's prediction and of the other folds' mean full-depth state by the
readout's own geometry: the change of the logits each error makes through the readout's
derivative at the mean full-depth state. The ridge is chosen on the same folds,
from a grid spanning well-determined fits to fits shrunk almost to the mean: one
eigen-decomposition of the source's centred gram gives every ridge and, through the Woodbury
identity, every fold's refit, so the test is made at every width without a ridge trusted
blindly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from jaxtyping import Float, Int
from torch import Tensor

# The ridges the gate chooses from, relative to the mean eigenvalue of the source's centred gram
# (the sum of squares of its centred coordinates over the width); the bias is never shrunk.
RIDGES = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)
# The ridge of a translator no held-out test could judge (same units).
DEFAULT_RIDGE = 1e-4
# A translator is kept where its held-out gain over the mean state exceeds this many standard
# errors of the gain (one-sided, about 2.5% of translators with no information kept by chance).
STANDARD_ERRORS = 2.0
# The central difference's step where forward mode is not supported, relative to the state's RMS.
DIFFERENCE_STEP = 1e-2
# Readout logits held at once while judging (positions times vocabulary), bounding memory.
READOUT_ELEMENTS = 1 << 24

KEPT, REPLACED, UNTESTABLE = "kept", "replaced_by_the_mean", "untestable"

# [positions, d_model] -> [positions, d_vocab]: the model's readout of states read one by one.
StateReadout = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class GateRecord:
    """How one paired translator was judged.

    Attributes:
        judged: `KEPT`, `REPLACED` (by the mean translator) or `UNTESTABLE` (kept: no held-out
            test could be made).
        ridge: the chosen ridge, relative to the mean eigenvalue of the source's centred gram.
        translator_error: held-out readout error of the refits at that ridge, per position.
        mean_error: held-out readout error of the other folds' mean state, per position.
        folds: held-out folds the errors sum over.
        positions: positions the translator was fitted on.
        reason: why, in words.
    """

    judged: str
    ridge: float
    translator_error: float
    mean_error: float
    folds: int
    positions: int
    reason: str

    def record(self) -> dict[str, object]:
        """The record results save (JSON types; None where not measured)."""
        return {
            "judged": self.judged,
            "ridge": self.ridge,
            "translator_error": _number(self.translator_error),
            "mean_error": _number(self.mean_error),
            "folds": self.folds,
            "positions": self.positions,
            "reason": self.reason,
        }

    @classmethod
    def from_record(cls, record: dict[str, object]) -> GateRecord:
        """The record back from its saved form."""
        ridge, error, mean = (
            _float(record.get(key)) for key in ("ridge", "translator_error", "mean_error")
        )
        folds, positions = (int(_float(record.get(key, 0))) for key in ("folds", "positions"))
        return cls(
            str(record["judged"]),
            ridge,
            error,
            mean,
            folds,
            positions,
            str(record.get("reason", "")),
        )


def _number(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _float(value: object) -> float:
    return float(value) if isinstance(value, int | float) else math.nan


def untestable(positions: int, reason: str) -> GateRecord:
    """The record of a translator kept at `DEFAULT_RIDGE` because no test could be made."""
    return GateRecord(UNTESTABLE, DEFAULT_RIDGE, math.nan, math.nan, 0, positions, reason)


def ridge_scale(source: Float[Tensor, "n d_model"]) -> float:
    """The unit of `RIDGES`: the mean eigenvalue of ``source``'s centred gram (its centred sum
    of squares over the width), and a tiny floor so that constant states keep a ridge."""
    x = source.double()
    centred = x - x.mean(0)
    return float((centred**2).sum()) / max(1, x.shape[-1]) + 1e-12


def judge(
    source: Float[Tensor, "n d_model"],
    target: Float[Tensor, "n d_model"],
    group: Int[Tensor, " n"],
    n_groups: int,
    readout: StateReadout | ReadoutGeometry,
) -> GateRecord:
    """Choose the translator's ridge and judge it on the held-out folds ``group`` (values
    0..``n_groups`` - 1).

    For every ridge of `RIDGES` and every fold, the refit without the fold predicts the fold's
    full-depth states; the readout error of a prediction is the squared change of the centred
    logits its error makes through the readout's derivative at the mean full-depth state
    (`ReadoutGeometry`; built here from ``readout`` unless one is given). The ridge with the
    least error summed over the folds is chosen (`_decided`); the translator is kept where its
    gain over the other folds' mean state (the mean translator) exceeds `STANDARD_ERRORS`
    standard errors, else replaced by the mean. Untestable (kept) where fewer than two folds
    hold positions or an error is not finite."""
    n = source.shape[0]
    folds = [(group == g).nonzero().squeeze(1) for g in range(n_groups) if bool((group == g).any())]
    if len(folds) < 2 or any(len(rows) >= n for rows in folds):
        return untestable(n, "fewer than two held-out folds hold positions")
    if not isinstance(readout, ReadoutGeometry):
        readout = ReadoutGeometry(readout, target.double().mean(0).to(target.dtype))
    geometry = readout
    # Every prediction is linear in the targets: the errors of what the readout reads are
    # those of predicting what it reads (`ReadoutGeometry.read`), which may be fewer columns.
    y = geometry.read(target.double())  # [n, c]
    path = _RidgePath(source, y)
    scale = ridge_scale(source)
    order = torch.cat(folds)  # every position once, fold by fold
    sizes = [len(rows) for rows in folds]
    others = torch.stack([(y.sum(0) - y[rows].sum(0)) / (n - len(rows)) for rows in folds])
    mean_predictions = torch.repeat_interleave(others, torch.tensor(sizes, device=y.device), 0)
    mean_errors = _per_fold(geometry.read_error(mean_predictions - y[order]), sizes)
    errors = []  # per ridge, per fold
    for ridge in RIDGES:  # one ridge's fitted values at a time
        predicted = torch.cat([path.held_out(rows, ridge * scale) for rows in folds])
        errors.append(_per_fold(geometry.read_error(predicted - y[order]), sizes))
    return _decided(errors, mean_errors, n)


def _per_fold(per_position: Tensor, sizes: list[int]) -> list[float]:
    return [float(part.sum()) for part in per_position.split(sizes)]


def _decided(errors: list[list[float]], mean_errors: list[float], n: int) -> GateRecord:
    """The record from the held-out errors per ridge and fold (``errors``) and the mean
    state's per fold: the ridge of least summed error, kept where its gain over the mean
    exceeds `STANDARD_ERRORS` standard errors of that gain (from the spread of the per-fold
    gains)."""
    totals = [sum(per_fold) for per_fold in errors]
    best = min(range(len(RIDGES)), key=lambda i: totals[i])
    error, mean_error = totals[best], sum(mean_errors)
    folds = len(mean_errors)
    if not (math.isfinite(error) and math.isfinite(mean_error)):
        return untestable(n, "a held-out readout error is not finite")
    gains = torch.tensor(mean_errors, dtype=torch.float64) - torch.tensor(errors[best])
    spread = float(gains.std()) * math.sqrt(folds)  # the standard error of the summed gain
    record = (RIDGES[best], error / n, mean_error / n, folds, n)
    if mean_error - error > STANDARD_ERRORS * spread:
        reason = (
            "the held-out refits' readout is closer to full depth's than the mean state's by"
            f" more than {STANDARD_ERRORS:g} standard errors over {folds} folds"
        )
        return GateRecord(KEPT, *record, reason)
    reason = (
        "the held-out refits' readout is not closer to full depth's than the mean state's by"
        f" more than {STANDARD_ERRORS:g} standard errors over {folds} folds"
    )
    return GateRecord(REPLACED, *record, reason)


class ReadoutGeometry:
    """The readout's error of state errors e [n, d_model] at the state ``at`` [d_model], per
    position: ||P C J e||^2 = e^T M e, J the readout's Jacobian at ``at``, C the removal of each
    position's mean logit and P the removal of the direction of ``at``'s own centred logits.

    A fixed quadratic form: an error in a direction the readout does not read costs nothing,
    and a prediction with no information about the state does worse than the mean in
    expectation. P leaves out what only rescales the logits: through a norm before the
    unembedding, any error that changes the state's length (content the readout does not read
    included) moves the logits along the logits themselves, a change of confidence, not of what
    is read.

    P C is a symmetric projection (P and C commute), so M = J^T P C J = B B^T with
    B = (P C J)^T [d_model, d_vocab]. B is formed a block of rows at a time: a forward-mode
    derivative along a block of unit vectors, projected; each block holds at most
    `READOUT_ELEMENTS` logits. Where the vocabulary is narrower than the stream, B is kept
    (``factor``) and an error is read in d_vocab coordinates (`read`), so that the gate works
    in them. Otherwise M [d_model, d_model] is formed (``metric``) and no [d_model, d_vocab]
    matrix is held: each block is pulled back through the readout (a reverse-mode derivative).
    One geometry serves every translator of a run (they share the full-depth states)."""

    def __init__(self, readout: StateReadout, at: Float[Tensor, " d_model"]) -> None:
        with torch.no_grad():
            logits = readout(at[None].clone())[0].double()
        direction = logits - logits.mean()
        direction = direction / direction.norm().clamp(min=1e-300)
        d_model = at.shape[-1]
        narrow = logits.shape[-1] < d_model
        rows = max(1, READOUT_ELEMENTS // max(1, logits.shape[-1]))
        eye = torch.eye(d_model, dtype=at.dtype, device=at.device)
        blocks = []
        for basis in eye.split(rows):
            primal = at.expand_as(basis).clone()
            change = _pushed_forward(readout, primal, basis).double()
            change = change - change.mean(-1, keepdim=True)
            change = change - (change @ direction)[:, None] * direction
            change = change - change.mean(-1, keepdim=True)  # C P C: P C stays centred
            if narrow:  # rows of B
                blocks.append(change)
                continue
            pull_back = torch.func.vjp(readout, primal)[1]
            blocks.append(pull_back(change.to(at.dtype))[0].detach())
        stacked = torch.cat(blocks).double()
        self.factor: Tensor | None = stacked if narrow else None  # [d_model, d_vocab]
        self.metric = stacked @ stacked.T if narrow else (stacked + stacked.T) / 2

    def read(self, states: Float[Tensor, "n d_model"]) -> Float[Tensor, "n c"]:
        """What the readout reads of ``states`` (float64): ``states @ B`` [n, d_vocab] where
        the factor is kept, else ``states`` themselves. Linear, so the read error of a
        prediction is `read_error` of the difference of the read states."""
        x = states.double().to(self.metric.device)
        return x if self.factor is None else x @ self.factor

    def read_error(self, read: Float[Tensor, "n c"]) -> Float[Tensor, " n"]:
        """The readout's error per position of read errors (`read`): their squared norm where
        the factor is kept, else the quadratic form of the metric."""
        if self.factor is not None:
            return read.pow(2).sum(-1)
        return ((read @ self.metric) * read).sum(-1)

    def __call__(self, error: Float[Tensor, "n d_model"]) -> Float[Tensor, " n"]:
        return self.read_error(self.read(error))


def _pushed_forward(readout: StateReadout, primal: Tensor, tangent: Tensor) -> Tensor:
    """J t for each row: a forward-mode derivative, or, where the readout has an operation
    forward mode does not support (a fused attention kernel in a coda), a central difference
    with a step of `DIFFERENCE_STEP` times the RMS of the state."""
    try:
        return torch.func.jvp(readout, (primal,), (tangent,))[1].detach()
    except (NotImplementedError, RuntimeError):
        step = DIFFERENCE_STEP * float(primal[0].double().pow(2).mean().sqrt()) + 1e-12
        with torch.no_grad():
            ahead, behind = readout(primal + step * tangent), readout(primal - step * tangent)
        return (ahead.double() - behind.double()) / (2 * step)


class _RidgePath:
    """Every held-out refit of the ridge least-squares affine map from ``source`` to ``target``
    (bias unshrunk) from one eigen-decomposition of the centred gram X_c^T X_c = Q L Q^T.

    With Z = [X_c Q, 1] and the whole split's inverse gram diagonal in that basis (1 / (L + l)
    and 1 / n), a fold's rows leave the fit by the Woodbury identity: with its hat block
    H = Z_g diag Z_g^T and the whole split's fitted values F_g, the refit without the fold
    predicts Y_g - (I - H)^{-1} (Y_g - F_g). Cost: the decomposition and one n x d x d product
    per ridge; memory a few d x d and n x d float64 matrices."""

    def __init__(self, source: Tensor, target: Tensor) -> None:
        x, y = source.double(), target.double()
        self.n = x.shape[0]
        self.x_mean, self.y_mean = x.mean(0), y.mean(0)
        centred = x - self.x_mean
        values, vectors = torch.linalg.eigh(centred.T @ centred)
        self.values = values.clamp(min=0.0)
        self.rotated = centred @ vectors  # [n, d]
        self.moment = self.rotated.T @ (y - self.y_mean)  # [d, d_model]
        self.y = y
        self._fitted: dict[float, Tensor] = {}

    def fitted(self, ridge: float) -> Tensor:
        """The whole split's fitted values at ``ridge`` [n, d_model]."""
        if ridge not in self._fitted:
            self._fitted.clear()
            inverse = 1.0 / (self.values + ridge)
            self._fitted[ridge] = (self.rotated * inverse) @ self.moment + self.y_mean
        return self._fitted[ridge]

    def held_out(self, rows: Tensor, ridge: float) -> Tensor:
        """The refit without ``rows``, applied to their sources [len(rows), d_model]."""
        inverse = 1.0 / (self.values + ridge)
        z = self.rotated.index_select(0, rows)
        hat = (z * inverse) @ z.T + 1.0 / self.n
        y = self.y.index_select(0, rows)
        residual = y - self.fitted(ridge).index_select(0, rows)
        eye = torch.eye(len(rows), dtype=hat.dtype, device=hat.device)
        solved, info = torch.linalg.solve_ex(eye - hat, residual)
        if int(info) != 0:
            return torch.full_like(y, math.nan)
        return y - solved


def untested_translators(gate: object) -> str | None:
    """A sentence on the paired translators the gate could not test, from a run's
    ``metadata.translator_gate`` (label -> `GateRecord.to_dict` form; None for none), or None
    where every one was tested: the untested are kept with `DEFAULT_RIDGE`, so the S bracket's
    upper end rests on fits no held-out data checked."""
    if not isinstance(gate, Mapping):
        return None
    untested = {
        label: record
        for label, record in gate.items()
        if isinstance(record, Mapping) and record.get("judged") == UNTESTABLE
    }
    if not untested:
        return None
    reasons = sorted(
        {str(record.get("reason") or "no reason given") for record in untested.values()}
    )
    return (
        f"{len(untested)} of {len(gate)} paired translators could not be tested on held-out data"
        f" ({'; '.join(reasons)}): kept with the default ridge, so the upper end of S rests on"
        " fits nothing checked"
    )
