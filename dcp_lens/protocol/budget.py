"""A run's memory, known before it starts: the budget it may use and what each stage holds.

Peak memory of a DCP run is the weights, plus what one batch holds (its states s_0..s_r and full
depth's logits), plus the readouts being scored (in chunks of rows sized from the budget), plus
the fit's moments or the sweep's maps. None of it grows with the number of batches or the size
of the evaluation set. `estimate_run_memory` adds these terms up from the model's shape and the
protocol's settings; the protocol checks the estimate against the budget before it reads a
batch, and `dcp-lens run --dry-run` prints it.

The budget (`ProtocolConfig.memory_budget`, GiB) defaults to `DEFAULT_BUDGET_SHARE` of what the
device can give now: on a GPU, the driver's free memory plus what PyTorch holds cached and
would reuse; on the CPU, the memory the system reports available.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from dcp_lens.protocol.conditions import position_bucket
from dcp_lens.protocol.gate import READOUT_ELEMENTS
from dcp_lens.utils.errors import ResourceLimitError
from dcp_lens.utils.memory import available_memory_bytes, fixed_threshold, release_keep

GIB = 2**30
Chunks = TypeVar("Chunks")
Result = TypeVar("Result")
# Share of what the device can give that a run plans to use when no budget is set.
DEFAULT_BUDGET_SHARE = 0.85
# [rows, d_vocab] float32 tensors one scored readout holds at its peak besides its own logits:
# the tempered logits, their log-softmax, the top-1 pass's signs and the KL's difference and
# product (`dcp_lens.protocol.metrics.Readout`).
SCORING_COPIES = 5
# [rows, d_vocab] float32 tensors of full depth's side per chunk: log-probabilities, probabilities.
REFERENCE_COPIES = 2
# The most positions one CPU readout call takes: past this a larger call makes no matrix product
# faster on a CPU, only its temporaries larger.
CPU_READOUT_ROWS = 2048
# Fewest rows a readout call is planned with on an accelerator (a smaller call underuses it),
# and the most (past it a larger call is no faster, only its logits larger).
MIN_ACCELERATOR_ROWS = 256
MAX_ACCELERATOR_ROWS = 4096
# A calibration group's states are folded into its moments once this many have come: fewer
# for wide states (about 1 MB of float32 rows a buffer), at least 64 (an update's own d x d work
# is then small beside its product).
GROUP_BUFFER_ROWS = 4096
# The paired translators are fitted on at most this many leading calibration positions.
TRANSLATOR_POINTS = 2048
GROUP_BUFFER_ELEMENTS = 2**18


def group_buffer_rows(width: int) -> int:
    """Rows of ``width`` a calibration group's buffer holds before they are folded in."""
    return max(64, min(GROUP_BUFFER_ROWS, GROUP_BUFFER_ELEMENTS // max(1, width)))


def moment_bytes(
    n_streams: int,
    n_groups: int,
    width: int,
    resident: int,
    batch_positions: int,
    full: bool = True,
    element_bytes: int = 4,
    totals: bool = True,
) -> int:
    """Bytes the fit stage's moments hold on the device: per stream, each of the ``resident``
    groups' scatter and vectors at the dtype it is stored in (float32 where the jackknife's
    ``n_groups`` >= 2 split the moments, float64 for one group) and its waiting rows at the
    states' ``element_bytes`` (a group folds its buffer in once it holds `group_buffer_rows`,
    so fewer than that wait between batches); with ``totals``, the whole split's float64
    moments the groups merge into after the pass. One update's transient (a batch's rows of one
    group in float64, centred) comes on top: `moment_update_bytes`. ``full``: d x d scatters
    (else d-vectors). The one model of the moments: the check before the pass and
    `estimate_run_memory` both use it (``batch_positions`` is kept for the check's callers)."""
    del batch_positions  # the waiting rows are bounded by the buffer, whatever the batch
    square = width * width if full else width
    stored = 4 if n_groups >= 2 else 8
    waiting = group_buffer_rows(width)
    group = stored * (square + 3 * width) + element_bytes * waiting * width
    whole = 8 * (square + 3 * width) if totals else 0
    return n_streams * (max(1, resident) * group + whole)


def moment_update_bytes(batch_positions: int, width: int, element_bytes: int) -> int:
    """One moments update's transient: a group's rows of a batch (at most the batch's, plus
    the buffer) joined, in float64 and centred."""
    rows = batch_positions + group_buffer_rows(width)
    return rows * width * (element_bytes + 16)


def base_rate_bytes(seq_len: int, d_vocab: int) -> int:
    """The base rate's float64 table of summed distributions, one row per position bucket
    (`dcp_lens.protocol.conditions.position_bucket`)."""
    buckets = int(position_bucket(torch.arange(max(1, seq_len))).max()) + 1
    return buckets * d_vocab * 8


def pinned_bytes(size: int) -> int:
    """Bytes PyTorch's pinned host allocator takes for a ``size``-byte tensor: the next power
    of two."""
    return 1 << max(0, size - 1).bit_length() if size > 0 else 0


def free_device_bytes(device: torch.device) -> int | None:
    """What ``device`` can give a run now, in bytes: on CUDA, the driver's free memory plus the
    memory PyTorch has reserved but not allocated (its cache, reused before asking the driver);
    on the CPU, the available memory; None where unknown."""
    if device.type == "cuda":
        free = int(torch.cuda.mem_get_info(device)[0])
        cached = int(torch.cuda.memory_reserved(device)) - int(torch.cuda.memory_allocated(device))
        return free + max(0, cached)
    if device.type == "cpu":
        return available_memory_bytes()
    return None


def budget_bytes(memory_budget: float | None, device: torch.device) -> int | None:
    """The run's budget in bytes: ``memory_budget`` GiB when set, else `DEFAULT_BUDGET_SHARE` of
    `free_device_bytes` (None where the device does not say)."""
    if memory_budget is not None:
        return int(memory_budget * GIB)
    available = free_device_bytes(device)
    return None if available is None else int(DEFAULT_BUDGET_SHARE * available)


@dataclass(frozen=True)
class ReadoutPlan:
    """How one batch's readouts are cut: ``rows`` positions at most per readout call (chunks of
    whole examples, several conditions per call where a chunk is the whole batch and they fit).

    Attributes:
        rows: most positions one readout call scores.
        examples: examples per chunk of the batch (at least one).
        conditions: conditions read in one call when a chunk is the whole batch.
    """

    rows: int
    examples: int
    conditions: int

    @classmethod
    def of(cls, rows: int, batch: int, positions: int) -> ReadoutPlan:
        rows = max(1, int(rows))
        examples = max(1, min(batch, rows // max(1, positions)))
        per_call = examples * max(1, positions)
        conditions = max(1, rows // per_call) if examples == batch else 1
        return cls(rows, examples, conditions)

    def halved(self, batch: int, positions: int) -> ReadoutPlan | None:
        """The plan with half the rows (None where a call already holds one example)."""
        if self.examples <= 1 and self.conditions <= 1:
            return None
        return ReadoutPlan.of(max(1, self.rows // 2), batch, positions)

    def example_chunks(self, batch: int) -> Iterator[slice]:
        for start in range(0, batch, self.examples):
            yield slice(start, min(batch, start + self.examples))

    def condition_groups(
        self, n: int, examples: int, positions: int, rows: int | None = None
    ) -> list[slice]:
        """``n`` readouts of ``examples`` examples cut into calls of at most ``rows`` positions
        (default: the plan's)."""
        rows = self.rows if rows is None else rows
        group = max(1, rows // max(1, examples * positions))
        return [slice(start, start + group) for start in range(0, n, group)]


@dataclass
class MemoryEstimate:
    """The terms of a run's peak memory, in bytes, by stage.

    Attributes:
        terms: every term by name (``weights``, ``batch_states``, ``full_logits``, ``readouts``,
            ``reference``, ``moments``, ``maps``, ...).
        stages: per stage, the names of the terms it holds at once.
        plan: the readout plan the estimate assumes.
        host: what waits in host memory off the device, by name (``parked_groups``: the
            calibration groups not being filled, `dcp_lens.protocol.fit_records.moments_host`).
        snapshot: bytes of one calibration snapshot on disk (`calibration_snapshot_bytes`).
    """

    terms: dict[str, int]
    stages: dict[str, tuple[str, ...]]
    plan: ReadoutPlan
    notes: list[str] = field(default_factory=list)
    host: dict[str, int] = field(default_factory=dict)
    snapshot: int = 0

    @property
    def host_bytes(self) -> int:
        """Host memory the run holds beside the device's (0 where the host is the device)."""
        return sum(self.host.values())

    def stage_bytes(self, stage: str) -> int:
        return sum(self.terms[name] for name in self.stages[stage])

    @property
    def peak_bytes(self) -> int:
        """The largest stage's total."""
        return max(self.stage_bytes(stage) for stage in self.stages)

    @property
    def peak_stage(self) -> str:
        return max(self.stages, key=self.stage_bytes)

    def table(self) -> str:
        """The terms and the stages' totals as aligned text, GiB with two decimals."""
        lines = [f"  {name:<22} {value / GIB:8.2f} GiB" for name, value in self.terms.items()]
        lines.append("  stage totals:")
        for stage in self.stages:
            lines.append(f"    {stage:<20} {self.stage_bytes(stage) / GIB:8.2f} GiB")
        lines.append(f"  peak ({self.peak_stage}): {self.peak_bytes / GIB:.2f} GiB")
        parts = ", ".join(f"{name} {value / GIB:.2f} GiB" for name, value in self.host.items())
        lines.append(
            f"  host memory beside it: {self.host_bytes / GIB:.2f} GiB ({parts or 'none'})"
        )
        lines.append(f"  calibration snapshot (--resume, on disk): {self.snapshot / GIB:.2f} GiB")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, float | str | dict[str, float] | list[str]]:
        return {
            "terms_gib": {name: value / GIB for name, value in self.terms.items()},
            "stages_gib": {stage: self.stage_bytes(stage) / GIB for stage in self.stages},
            "peak_gib": self.peak_bytes / GIB,
            "peak_stage": self.peak_stage,
            "readout_rows": self.plan.rows,
            "host_gib": {name: value / GIB for name, value in self.host.items()},
            "host_total_gib": self.host_bytes / GIB,
            "calibration_snapshot_gib": self.snapshot / GIB,
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class ModelShape:
    """What the estimate reads of a model: its width, vocabulary, depth, blocks and precision."""

    d_model: int
    d_vocab: int
    d_mlp: int
    n_iterations: int
    n_parameters: int
    element_bytes: int
    n_heads: int = 1

    @classmethod
    def of(cls, model: Any) -> ModelShape:
        cfg = model.cfg
        parameters = list(model.parameters())
        element = parameters[0].element_size() if parameters else 4
        # Tied copies share storage: count each tensor once.
        seen: dict[int, int] = {}
        for parameter in parameters:
            seen.setdefault(id(parameter), parameter.numel())
        return cls(
            d_model=int(cfg.d_model),
            d_vocab=int(cfg.d_vocab),
            d_mlp=int(getattr(cfg, "d_mlp", 4 * cfg.d_model) or 4 * cfg.d_model),
            n_iterations=int(model.n_iterations),
            n_parameters=sum(seen.values()),
            element_bytes=int(element),
            n_heads=int(getattr(cfg, "n_heads", 1) or 1),
        )


def estimate_run_memory(
    shape: ModelShape,
    *,
    batch_size: int,
    seq_len: int,
    n_streams: int,
    calibration_groups: int,
    calibration_mode: str = "full",
    readout_rows: int | None = None,
    budget: int | None = None,
    conditions_per_k: int = 8,
    matched_per_k: int = 5,
    device_type: str = "cuda",
    probe_points: int = 0,
    probe: bool = False,
) -> MemoryEstimate:
    """The peak memory of a DCP run on a model of ``shape``, by term and stage (bytes).

    Args:
        shape: the model (`ModelShape.of(model)`; a model on the meta device will do).
        batch_size, seq_len: sequences per forward and their length.
        n_streams: the conditions a map is fitted from (`RunContext.n_streams`: full depth,
            truncate(k) and replay(k) below r).
        calibration_groups: the jackknife's groups (0: off).
        calibration_mode: ``"full"`` holds d x d moments and maps, the others d-vectors.
        readout_rows: positions per readout call (None: planned from ``budget``, at most
            `MAX_ACCELERATOR_ROWS`).
        budget: bytes the run may use (for the readout plan when ``readout_rows`` is None).
        conditions_per_k: readouts of one k held at once (the sweep's conditions).
        matched_per_k: conditions of one k given a temperature by confidence matching.
        device_type: on ``"cpu"`` the free heap the allocator keeps between batches counts too
            (`dcp_lens.utils.memory.release_keep`).
        probe_points: states per subsample of the probe (`ProtocolConfig.probe_points`): the
            probe's reference is kept from the calibration pass on.
        probe: whether the probe runs (its samples are then kept through the evaluation, and
            the probe stage fits on them).
    """
    d, vocab, es = shape.d_model, shape.d_vocab, shape.element_bytes
    positions = batch_size * seq_len
    groups = calibration_groups if calibration_groups >= 2 else 0
    on_device = groups if device_type == "cpu" else min(groups, 1)
    full = calibration_mode == "full"
    square = d * d if full else d
    n_inverses, n_translators = (n_streams - 1) // 2, n_streams - 1
    n_k = (n_streams - 1) // 2 + 1
    # The translators' positions: whole leading calibration sequences, at most
    # `TRANSLATOR_POINTS` positions (one sequence where a sequence is longer).
    fitted_positions = max(seq_len, TRANSLATOR_POINTS // max(1, seq_len) * seq_len)
    # Confidence matching's positions (a few hundred, fewer for wide vocabularies:
    # `dcp_lens.protocol.confidence.ConfidenceMatching.budget`).
    matched_positions = max(64, min(256, (1 << 18) // max(1, vocab)))
    terms = {
        "weights": shape.n_parameters * es,
        "batch_states": (shape.n_iterations + 1) * positions * d * es,
        # One block's transient activations (the MLP's hidden pair, q, k, v and a few streams).
        "forward_activations": positions * (3 * shape.d_mlp + 8 * d) * es,
        "full_logits": positions * vocab * es,
        # Per stream: a float32 scatter per group on the device (one, on an accelerator: the
        # others wait on the host, `dcp_lens.protocol.fit_records.moments_host`) with its
        # waiting rows; one update's float64 rows on top.
        "moments": moment_bytes(n_streams, groups, d, on_device, positions, full, es, False),
        # Every stream's waiting rows: fewer than a buffer per resident group between them,
        # and one batch's on top in the stream being folded.
        "moment_buffers": (n_streams * max(1, on_device) * group_buffer_rows(d) + positions)
        * d
        * es,
        "moment_update": moment_update_bytes(positions, d, es),
        # The whole split's float64 moments per stream, merged from the groups after the pass,
        # and the calibration null's two halves (even and odd examples) held through it.
        "moment_totals": n_streams * 8 * (square + 3 * d),
        "null_halves": 2 * 8 * (square + 3 * d),
        # The jackknife's refits: full depth's left-out moments per group with their
        # eigendecomposition and two powers kept (every stream's refit of the group reads them),
        # and one refit's own moments, decomposition and map being formed.
        "jackknife_refits": (groups * 5 + 4) * square * 8 if groups else 0,
        # The base rate's table, and one batch's part of it with full depth's logits of one
        # chunk, their probabilities and the per-position sums (float32, then float64).
        "base_rate_sums": base_rate_bytes(seq_len, vocab),
        # The whole split's maps in float64 with their float32 copies (the shift's inverses and
        # the calibration null included), the translators' float32 weights with the copy each
        # keeps to read with, and the base rate's table.
        "maps": (n_streams + n_inverses + 1) * square * 12
        + n_translators * d * d * 8
        + base_rate_bytes(seq_len, vocab),
        # Each refit held as a float16 difference (`dcp_lens.protocol.jackknife`): the maps'
        # and the translators' (fitted first, so held through the maps' refits).
        "jackknife_maps": groups * (n_streams + n_inverses) * square * 2,
        "jackknife_translators": groups * n_translators * d * d * 2,
        # What the pass keeps for later stages: the translators' leading positions (every
        # state s_0..s_r) and confidence matching's (their states and full depth's logits).
        "translator_states": (shape.n_iterations + 1) * fitted_positions * d * es,
        "confidence_stash": matched_positions * ((shape.n_iterations + 1) * d + vocab) * es,
    }
    # The waiting rows are folded in as the pass ends: only the scatters stay.
    terms["moments"] -= terms["moment_buffers"] - positions * d * es
    # The refits go one stream at a time, each stream's group moments released once its refits
    # are held: moments and refits never peak together.
    pass_moments = terms["moments"] + terms["moment_totals"]
    held = max(pass_moments, terms["jackknife_maps"])
    terms["jackknife_fits_held"] = (
        held
        + (pass_moments + terms["jackknife_maps"]) // n_streams
        + terms["jackknife_translators"]
    )
    terms["translator_fit"] = translator_fit_bytes(
        d, vocab, es, fitted_positions, groups, n_translators
    )
    if readout_rows is None:
        fixed = sum(
            terms[name]
            for name in (
                "weights",
                "batch_states",
                "full_logits",
                "maps",
                "jackknife_maps",
                "jackknife_translators",
            )
        )
        per_row = vocab * (conditions_per_k * es + 4 * (SCORING_COPIES + REFERENCE_COPIES))
        room = (budget - fixed) if budget is not None else 0
        cap = CPU_READOUT_ROWS if device_type == "cpu" else MAX_ACCELERATOR_ROWS
        readout_rows = min(cap, room // per_row) if budget is not None else cap
        readout_rows = max(1, readout_rows)
    plan = ReadoutPlan.of(max(1, readout_rows), batch_size, seq_len)
    chunk_rows = plan.examples * seq_len  # one condition's rows in a chunk
    terms["base_rate_reads"] = (
        chunk_rows * vocab * (es + 4)
        + chunk_rows * (3 * shape.d_mlp + 8 * d) * es
        + seq_len * vocab * 12
        + 2 * terms["base_rate_sums"]
    )
    # A k's readouts of a chunk are held together; the jackknife's calls fill the plan's rows
    # (every left-out group's conditions of the chunk's chosen examples at once). One readout
    # is being scored.
    held_rows = max(conditions_per_k * chunk_rows, plan.rows if groups else 0)
    terms["readouts"] = vocab * (held_rows * es + SCORING_COPIES * chunk_rows * 4)
    # A readout call's own work: its inputs (each condition's mapped state, then joined) and
    # the coda's activations over the call's rows.
    call_rows = min(held_rows, plan.rows)
    per_row = 2 * d + 3 * shape.d_mlp + 8 * d
    terms["readout_work"] = call_rows * per_row * es
    terms["reference"] = REFERENCE_COPIES * chunk_rows * vocab * 4
    # The jackknife's chosen examples of a chunk: their logits and full depth's side again.
    terms["jackknife_chunk"] = chunk_rows * vocab * (es + 4 * REFERENCE_COPIES) if groups else 0
    # Confidence matching keeps every matched cell's logits over its positions.
    terms["confidence_kept"] = matched_per_k * n_k * matched_positions * vocab * 4
    terms["confidence_reads"] = matched_per_k * matched_positions * vocab * (es + 4)
    # On the CPU, glibc keeps up to this much freed heap between batches (it is reused, but it
    # is resident); an accelerator's caching allocator reuses within the budget.
    kept = 0 if fixed_threshold() else release_keep()  # a fixed threshold maps every tensor
    terms["allocator_kept"] = kept if device_type == "cpu" else 0
    # The probe's reference (full depth's states, with their keys) is kept from the calibration
    # pass on; with the probe on, the evaluation keeps its held-out reference, every s_t and
    # calibrate(truncate(k)) at every k, and a batch's new rows beside them while they are
    # merged in (`dcp_lens.protocol.subsample.Subsample.add_selected`); the probe stage fits on
    # float64 copies with a d x d covariance, its square root and the whitened samples.
    row = d * es + 8
    n_subsamples = 1 + (shape.n_iterations + 1) + n_k
    terms["probe_reference"] = probe_points * row
    terms["probe_samples"] = (
        n_subsamples * probe_points * row + 2 * probe_points * d * es if probe else 0
    )
    # The probe's fit: the reference's covariance, its shrinkage's temporaries, the
    # eigendecomposition and whitening power (d x d, float64), the whitened samples.
    terms["probe_fit"] = 4 * probe_points * d * 8 + 8 * d * d * 8 if probe else 0
    kept_by_the_pass = ("translator_states", "confidence_stash", "probe_reference")
    stages = {
        "calibration": (
            "weights",
            "batch_states",
            "forward_activations",
            "moments",
            "moment_buffers",
            "moment_update",
            "null_halves",
            "base_rate_sums",
            "base_rate_reads",
            *kept_by_the_pass,
            "allocator_kept",
        ),
        # The translators are fitted first, on every moment of the pass (the whole split's
        # merged beside the groups') and their leading positions joined.
        "translator fits": (
            "weights",
            "moments",
            "moment_totals",
            "null_halves",
            "base_rate_sums",
            *kept_by_the_pass,
            "translator_states",
            "translator_fit",
        ),
        "jackknife fits": (
            "weights",
            "jackknife_fits_held",
            "jackknife_refits",
            "null_halves",
            "base_rate_sums",
            "maps",
            *kept_by_the_pass,
        ),
        "confidence matching": (
            "weights",
            "batch_states",
            "forward_activations",
            "confidence_stash",
            "confidence_reads",
            "confidence_kept",
            "maps",
            "jackknife_maps",
            "jackknife_translators",
            "probe_reference",
            "allocator_kept",
        ),
        "evaluation": (
            "weights",
            "batch_states",
            "forward_activations",
            "full_logits",
            "readouts",
            "readout_work",
            "reference",
            "jackknife_chunk",
            "maps",
            "jackknife_maps",
            "jackknife_translators",
            "probe_reference",
            "probe_samples",
            "allocator_kept",
        ),
    }
    if probe:
        stages["probe"] = (
            "weights",
            "maps",
            "jackknife_maps",
            "jackknife_translators",
            "probe_reference",
            "probe_samples",
            "probe_fit",
        )
    # On an accelerator the groups not being filled wait on the host in their float32 storage,
    # in pinned memory (`dcp_lens.utils.devices.copy_without_wait`), whose allocator hands out
    # blocks rounded up to a power of two.
    parked = groups - on_device if device_type != "cpu" else 0
    group = pinned_bytes(4 * square) + 3 * pinned_bytes(4 * d)
    host = {"parked_groups": n_streams * parked * group} if parked > 0 else {}
    estimate = MemoryEstimate(terms, stages, plan, host=host)
    estimate.snapshot = calibration_snapshot_bytes(
        n_streams, calibration_groups, d, full, seq_len, vocab, probe_points * row
    )
    if full and groups:
        estimate.notes.append(
            f"the jackknife ({calibration_groups} groups) holds moments per group and a refit of "
            "every map: --calibration-groups 0 leaves both out"
        )
    return estimate


def translator_fit_bytes(
    width: int,
    d_vocab: int,
    element_bytes: int,
    positions: int,
    groups: int,
    n_translators: int,
) -> int:
    """The translators' fit at its peak (`dcp_lens.protocol.fit.fit_translators`): the larger
    of the gate's readout geometry (a block of unit directions read out twice, a central
    difference, in float64: `dcp_lens.protocol.gate.ReadoutGeometry`), its ridge path (float64
    copies of the ``positions`` states, their rotation and the d x d eigendecomposition) and the
    per-group normal equations of the jackknife's refits; beside it, the translators fitted so
    far with their refits (float32, the refits as float16 differences)."""
    block = min(width, max(1, READOUT_ELEMENTS // max(1, d_vocab)))
    # Two readouts of the block, in float64, and their difference.
    geometry = block * d_vocab * (2 * element_bytes + 24) + 2 * width * min(width, d_vocab) * 8
    read = min(width, d_vocab)
    path = 8 * (3 * positions * width + 2 * positions * read + 3 * width * width)
    side = width + 1
    solves = 8 * ((2 * groups + 4) * side * side + 2 * positions * side)
    held = n_translators * width * width * (8 + 2 * groups)
    # The geometry is formed once, before any translator is fitted.
    return max(geometry, max(path, solves) + held)


def calibration_snapshot_bytes(
    n_streams: int,
    calibration_groups: int,
    width: int,
    full: bool,
    seq_len: int,
    d_vocab: int,
    probe_reference: int,
) -> int:
    """Bytes of a calibration snapshot on disk (`dcp_lens.protocol.fit_records.CalibrationState`):
    every stream's moments per group (float32 with groups, float64 alone: count, mean, scatter
    and the shrinkage's two sums), the null's two float64 halves, the base rate's float64 sums
    per position bucket and the probe's reference (``probe_reference`` bytes). What a resumed
    pass needs, and nothing it could recompute."""
    square = width * width if full else width
    groups = max(1, calibration_groups)
    stored = 4 if groups >= 2 else 8
    moments = n_streams * groups * stored * (square + 3 * width)
    halves = 2 * 8 * (square + 3 * width)
    return moments + halves + base_rate_bytes(seq_len, d_vocab) + probe_reference


def estimate_with(
    shape: ModelShape,
    settings: Any,
    n_streams: int,
    *,
    batch_size: int,
    seq_len: int,
    budget: int | None,
    device_type: str,
    readout_rows: int | None = None,
) -> MemoryEstimate:
    """`estimate_run_memory` with the settings of a run (``settings``: a `ProtocolConfig`, its
    calibration groups and mode, probe and probe points): the one estimate the check before a
    run, ``--dry-run``, ``bench --estimate``, the batch chosen from the budget and the readout
    chunks are read from."""
    return estimate_run_memory(
        shape,
        batch_size=batch_size,
        seq_len=seq_len,
        n_streams=n_streams,
        calibration_groups=settings.calibration_groups,
        calibration_mode=settings.calibration_mode,
        readout_rows=readout_rows,
        budget=budget,
        device_type=device_type,
        probe_points=int(settings.probe_points),
        probe=settings.probe != "none",
    )


def largest_fitting_batch(fits: Callable[[int], bool], batch_size: int) -> int:
    """The largest batch in 1..``batch_size`` for which ``fits(batch)`` is True (0: none)."""
    low, high = 0, batch_size
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def check_estimate(estimate: MemoryEstimate, budget: int | None, where: str, advice: str) -> None:
    """Refuse, before any batch is read, a run whose estimated peak exceeds ``budget``."""
    if budget is None or estimate.peak_bytes <= budget:
        return
    raise ResourceLimitError(
        f"this run's estimated peak memory is {estimate.peak_bytes / GIB:.2f} GiB "
        f"({estimate.peak_stage} stage), over its budget of {budget / GIB:.2f} GiB on {where}. "
        f"{advice} Terms:\n{estimate.table()}"
    )


class OutOfMemoryStop(ResourceLimitError):
    """The device ran out of memory in a batch even with one example's readouts per call: the
    run stopped after its last finished batch (``--resume`` continues from there)."""


def release_device_memory(device: torch.device) -> None:
    """Return what a failed batch left cached on ``device`` to the allocator's pool."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def in_smaller_chunks(
    attempt: Callable[[Chunks], Result],
    chunks: Chunks,
    smaller: Callable[[Chunks], Chunks | None],
    device: torch.device,
    stop: Callable[[Chunks], str],
) -> tuple[Result, Chunks]:
    """``attempt(chunks)``, redone with ``smaller(chunks)`` each time the device runs out of
    memory, until it fits: the result and the chunks that fitted (for the next call).

    The one out-of-memory retry of every stage. ``attempt`` must change nothing outside itself
    before it returns, so that a failed attempt can be redone. After a failure the failed
    attempt's tensors, which its traceback's frames still reference, are dropped before the
    device's cache is emptied (else the cache keeps them). Where ``smaller`` gives None (the
    smallest chunks failed too), raises `OutOfMemoryStop` with ``stop(chunks)``, the message
    that says what to change.
    """
    while True:
        try:
            return attempt(chunks), chunks
        except torch.OutOfMemoryError as error:
            # The frames below this one hold the failed chunk's tensors: clear their locals.
            traceback.clear_frames(error.__traceback__)
            failure = error
        release_device_memory(device)
        fewer = smaller(chunks)
        if fewer is None:
            raise OutOfMemoryStop(stop(chunks)) from failure
        chunks = fewer


def retried_once(tried: bool) -> bool | None:
    """`in_smaller_chunks`' ``smaller`` for work that cannot be cut (one matrix's
    decomposition): the same work once more on the emptied cache, then the stop."""
    return None if tried else True


def stage_stop_message(stage: str, where: str, tried: str, resume: str, change: str) -> str:
    """What to do after ``stage`` ran out of memory on ``where`` at its smallest chunks
    (``tried``): how ``--resume`` continues (``resume``) and the settings to change."""
    return (
        f"the device ({where}) ran out of memory in the {stage} stage, even {tried}. {resume} "
        f"Free memory on the device and continue with --resume, or start again with {change}; "
        "`dcp-lens run --dry-run` prints what each setting needs."
    )


def out_of_memory_message(
    stage: str, rows: slice, batch_size: int, positions: int, budget: int | None, where: str
) -> str:
    """What to change after a batch ran out of memory at the smallest readout plan."""
    fits = max(1, batch_size // 2)
    budget_text = "no set budget" if budget is None else f"a budget of {budget / GIB:.2f} GiB"
    return (
        f"the device ({where}) ran out of memory in the {stage} batch of sequences "
        f"{rows.start}-{rows.stop - 1} (batch size {batch_size} x {positions} tokens, "
        f"{budget_text}), even reading one example's readouts per call: the batch's own "
        "forward and states do not fit beside what the run holds. Every finished batch is "
        "kept: free memory on the device and continue with --resume, or start again with "
        f"--batch-size {fits} (the batch size is fixed for a run) or --calibration-groups 0 "
        "(no jackknife maps); `dcp-lens run --dry-run` prints what each setting needs."
    )
