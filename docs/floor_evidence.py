"""How far the calibration maps' eigenvalue floor moves a readout that needs no calibration.

On `mixture_shift_blocks` (planted S + B), replay reproduces full depth on the block-count
positions, so calibrate(replay(k)) should read out there as full depth does: whatever it
changes is the map's, and a change of full depth's top-1 books a gap to D that the truth gives
to no factor. The map is fitted on every position of the calibration split (the shifted ones
included), as the protocol fits it, for each k of the grid, with three eigenvalue floors (the
protocol lifts the shrunk covariance C's eigenvalues to `rounding_floor`):

- ``sqrt(d) eps32``: float32's eps times sqrt(d) times |C|_F, the floor before it lost its
  factor of the width;
- ``eps32``: float32's eps times |C|_F, `rounding_floor` now;
- ``float64``: 2 d times float64's eps times |C|_F (still above what `symmetric_eigh` refuses).

Per seed and width (each model embedded with `embed` at that width and seed), over the k below
r: the largest change of a logit relative to the position's mean change (logit units; full
depth's median top-two margin on these positions is about 2.3), and how many (position, k)
pairs change full depth's top-1. The seeds are the ones whose block-count positions hold the
nearest ties at full depth, and one without.

Run: ``OMP_NUM_THREADS=1 python docs/floor_evidence.py [--out docs/data/calibration_floor.json]``
(about ten minutes on one thread).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from dcp_lens.protocol.calibration.linalg import ledoit_wolf_shrinkage, power_of, symmetric_eigh
from dcp_lens.protocol.calibration.moments import StreamingMoments
from dcp_lens.protocol.conditions import Replay
from dcp_lens.protocol.states import capture_states
from dcp_lens.zoo import planted
from dcp_lens.zoo.planted.embedding import embed

MODEL = "mixture_shift_blocks"
SEEDS = (3, 23, 9, 1)
WIDTHS = (None, 256, 1024, 2048)
FLOORS = ("sqrt(d) eps32", "eps32", "float64")


def _floor(covariance: torch.Tensor, kind: str) -> float:
    width, norm = covariance.shape[0], float(torch.linalg.matrix_norm(covariance))
    if kind == "float64":
        return 2.0 * width * torch.finfo(torch.float64).eps * norm
    eps = torch.finfo(torch.float32).eps
    return eps * norm * (math.sqrt(width) if kind == "sqrt(d) eps32" else 1.0)


def _map(source: StreamingMoments, reference: StreamingMoments, kind: str) -> tuple:
    """(linear [d, d], source mean, reference mean) of the full-mode map with floor ``kind``:
    `AffineCalibration.fit`'s C_ref^(1/2) C_src^(-1/2) with that floor in place of its own."""
    powers = []
    for moments, exponent in ((reference, 0.5), (source, -0.5)):
        shrunk = ledoit_wolf_shrinkage(moments).covariance
        eigen = symmetric_eigh(shrunk, "covariance", torch.float64, _floor(shrunk, kind))
        powers.append(power_of((*eigen, None), exponent))
    return powers[0] @ powers[1], source.mean, reference.mean


def measure(seed: int, width: int | None, n: int = 512) -> dict:
    """One seed at one width: per floor, the largest leak and the top-1 changes over k < r."""
    model = planted.BUILDERS[MODEL](seed=seed)
    built_width = model.cfg.d_model
    if width is not None:
        model = embed(model, width, seed=seed)
    task = model.planted_task
    evaluation, calibration = task.evaluation(n), task.calibration(n)
    r = model.n_iterations
    with torch.no_grad():
        cal_states, _ = capture_states(model, calibration.tokens)
        states, full = capture_states(model, evaluation.tokens)
        d = states.shape[-1]
        block = task.factor_masks(evaluation.tokens)["B"] & (evaluation.targets >= 0)
        top1 = full.argmax(-1)
        margins = full.topk(2, -1).values
        reference = StreamingMoments.from_samples(cal_states[r].reshape(-1, d).double())
        result: dict = {
            "seed": seed,
            "width": d,
            "built_width": built_width,
            "block_positions": int(block.sum()),
            "min_margin": float((margins[..., 0] - margins[..., 1])[block].min()),
            "floor_now": reference.eigenvalue_floor(),
            "floors": {},
        }
        for kind in FLOORS:
            leak, changed = 0.0, 0
            for k in range(1, r):
                replay = Replay(k)
                source_states = replay.readout_input(cal_states).reshape(-1, d).double()
                source = StreamingMoments.from_samples(source_states)
                linear, source_mean, reference_mean = _map(source, reference, kind)
                shifted = replay.readout_input(states).double() - source_mean
                mapped = reference_mean + shifted @ linear.T
                logits = model.readout(mapped.to(states.dtype))
                change = (logits - full)[block]
                change = change - change.mean(-1, keepdim=True)
                leak = max(leak, float(change.abs().max()))
                changed += int(((logits.argmax(-1) != top1) & block).sum())
            result["floors"][kind] = {"largest_leak": leak, "top1_changed": changed}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/data/calibration_floor.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for seed in SEEDS:
        for width in WIDTHS:
            start = time.perf_counter()
            rows.append(measure(seed, width))
            took = time.perf_counter() - start
            print(seed, width, rows[-1]["floors"], f"{took:.0f} s", flush=True)
    document = {
        "model": MODEL,
        "seeds": list(SEEDS),
        "widths": [w if w is not None else "built" for w in WIDTHS],
        "floors": list(FLOORS),
        "n_eval": 512,
        "n_calibration": 512,
        "rows": rows,
    }
    args.out.write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
