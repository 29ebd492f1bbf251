"""What report.html shows that only the model can give, measured once while the model is at hand
and stored as ``report_data.json`` beside ``results.json``, so that ``dcp-lens report DIR``
re-renders a finished run without the model:

- ``lens``: the readout applied to every state s_t of one evaluation example (through the
  pre-coda norm and coda), top-1 token and probability per (iteration, position);
- ``attention``: the attention pattern of the first core layer at every iteration, same example;
- ``by_hops``: where the task records each answer's hop count, DCP on the answers of each hop
  count separately (the decomposition of `dcp_lens.protocol.decomposition.decompose`, bootstrap over
  answers).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dcp_lens.lenses.lens import logit_lens
from dcp_lens.protocol.conditions import DECOMPOSED
from dcp_lens.protocol.dcp import DepthControlProtocol, EvaluationSet
from dcp_lens.protocol.decomposition import decompose
from dcp_lens.protocol.records import JSONValue
from dcp_lens.protocol.results import decode_json, encode_json
from dcp_lens.utils.checks import read_json_object
from dcp_lens.utils.errors import DamagedFileError
from dcp_lens.utils.files import write_text_atomically

REPORT_DATA = "report_data.json"
MAX_POSITIONS = 48  # the lens and attention figures stay legible and report_data.json small


@torch.no_grad()
def collect_report_data(
    protocol: DepthControlProtocol,
    evaluation: EvaluationSet,
    *,
    vocab: Sequence[str] | None = None,
    example: int = 0,
    n_bootstrap: int = 200,
) -> dict[str, object]:
    """The report's model-dependent figures for one finished run of ``protocol`` (after `run`).

    Args:
        protocol: the protocol that produced the results (its fitted calibrations are used).
        evaluation: the evaluation set it ran on.
        vocab: token strings by id (default: the ids as text).
        example: the evaluation example shown in the lens and attention figures.
        n_bootstrap: bootstrap draws of the per-hop decomposition.

    Returns:
        ``{"model": spec, "lens": ..., "attention": ..., "by_hops": ...}``, JSON-ready;
        ``attention`` and ``by_hops`` are left out where the model or task has none.
    """
    model = protocol.model
    was_training = getattr(model, "training", False)
    model.eval()
    try:
        entry = {
            "model": protocol.spec,
            "lens": lens_record(protocol, evaluation, example, vocab),
            "attention": attention_across_iterations(protocol, evaluation, example, vocab),
            "by_hops": hop_breakdown(protocol, evaluation, n_bootstrap),
        }
    finally:
        model.train(was_training)
    # JSON null reads back as NaN here (`decode_json`), so what a model lacks is left out.
    return {key: value for key, value in entry.items() if value is not None}


def lens_record(
    protocol: DepthControlProtocol,
    evaluation: EvaluationSet,
    example: int,
    vocab: Sequence[str] | None,
) -> dict[str, object]:
    """Readout of every s_t (t = 0..r) of one example: ``iterations``, ``tokens`` (input),
    ``targets`` (the scored answers, None elsewhere), ``top_tokens`` and ``top_probs``
    ``[t][position]``, ``target_probs`` ``[t][position]`` (None where nothing is scored).
    The logits are `dcp_lens.lenses.lens.logit_lens`'s."""
    tokens, targets = _example(evaluation, example)
    logits = logit_lens(protocol.model, tokens[None].to(_device(protocol)))  # [r + 1, 1, pos, V]
    probs = logits[:, 0].float().softmax(-1)  # [r + 1, pos, vocab]
    top_probs, top_ids = probs.max(-1)
    scored = targets != -100
    target_probs = probs.gather(-1, targets.clamp(min=0)[None, :, None].expand(len(probs), -1, 1))
    return {
        "iterations": list(range(len(probs))),
        "tokens": _names(tokens, vocab),
        "targets": [
            _name(int(t), vocab) if s else None for t, s in zip(targets, scored, strict=True)
        ],
        "top_tokens": [_names(row, vocab) for row in top_ids],
        "top_probs": _rounded(top_probs),
        "target_probs": [
            [round(float(p), 4) if s else None for p, s in zip(row[:, 0], scored, strict=True)]
            for row in target_probs
        ],
    }


def attention_across_iterations(
    protocol: DepthControlProtocol,
    evaluation: EvaluationSet,
    example: int,
    vocab: Sequence[str] | None,
) -> dict[str, object] | None:
    """The attention pattern of core layer 0 at every iteration t = 1..r (layer t on a dense
    model) for one example: ``patterns`` ``[t][head][dest][src]``. None for models without
    `HookedRecurrentTransformer` hook names."""
    model: Any = protocol.model  # HookedRecurrentTransformer names: hook_name, run_with_cache
    if not hasattr(model, "hook_name"):
        return None
    tokens, _ = _example(evaluation, example)
    iterations = list(range(1, protocol.r + 1))
    names = [model.hook_name(t, 0, "attn.hook_pattern") for t in iterations]
    _, cache = model.run_with_cache(
        tokens[None].to(_device(protocol)), names_filter=lambda name: name in names
    )
    return {
        "layer": "core layer 0" if not model.is_dense else "layer t",
        "iterations": iterations,
        "tokens": _names(tokens, vocab),
        "patterns": [_rounded(cache[name][0]) for name in names],
    }


def hop_breakdown(
    protocol: DepthControlProtocol, evaluation: EvaluationSet, n_bootstrap: int
) -> dict[str, object] | None:
    """Accuracy per hop count, for every condition at every k, and its decomposition.

    Needs ``evaluation.metadata["hops"]`` ``[n, answer]`` whose answers are the scored positions
    in order (variable binding); None otherwise. Returns ``{"k_grid", "groups": [{"hops",
    "n_answers", "full", "truncate": [per k], "shares": {S, S_lo, ..., D_hi}}]}``."""
    hops = evaluation.metadata.get("hops")
    scored = evaluation.scored
    if hops is None or hops.ndim != 2 or not bool((scored.sum(-1) == hops.shape[1]).all()):
        return None
    correct: dict[tuple[str, int], list[Tensor]] = {}
    for rows in evaluation.batches(protocol.config.batch_size):
        states, full_logits = protocol.states(evaluation.tokens[rows])
        mask = scored[rows].to(full_logits.device)
        targets = evaluation.targets[rows].to(full_logits.device)[mask]
        correct.setdefault(("full", 0), []).append(_hits(full_logits, mask, targets))
        for name in DECOMPOSED:
            for k in protocol.context.k_grid:
                try:
                    inputs = protocol.readout_inputs(states, name, k)
                except ValueError:  # a map that could not be fitted: no per-hop cell
                    return None
                logits = protocol.model.readout(inputs)
                correct.setdefault((name, k), []).append(_hits(logits, mask, targets))
    flat = {cell: torch.cat(chunks).cpu() for cell, chunks in correct.items()}
    answer_hops = hops.flatten().cpu()  # scored positions in row order = answers in row order
    groups = []
    for h in sorted(int(h) for h in answer_hops.unique()):
        pick = answer_hops == h
        values: dict[str, Tensor | dict[int, Tensor]] = {"full": flat[("full", 0)][pick]}
        for name in DECOMPOSED:
            values[name] = {k: flat[(name, k)][pick] for k in protocol.context.k_grid}
        decomposition = decompose(
            values,
            protocol.context.k_grid,
            n_iterations=protocol.r,
            metric="accuracy",
            n_bootstrap=n_bootstrap,
            seed=protocol.config.seed,
        )
        groups.append(
            {
                "hops": h,
                "n_answers": int(pick.sum()),
                "full": decomposition.full,
                "truncate": [float(v) for v in decomposition.curves["truncate"]],
                "shares": dict(decomposition.shares),
            }
        )
    return {"metric": "accuracy", "k_grid": list(protocol.context.k_grid), "groups": groups}


def write_report_data(
    entries: Sequence[Mapping[str, object]],
    path: str | Path,
    *,
    command: str | None = None,
    environment: Mapping[str, object] | None = None,
) -> Path:
    """Write ``{"command", "environment", "runs": [entry, ...]}`` (one `collect_report_data`
    entry per run) as strict JSON. Returns the path."""
    document = {
        "command": command,
        "environment": environment or {},
        "runs": list(entries),
    }
    return write_text_atomically(path, json.dumps(encode_json(document), allow_nan=False) + "\n")


def read_report_data(path: str | Path) -> dict[str, Any]:
    """A ``report_data.json`` as ``{"command", "environment", "runs": {spec: entry}}`` (empty
    runs when the file is absent)."""
    path = Path(path)
    if not path.is_file():
        return {"command": None, "environment": {}, "runs": {}}
    recovery = "Rerun the dcp-lens run command that wrote the folder to write it again."
    document = decode_json(read_json_object(path, error=DamagedFileError, recovery=recovery))
    entries = document.get("runs", [])
    if not isinstance(entries, list) or not all(
        isinstance(entry, dict) and isinstance(entry.get("model"), str) for entry in entries
    ):
        raise DamagedFileError(
            f"{path}: field runs must be a list of objects each naming its model, got "
            f"{type(entries).__name__}. {recovery}"
        )
    runs = {entry["model"]: entry for entry in entries}
    return {**document, "runs": runs}


# ----------------------------------------------------------------------------- internals


def _example(evaluation: EvaluationSet, example: int) -> tuple[Tensor, Tensor]:
    """Tokens and targets of one example, padding cut, at most `MAX_POSITIONS` positions."""
    if not 0 <= example < len(evaluation):
        raise ValueError(f"example={example} is outside 0..{len(evaluation) - 1}.")
    length = evaluation.tokens.shape[1]
    if evaluation.attention_mask is not None:
        length = int(evaluation.attention_mask[example].sum())
    length = min(length, MAX_POSITIONS)
    return evaluation.tokens[example, :length], evaluation.targets[example, :length]


def _hits(logits: Tensor, mask: Tensor, targets: Tensor) -> Tensor:
    return (logits[mask].argmax(-1) == targets).double()


def _name(token: int, vocab: Sequence[str] | None) -> str:
    return vocab[token] if vocab is not None and 0 <= token < len(vocab) else str(token)


def _names(ids: Tensor, vocab: Sequence[str] | None) -> list[str]:
    return [_name(int(token), vocab) for token in ids]


def _rounded(values: Tensor) -> JSONValue:
    return torch.round(values.float().cpu(), decimals=4).tolist()


def _device(protocol: DepthControlProtocol) -> torch.device:
    return next(protocol.model.parameters()).device


__all__ = [
    "REPORT_DATA",
    "collect_report_data",
    "read_report_data",
    "write_report_data",
]
