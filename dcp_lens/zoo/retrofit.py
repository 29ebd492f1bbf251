"""Retrofitted recurrence: turn a dense pretrained model into a depth-recurrent one.

A dense model of N blocks is split into a prelude (the first P blocks), a core (the next L blocks,
looped r times with shared weights) and a coda (the last C blocks), P + L + C = N::

    e   = Prelude(Embed(x))          dense blocks 0..P-1
    s_t = Core(Inject(s_{t-1}, e))   dense blocks P..P+L-1, t = 1..r
    out = Unembed(LnFinal(Coda(s_r))) dense blocks P+L..N-1

The injection and initial state are chosen so that at r = 1 the retrofitted model *is* the dense
one (u_1 = e): ``add`` with ``s_0 = 0``; ``concat_adapter`` with ``s_0 = 0`` and the adapter
initialised to ``[g I | I]`` (state gain g, default 1, i.e. ``add`` until it learns otherwise);
``none`` with ``s_0 = e``. At r > 1 the core sees inputs it was never trained on, so a short
distillation against the dense model's next-token distributions, on text the dense model samples
itself (`sample_corpus`), teaches the loop to use its extra iterations (`distill`).

The original and its retrofit form a negative-control pair (docs/design.md §6): the same weights and
data, one dense and one recurrent. `save_pair` writes both with a ``pair.json`` of their losses.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypedDict

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from dcp_lens.model.config import RecurrentConfig
from dcp_lens.model.hooked_recurrent_transformer import HookedRecurrentTransformer
from dcp_lens.model.loss import next_token_loss, token_cross_entropy
from dcp_lens.training.loop import decay_groups, deterministic_torch, warmup_cosine
from dcp_lens.training.regimes import readout_logits
from dcp_lens.utils.progress import progress as progress_display

ORIGINAL_DIR = "original"
RETROFIT_DIR = "retrofit"
PAIR_FILE = "pair.json"
# (injection, state_init) pairs for which u_1 = e, so that r = 1 reproduces the dense model.
EXACT_AT_ONE_ITERATION = (("add", "zeros"), ("concat_adapter", "zeros"), ("none", "embed"))


# ------------------------------------------------------------------------------ the surgery


def retrofit(
    dense: HookedRecurrentTransformer,
    prelude: int = 1,
    core: int = 3,
    coda: int = 1,
    n_iterations: int = 4,
    injection: str = "add",
    state_init: str = "zeros",
    adapter_state_gain: float = 1.0,
) -> HookedRecurrentTransformer:
    """A recurrent model built from a dense model's blocks: prelude, looped core, coda.

    Args:
        dense: a dense `HookedRecurrentTransformer` (``n_core == 0``) of prelude + core + coda
            blocks; it is not modified.
        prelude, core, coda: how many of the dense blocks, in order, form each part.
        n_iterations: the retrofitted model's default number of core iterations r.
        injection, state_init: one of `EXACT_AT_ONE_ITERATION`, so that one iteration is the
            dense model exactly.
        adapter_state_gain: g in the ``concat_adapter`` initialisation ``W = [g I | I]``
            (state first). g = 0 makes every iteration recompute Core(e): the loop is then the
            dense model at every r, a fixed point that distillation cannot leave.

    Returns:
        A recurrent model in eval mode on the dense model's device and dtype, sharing its
        tokenizer; the block weights are copies, not views of the dense model's.
    """
    if not dense.is_dense:
        raise ValueError("retrofit needs a dense model (n_core == 0); this one is recurrent.")
    n_blocks = dense.cfg.n_prelude
    counts = {"prelude": prelude, "core": core, "coda": coda}
    if core < 1 or prelude < 0 or coda < 0 or prelude + core + coda != n_blocks:
        raise ValueError(
            f"split {counts} must have core >= 1, prelude, coda >= 0 and cover the dense "
            f"model's {n_blocks} blocks exactly (prelude + core + coda = {n_blocks})."
        )
    if (injection, state_init) not in EXACT_AT_ONE_ITERATION:
        raise ValueError(
            f"injection={injection!r} with state_init={state_init!r} does not reproduce the dense "
            f"model at one iteration (u_1 != e); use one of {EXACT_AT_ONE_ITERATION}."
        )
    cfg = RecurrentConfig.from_dict(
        {
            **dense.cfg.to_dict(),
            "n_prelude": prelude,
            "n_core": core,
            "n_coda": coda,
            "n_iterations": n_iterations,
            "injection": injection,
            "state_init": state_init,
        }
    )
    source = dense.canonical_state_dict()
    part_of = [("prelude", i) for i in range(prelude)]
    part_of += [("core", i) for i in range(core)] + [("coda", i) for i in range(coda)]
    state: dict[str, Tensor] = {}
    for name, tensor in source.items():
        if name.startswith("prelude."):
            _, index, rest = name.split(".", 2)
            part, position = part_of[int(index)]
            name = f"{part}.{position}.{rest}"
        state[name] = tensor.detach().clone()
    d = cfg.d_model
    if injection == "concat_adapter":
        identity = torch.eye(d, dtype=source["embed.W_E"].dtype)
        state["inject.W_adapter"] = torch.cat((adapter_state_gain * identity, identity), dim=1)
    recurrent = HookedRecurrentTransformer(cfg, tokenizer=dense.tokenizer)
    recurrent.to(device=dense.W_E.device, dtype=dense.W_E.dtype)
    recurrent.load_canonical_state_dict(state, source="retrofit of the dense model")
    return recurrent.eval()


# ------------------------------------------------------------------------------ the data


class CorpusSettings(TypedDict):
    """How a `SampledCorpus` was drawn, as ``pair.json`` records it."""

    n_train: int
    n_held_out: int
    length: int
    seed: int
    temperature: float


class DistillationSettings(TypedDict, total=False):
    """The settings of a `distill` run (empty until one ran)."""

    steps: int
    lr: float
    n_iterations: int | list[int]
    batch_size: int
    warmup_steps: int
    min_lr_ratio: float
    weight_decay: float
    grad_clip: float
    ce_weight: float
    seed: int
    threads: int


@dataclass
class SampledCorpus:
    """Sequences sampled from a model, split into a training and a held-out part.

    Every sequence starts with BOS and holds ``length`` tokens.
    """

    train: Int[Tensor, "n_train length"]
    held_out: Int[Tensor, "n_held_out length"]
    seed: int
    temperature: float

    def settings(self) -> CorpusSettings:
        """How the corpus was drawn (for ``pair.json``)."""
        return {
            "n_train": int(self.train.shape[0]),
            "n_held_out": int(self.held_out.shape[0]),
            "length": int(self.train.shape[1]),
            "seed": self.seed,
            "temperature": self.temperature,
        }


@torch.no_grad()
def sample_corpus(
    model: HookedRecurrentTransformer,
    n_sequences: int,
    length: int,
    seed: int,
    temperature: float = 1.0,
    held_out: int | float = 0.25,
    batch_size: int = 64,
    bos_token_id: int | None = None,
) -> SampledCorpus:
    """Text the model samples itself from BOS (KV-cached), split into train and held-out.

    Args:
        model: the model to sample from (the teacher).
        n_sequences, length: how many sequences, each of ``length`` tokens including BOS.
        seed: fixes every draw and the split; the same arguments give the same corpus.
        temperature: sampling temperature (1.0: the model's own distribution).
        held_out: the held-out part, as a count or a fraction of ``n_sequences``.
        batch_size: sequences sampled at once.
        bos_token_id: the first token (default: the tokenizer's ``bos_token_id``, else 1).

    Returns:
        A `SampledCorpus`; ``held_out`` is a seeded random subset disjoint from ``train``.
    """
    if n_sequences < 2 or length < 2 or length > model.cfg.n_ctx:
        raise ValueError(
            f"n_sequences={n_sequences} must be >= 2 and length={length} in 2..n_ctx="
            f"{model.cfg.n_ctx} (a train and a held-out sequence, each with a next token)."
        )
    n_held_out = round(held_out * n_sequences) if isinstance(held_out, float) else held_out
    if not 1 <= n_held_out < n_sequences:
        raise ValueError(
            f"held_out={held_out} leaves {n_held_out} of {n_sequences} sequences held out; "
            "both parts need at least one sequence."
        )
    if bos_token_id is None:
        bos_token_id = int(getattr(model.tokenizer, "bos_token_id", 1))
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    batch_seeds = torch.randint(
        0, 2**62, (math.ceil(n_sequences / batch_size),), generator=generator
    )
    rows = []
    for start, batch_seed in zip(
        range(0, n_sequences, batch_size), batch_seeds.tolist(), strict=True
    ):
        count = min(batch_size, n_sequences - start)
        bos = torch.full((count, 1), bos_token_id, dtype=torch.long, device=model.W_E.device)
        tokens = model.generate(
            bos, length - 1, do_sample=True, temperature=temperature, seed=batch_seed
        )
        assert isinstance(tokens, Tensor)  # tokens in, tokens out
        rows.append(tokens.cpu())
    model.train(was_training)
    tokens = torch.cat(rows)
    order = torch.randperm(n_sequences, generator=generator)
    return SampledCorpus(
        train=tokens[order[n_held_out:]],
        held_out=tokens[order[:n_held_out]],
        seed=seed,
        temperature=temperature,
    )


# ------------------------------------------------------------------------------ distillation


@dataclass
class DistillationReport:
    """What a `distill` run did: per-step losses and the settings that determine it."""

    loss: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    iterations: list[int] = field(default_factory=list)
    seconds: float = 0.0
    settings: DistillationSettings = field(default_factory=DistillationSettings)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def distillation_kl(
    student_logits: Float[Tensor, "batch pos d_vocab"],
    teacher_logits: Float[Tensor, "batch pos d_vocab"],
) -> Float[Tensor, ""]:
    """KL(teacher || student) of the next-token distributions, mean over positions (nats)."""
    student = student_logits.log_softmax(-1)
    teacher = teacher_logits.log_softmax(-1)
    return F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1).mean()


def distill(
    student: HookedRecurrentTransformer,
    teacher: HookedRecurrentTransformer,
    corpus: SampledCorpus,
    steps: int = 300,
    lr: float = 3e-3,
    n_iterations: int | Sequence[int] | None = None,
    *,
    batch_size: int = 16,
    warmup_steps: int | None = None,
    min_lr_ratio: float = 0.1,
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,
    ce_weight: float = 0.0,
    seed: int = 0,
    threads: int = 1,
    progress: bool = True,
) -> DistillationReport:
    """Train ``student`` in place to match ``teacher``'s next-token distributions on
    ``corpus.train``: loss = KL(teacher || student) + ``ce_weight`` * CE(sampled tokens).

    Args:
        student: the model trained (every parameter, shared core weights once).
        teacher: the frozen reference (usually the dense original).
        corpus: text sampled from the teacher (`sample_corpus`).
        steps, lr, batch_size: AdamW steps, peak learning rate and sequences per step.
        n_iterations: the student's iterations per step: an int (fixed), a sequence of ints
            (one drawn uniformly per step), or None (the student's r).
        warmup_steps, min_lr_ratio: linear warmup (default 10% of ``steps``), then cosine
            decay to ``lr * min_lr_ratio``.
        weight_decay: AdamW decay of matrices; grad_clip: maximum global gradient norm.
        seed: batch order and iteration draws; threads: torch CPU threads while training.

    Returns:
        A `DistillationReport` (per-step loss, KL and iterations, wall time, settings).
    """
    if steps < 1 or batch_size < 1 or lr <= 0:
        raise ValueError(
            f"need steps >= 1, batch_size >= 1 and lr > 0, got {steps}, {batch_size}, {lr}."
        )
    choices = _iteration_choices(student, n_iterations)
    warmup = max(1, steps // 10) if warmup_steps is None else warmup_steps
    settings: DistillationSettings = {
        "steps": steps,
        "lr": lr,
        "n_iterations": list(choices) if len(choices) > 1 else choices[0],
        "batch_size": batch_size,
        "warmup_steps": warmup,
        "min_lr_ratio": min_lr_ratio,
        "weight_decay": weight_decay,
        "grad_clip": grad_clip,
        "ce_weight": ce_weight,
        "seed": seed,
        "threads": threads,
    }
    report = DistillationReport(settings=settings)
    named = student.canonical_state_dict()
    optimizer = torch.optim.AdamW(decay_groups(named, weight_decay), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, steps, warmup, min_lr_ratio)
    )
    generator = torch.Generator().manual_seed(seed)
    batches = _BatchStream(corpus.train, batch_size, generator)
    device = student.W_E.device
    teacher.eval()
    student.train()
    started = time.perf_counter()
    with deterministic_torch(threads, device.type):
        for _ in progress_display(range(steps), desc="distill", enabled=progress):
            tokens = batches.next().to(device)
            k = choices[int(torch.randint(len(choices), (), generator=generator))]
            with torch.no_grad():
                teacher_logits = teacher(tokens)
            logits = student(tokens, n_iterations=k)
            kl = distillation_kl(logits, teacher_logits)
            loss = kl
            if ce_weight:
                ce = next_token_loss(logits, tokens)
                loss = kl + ce_weight * ce
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"distillation loss became {float(loss)} at step {len(report.loss)}; "
                    "lower lr or raise warmup_steps."
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(named.values()), grad_clip)
            optimizer.step()
            schedule.step()
            report.loss.append(float(loss.detach()))
            report.kl.append(float(kl.detach()))
            report.iterations.append(k)
    report.seconds = time.perf_counter() - started
    student.eval()
    return report


def _iteration_choices(
    student: HookedRecurrentTransformer, n_iterations: int | Sequence[int] | None
) -> tuple[int, ...]:
    if student.is_dense:
        raise ValueError("the student must be recurrent (n_core > 0); build it with retrofit().")
    if n_iterations is None:
        return (student.n_iterations,)
    choices = (n_iterations,) if isinstance(n_iterations, int) else tuple(n_iterations)
    if not choices or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in choices):
        raise ValueError(f"n_iterations={n_iterations!r} must be an int >= 1 or a list of them.")
    return choices


class _BatchStream:
    """Batches of rows in a fresh seeded order every epoch."""

    def __init__(self, tokens: Tensor, batch_size: int, generator: torch.Generator) -> None:
        self.tokens, self.generator = tokens, generator
        self.batch_size = min(batch_size, tokens.shape[0])
        self.order = torch.randperm(tokens.shape[0], generator=generator)
        self.position = 0

    def next(self) -> Tensor:
        if self.position + self.batch_size > len(self.order):
            self.order = torch.randperm(self.tokens.shape[0], generator=self.generator)
            self.position = 0
        rows = self.order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return self.tokens[rows]


# ------------------------------------------------------------------------------ evaluation


@torch.no_grad()
def truncation_curve(
    model: HookedRecurrentTransformer,
    tokens: Int[Tensor, "n pos"],
    iterations: Sequence[int] | None = None,
    batch_size: int = 32,
) -> dict[int, float]:
    """Mean next-token cross-entropy (nats/token) of ``truncate(k)`` for each k.

    Args:
        iterations: the k to read out (default: 1..r, or 1..n_layers on a dense model); on a
            recurrent model k may exceed r (extrapolation).

    Returns:
        ``{k: loss}``; at k = r (dense: n_layers) this is the model's full-depth loss.
    """
    ks = list(iterations) if iterations is not None else list(range(1, model.n_iterations + 1))
    totals = torch.zeros(len(ks), dtype=torch.float64)
    count = 0
    for start in range(0, tokens.shape[0], batch_size):
        batch = tokens[start : start + batch_size].to(model.W_E.device)
        logits = readout_logits(model, batch, ks)
        targets = batch[:, 1:].expand(len(ks), -1, -1)
        losses = token_cross_entropy(logits[:, :, :-1], targets).flatten(1)
        totals += losses.double().sum(-1).cpu()
        count += losses.shape[1]
    return {k: float(total / count) for k, total in zip(ks, totals, strict=True)}


@torch.no_grad()
def mean_kl(
    student: HookedRecurrentTransformer,
    teacher: HookedRecurrentTransformer,
    tokens: Int[Tensor, "n pos"],
    n_iterations: int | None = None,
    batch_size: int = 32,
) -> float:
    """Mean KL(teacher || student) per position on ``tokens`` (nats), student at
    ``n_iterations`` (default: its r)."""
    total, count = 0.0, 0
    kwargs = {} if n_iterations is None else {"n_iterations": n_iterations}
    for start in range(0, tokens.shape[0], batch_size):
        batch = tokens[start : start + batch_size].to(student.W_E.device)
        kl = distillation_kl(student(batch, **kwargs), teacher(batch))
        total += float(kl) * batch.numel()
        count += batch.numel()
    return total / count


# ------------------------------------------------------------------------------ the pair


def save_pair(
    out: str | Path,
    original: HookedRecurrentTransformer,
    retrofitted: HookedRecurrentTransformer,
    summary: Mapping[str, object],
    tokenizer_file: str | Path | None = None,
) -> Path:
    """Write ``out/original`` and ``out/retrofit`` (`save_pretrained` folders), ``out/pair.json``
    (``summary``: losses, settings, seed) and a copy of the tokenizer file if given.

    Returns ``out``; each model loads with ``dcp_lens.load(str(out / "original"))`` etc."""
    folder = Path(out)
    original.save_pretrained(folder / ORIGINAL_DIR)
    retrofitted.save_pretrained(folder / RETROFIT_DIR)
    record = {"original": ORIGINAL_DIR, "retrofit": RETROFIT_DIR, **summary}
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, folder / Path(tokenizer_file).name)
        record["tokenizer"] = Path(tokenizer_file).name
    (folder / PAIR_FILE).write_text(json.dumps(record, indent=2, allow_nan=False) + "\n")
    return folder


def load_pair(
    out: str | Path,
) -> tuple[HookedRecurrentTransformer, HookedRecurrentTransformer, dict[str, object]]:
    """(original, retrofitted, pair.json contents) from a `save_pair` folder; a llama2.c
    tokenizer saved with the pair is attached to both models."""
    from dcp_lens.zoo.loaders.tokenizer import Llama2cTokenizer

    folder = Path(out)
    if not (folder / PAIR_FILE).is_file():
        raise FileNotFoundError(f"{folder / PAIR_FILE} does not exist; write it with save_pair.")
    record = json.loads((folder / PAIR_FILE).read_text())
    original = HookedRecurrentTransformer.from_pretrained(folder / record["original"])
    retrofitted = HookedRecurrentTransformer.from_pretrained(folder / record["retrofit"])
    if "tokenizer" in record:
        tokenizer = Llama2cTokenizer.from_file(
            folder / record["tokenizer"], vocab_size=original.cfg.d_vocab
        )
        original.tokenizer = retrofitted.tokenizer = tokenizer
    return original, retrofitted, record


__all__ = [
    "EXACT_AT_ONE_ITERATION",
    "DistillationReport",
    "SampledCorpus",
    "distill",
    "distillation_kl",
    "load_pair",
    "mean_kl",
    "retrofit",
    "sample_corpus",
    "save_pair",
    "truncation_curve",
]
