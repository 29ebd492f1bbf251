"""Evidence for the S bracket (docs/bracket.md) on every planted model, before it is wired in.

For each planted model: run `DepthControlProtocol` (the five conditions of today's sweep), then,
outside the sweep, the three conditions the bracket adds:

- ``translate_truncate`` / ``translate_replay``: a paired affine translator per k, h -> A h + b
  on the readout input, fitted on the calibration split only (Adam on the KL from full depth's
  readout of the same example and position to the model's readout of the translated state),
  evaluated on the evaluation split;
- ``base_rate``: the mixture of full depth's predictions over the calibration split's examples
  at the same position (what a readout with no information about the example can do), read
  against each evaluation example's own target.

The existing conditions' per-example values are rebuilt from the protocol's fitted maps and
temperatures and checked against its results' curves. Everything goes to
`dcp_lens.protocol.bracket.bracket_from_values`; the table compares the bracket with the planted
truth (`dcp_lens.zoo.planted.expected_shares`, `IDENTIFIABLE`).

Run: ``OMP_NUM_THREADS=1 nice python docs/bracket_evidence.py [--models a,b] [--metrics ...]``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from dcp_lens import DepthControlProtocol
from dcp_lens.protocol.bracket import Bracket, bracket_from_values
from dcp_lens.protocol.conditions import Replay, Truncate
from dcp_lens.protocol.metrics import HIGHER_IS_BETTER, per_example_metrics, reference_log_probs
from dcp_lens.protocol.states import capture_states
from dcp_lens.zoo import planted

EXISTING = ("truncate", "calibrate_truncate", "replay", "calibrate_replay")


def fit_translator(model, source, full_logits, steps: int = 300, lr: float = 0.02):
    """Affine h -> h @ A + b minimising KL(full || readout(translated)) over the calibration
    split's positions. ``source``: [n, pos, d]; ``full_logits``: [n, pos, vocab]."""
    d = source.shape[-1]
    h = source.reshape(-1, d).detach()
    target = full_logits.reshape(-1, full_logits.shape[-1]).log_softmax(-1).detach()
    scale = h.std().clamp(min=1e-6)
    weight = torch.eye(d, requires_grad=True)
    bias = torch.zeros(d, requires_grad=True)
    optimizer = torch.optim.Adam([weight, bias], lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        log_probs = model.readout((h @ weight + bias * scale)[None])[0].log_softmax(-1)
        loss = (target.exp() * (target - log_probs)).sum(-1).mean()
        loss.backward()
        optimizer.step()
    weight, bias = weight.detach(), (bias * scale).detach()
    return lambda state: state @ weight + bias


def base_rate_logits(full_logits: torch.Tensor) -> torch.Tensor:
    """[pos, vocab]: log of the mean full-depth distribution at each position."""
    return full_logits.double().softmax(-1).mean(0).clamp(min=1e-30).log().float()


def evidence(name: str, metrics: tuple[str, ...], n: int, n_bootstrap: int, seed: int):
    model = planted.load_planted(name, seed=seed)
    task = model.planted_task
    calibration, evaluation = task.calibration(n), task.evaluation(n)
    protocol = DepthControlProtocol(
        model, metrics=metrics, n_bootstrap=n_bootstrap, probe="none", progress=False, seed=seed
    )
    results = protocol.run(evaluation, calibration)
    k_grid, r = protocol.context.k_grid, protocol.r
    with torch.no_grad():
        cal_states, cal_full = capture_states(model, calibration.tokens)
        states, full_logits = capture_states(model, evaluation.tokens)
    full_log_probs = reference_log_probs(full_logits)
    targets = evaluation.targets

    def by_position(logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each metric per position, [n, pos] (a position as its own example)."""
        flat = per_example_metrics(
            logits.flatten(0, 1)[:, None], full_log_probs.flatten(0, 1)[:, None],
            targets.flatten()[:, None], metrics,
        )  # fmt: skip
        return {m: v.view(targets.shape) for m, v in flat.items()}

    def score(logits: torch.Tensor) -> dict[str, np.ndarray]:
        values = per_example_metrics(logits, full_log_probs, targets, metrics)
        return {m: v.double().numpy() for m, v in values.items()}

    per_k = (*EXISTING, "translate_truncate", "translate_replay")
    values: dict[str, dict] = {m: {c: {} for c in per_k} for m in metrics}
    for metric, vector in score(full_logits).items():
        values[metric]["full"] = vector
    walked_any = torch.zeros(targets.shape, dtype=torch.bool)
    replay_gain: dict[int, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        base = base_rate_logits(cal_full)[None].expand_as(full_logits)
        for metric, vector in score(base).items():
            values[metric]["base_rate"] = vector
    for k in k_grid:
        with torch.no_grad():
            for name_ in EXISTING:
                logits = model.readout(protocol.condition(name_, k).readout_input(states))
                logits = logits / protocol.temperatures.get((name_, k), 1.0)
                for metric, vector in score(logits).items():
                    values[metric][name_][k] = vector
        for source_name, source in (("truncate", Truncate(k)), ("replay", Replay(k))):
            translate = fit_translator(model, source.readout_input(cal_states), cal_full)
            with torch.no_grad():
                logits = model.readout(translate(source.readout_input(states)))
            for metric, vector in score(logits).items():
                values[metric][f"translate_{source_name}"][k] = vector
        with torch.no_grad():
            # The walk: replay's top-1 is neither truncation's nor full depth's, but one that a
            # later truncation k < k' < r reads for the same example (replay did later steps).
            top_t = model.readout(Truncate(k).readout_input(states)).argmax(-1)
            top_r = model.readout(Replay(k).readout_input(states)).argmax(-1)
            top_f = full_logits.argmax(-1)
            later = torch.zeros_like(top_r, dtype=torch.bool)
            for k_later in range(k + 1, r):
                later |= model.readout(states[k_later]).argmax(-1) == top_r
            walked = (top_r != top_t) & (top_r != top_f) & later
            walked_any |= walked
            truncated = by_position(model.readout(Truncate(k).readout_input(states)))
            replayed = by_position(model.readout(Replay(k).readout_input(states)))
            replay_gain[k] = {m: replayed[m] - truncated[m] for m in metrics}
    brackets, truths = {}, {}
    for metric in metrics:
        curves = results.decompositions[metric].curves
        for name_ in EXISTING:  # the rebuilt cells are the protocol's own
            rebuilt = np.array([values[metric][name_][k].mean() for k in k_grid])
            assert np.allclose(rebuilt, curves[name_], atol=1e-4), (name, metric, name_)
        brackets[metric] = bracket_from_values(
            values[metric],
            k_grid,
            higher_is_better=HIGHER_IS_BETTER[metric],
            n_bootstrap=n_bootstrap,
            seed=seed,
            walk_gain=[float((replay_gain[k][metric] * walked_any).mean()) for k in k_grid],
        )
        truths[metric] = planted.expected_shares(name, model, evaluation, metric, k_grid)
    point_s = {m: results.decompositions[m].shares["S"] for m in metrics}
    return brackets, truths, point_s


def judge(name: str, metric: str, result: Bracket, truth: dict[str, float]) -> tuple[bool, str]:
    """Whether a row is right: the truth inside the bracket (intervals included, 0.05 slack for
    the truth's own sampling), narrow and named on identifiable models (accuracy, the validated
    metric; on a loss a flag is accepted there too), flagged on ambiguous ones, and never a
    verdict naming a factor the truth does not hold most of."""
    s = result.shares
    inside = all(
        s[f"{f}_lower_lo"] - 0.05 <= truth[f] <= s[f"{f}_upper_hi"] + 0.05 for f in ("S", "B", "D")
    )
    named_wrong = result.verdict in ("S", "B", "D") and truth[result.verdict] < 0.75
    if named_wrong:
        return False, f"names {result.verdict}, truth {truth[result.verdict]:.2f}"
    if planted.IDENTIFIABLE[name] and not (
        metric != "accuracy" and result.verdict == "inconclusive"
    ):
        top = max(truth, key=lambda f: truth[f])
        expected = top if truth[top] >= 0.75 else "mixed"
        if not (result.S_identified and inside and result.verdict == expected):
            return False, f"identifiable: want {expected}, identified and truth inside"
        return True, "truth inside, narrow"
    flagged = not (result.S_identified and result.B_identified)
    if not flagged:
        return inside, "not flagged" + ("" if inside else ", truth outside")
    return True, "flagged" + (", truth inside" if inside else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(planted.BRACKET_PLANTED))
    parser.add_argument("--metrics", default="accuracy,kl_to_full")
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--bootstrap", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    metrics = tuple(args.metrics.split(","))
    header = (
        "| model | metric | truth S/B/D | DCP S | S bracket | B bracket | D bracket | S id | B id"
        " | verdict | right? |"
    )
    print(header)
    print("|---" * 11 + "|")
    failures = 0
    for name in args.models.split(","):
        started = time.time()
        brackets, truths, point_s = evidence(name, metrics, args.n, args.bootstrap, args.seed)
        for metric in metrics:
            result, truth = brackets[metric], truths[metric]
            s = result.shares
            ok, why = judge(name, metric, result, truth)
            failures += not ok

            def span(f: str, s: dict = s) -> str:
                return f"[{s[f'{f}_lower_lo']:.2f}, {s[f'{f}_upper_hi']:.2f}]"

            truth_text = "/".join(f"{truth[f]:.2f}" for f in ("S", "B", "D"))
            print(
                f"| {name} | {metric} | {truth_text} | {point_s[metric]:.2f} | {span('S')}"
                f" | {span('B')} | {span('D')} | {result.S_identified} | {result.B_identified}"
                f" | {result.verdict} | {'yes' if ok else 'NO'}: {why} |",
                flush=True,
            )
        print(f"<!-- {name}: {time.time() - started:.0f} s -->", flush=True)
    print(f"\n{failures} rows wrong" if failures else "\nevery row right")


if __name__ == "__main__":
    main()
