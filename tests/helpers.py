"""Helpers shared by the test modules (no test module imports another)."""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_lens import (
    DepthControlProtocol,
    EvaluationSet,
    HookedRecurrentTransformer,
    RecurrentConfig,
)
from dcp_lens.protocol.calibration import CALIBRATION_MAPS
from dcp_lens.protocol.conditions import SWEEP
from dcp_lens.protocol.metrics import (
    IGNORE_INDEX,
    METRICS,
    per_example_metrics,
    reference_log_probs,
)


def make_model(dtype: torch.dtype = torch.float64, **overrides) -> HookedRecurrentTransformer:
    fields = dict(
        d_model=32,
        n_heads=4,
        d_head=8,
        d_mlp=64,
        d_vocab=40,
        n_ctx=24,
        n_prelude=1,
        n_core=2,
        n_coda=1,
        n_iterations=4,
        init_std=0.2,
        seed=3,
    )
    fields.update(overrides)
    model = HookedRecurrentTransformer(RecurrentConfig(**fields)).eval()
    # Non-trivial norm weights so a norm applied in the wrong place shows.
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))
    return model.to(dtype)


def tokens_for(model: HookedRecurrentTransformer, batch: int = 2, pos: int = 12) -> torch.Tensor:
    return torch.randint(
        0, model.cfg.d_vocab, (batch, pos), generator=torch.Generator().manual_seed(0)
    )


def lm_sets(
    model: HookedRecurrentTransformer, n: int = 48, pos: int = 10, seed: int = 0
) -> tuple[EvaluationSet, EvaluationSet]:
    """Disjoint evaluation and calibration sets of random token sequences (language modelling)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.cfg.d_vocab, (2 * n, pos), generator=generator)
    return EvaluationSet.from_tokens(tokens[:n]), EvaluationSet.from_tokens(tokens[n:])


def assert_fast_path_matches_hooks(
    protocol: DepthControlProtocol, tokens: torch.Tensor, tol: float = 1e-6
) -> list[str]:
    """Every registered sweep condition (and full) at every k of the protocol's grid: the closed
    form over cached states equals the hook form on a forward pass, within ``tol``; and every
    registered metric scores the two the same, within ``tol``.

    Returns the names checked (conditions, then metrics), so a caller can see that a newly
    registered condition or metric was."""
    names = ["full", *SWEEP]
    metrics = list(METRICS)
    targets = torch.full_like(tokens, IGNORE_INDEX)
    targets[:, :-1] = tokens[:, 1:]
    for k in protocol.context.k_grid:
        full = protocol.condition_logits(tokens, "full", protocol.r)
        reference = reference_log_probs(full)
        for name in names:
            fast = protocol.condition_logits(tokens, name, k)
            hooked = protocol.condition_logits(tokens, name, k, via="hooks")
            assert (fast - hooked).abs().max() <= tol, (name, k)
            scores = [per_example_metrics(x, reference, targets, metrics) for x in (fast, hooked)]
            for metric in metrics:
                difference = (scores[0][metric] - scores[1][metric]).abs().max()
                assert not difference > tol, (name, k, metric)  # NaN on both sides passes
    return names + metrics


def assert_every_map_matches_hooks(
    model: HookedRecurrentTransformer,
    calibration: EvaluationSet,
    tokens: torch.Tensor,
    tol: float = 1e-6,
    **settings: Any,
) -> list[str]:
    """`assert_fast_path_matches_hooks` once per registered calibration map (each fitted on
    ``calibration``, with ``settings`` of `ProtocolConfig`). Returns the maps checked, then the
    conditions and metrics."""
    checked: list[str] = []
    for mode in CALIBRATION_MAPS:
        protocol = DepthControlProtocol(
            model, calibration_mode=mode, probe="none", progress=False, **settings
        )
        protocol.fit(calibration)
        names = assert_fast_path_matches_hooks(protocol, tokens, tol)
        checked.append(mode)
    return checked + names


DATA_DIR = Path(__file__).resolve().parents[1] / "demos" / "data"


def data_path(*parts: str) -> Path:
    """A file or folder of the repository's ``demos/data`` (the data and fixtures the tests read).

    Raises FileNotFoundError naming the path when the checkout lacks it.
    """
    path = DATA_DIR.joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: the tests read the data and fixtures committed under demos/data"
            " (see dcp_lens/data/README.md); restore them with"
            " `git checkout -- demos/data dcp_lens/data`"
        )
    return path


# ------------------------------------- fuzz and property helpers (test_fuzz, test_hostile_inputs)

# Inputs tried by the fuzz and property tests, and what became of them (printed at the end).
FUZZ_TALLY: Counter[str] = Counter()


def outcome(action: Callable[[], Any], name: str) -> str:
    """Run ``action``; "works" or "clean error" (a `DCPLensError`, with a message), counted under
    ``name``. Any other exception propagates: it is what the property tests exist to find."""
    from dcp_lens.utils.errors import DCPLensError

    FUZZ_TALLY[f"{name}: tried"] += 1
    try:
        action()
    except DCPLensError as error:
        assert str(error).strip(), f"{type(error).__name__} without a message"
        FUZZ_TALLY[f"{name}: clean error"] += 1
        return "clean error"
    FUZZ_TALLY[f"{name}: works"] += 1
    return "works"


def tiny_config(**fields: Any) -> RecurrentConfig:
    """A 1 + 1 x 2 + 1 model small enough to build in milliseconds."""
    from dcp_lens.model.config import RecurrentConfig

    base: dict[str, Any] = dict(
        d_model=16,
        n_heads=2,
        d_head=8,
        d_mlp=32,
        d_vocab=20,
        n_ctx=16,
        n_prelude=1,
        n_core=1,
        n_coda=1,
        n_iterations=2,
        seed=0,
    )
    return RecurrentConfig(**{**base, **fields})


def save_tiny_model(folder: Path, **fields: Any) -> Path:
    """A `save_pretrained` folder of `tiny_config`."""
    from dcp_lens.model.hooked_recurrent_transformer import HookedRecurrentTransformer

    return HookedRecurrentTransformer(tiny_config(**fields)).save_pretrained(folder)


def write_llama2c(
    path: Path,
    dim: int = 8,
    hidden: int = 16,
    n_layers: int = 1,
    n_heads: int = 2,
    n_kv_heads: int = 2,
    vocab: int = 10,
    seq_len: int = 4,
    tables: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Path:
    """A llama2.c version-0 checkpoint with random weights and correct RoPE tables (``tables``
    may alter them)."""
    from dcp_lens.model.components.rotary import rotary_tables
    from dcp_lens.zoo.loaders.llama2c_format import Llama2cHeader

    header = Llama2cHeader(dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len)
    generator = torch.Generator().manual_seed(0)
    cos, sin = rotary_tables(seq_len, dim // n_heads, 10000.0)
    arrays = []
    for name, shape in header.array_shapes():
        if name in ("freq_cis_real", "freq_cis_imag"):
            table = cos if name == "freq_cis_real" else sin
            array = tables(table.clone()) if tables is not None else table
        else:
            array = torch.randn(shape, generator=generator) * 0.1
        arrays.append(array.float().flatten())
    values = (dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len)
    path.write_bytes(struct.pack("<7i", *values) + torch.cat(arrays).numpy().tobytes())
    return path


# Small sizes for runs in tests (seconds each).
SMALL = ["--n-eval", "16", "--n-calibration", "16", "--bootstrap", "5", "--probe", "none"]


def run_argv(out: Path, *extra: str) -> list[str]:
    """``dcp-lens run`` of the planted readout_shift model at `SMALL` sizes into ``out``."""
    return ["run", "--model", "planted:readout_shift", *SMALL, "--quiet", "--out", str(out), *extra]


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the CLI, which must fail with exit code 2 and exactly one line on stderr."""
    from dcp_lens.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    return err


def result_numbers(results) -> list[float]:
    """Every number of a run's results (`ProtocolResults`), in a fixed order, NaN kept as NaN:
    what a resumed or retried run must reproduce."""
    flat: list[float] = []

    def walk(value) -> None:
        if isinstance(value, dict):
            for key in sorted(value):
                if key not in ("metadata", "config"):
                    walk(value[key])
        elif isinstance(value, list):
            for item in value:
                walk(item)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            flat.append(float(value))

    walk(json.loads(json.dumps(results.to_results_json(), default=str)))
    return flat


def numbers_close(a: list[float], b: list[float], tol: float) -> bool:
    """Equal length and every pair within ``tol`` relative (absolute below 1), NaN equal to NaN."""
    return len(a) == len(b) and all(
        (math.isnan(x) and math.isnan(y)) or abs(x - y) <= tol * max(1.0, abs(x))
        for x, y in zip(a, b, strict=True)
    )


# ------------------------------------------------------------------------- full-size loads

SAFETENSORS_DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def seeded_weight(key: str, shape: tuple[int, ...], block: int = 1 << 16) -> torch.Tensor:
    """A random bfloat16 tensor seeded by ``key`` (the same on every call): ``block`` draws of
    N(0, 0.02^2) repeated to fill ``shape``, so that billions of values cost a copy each."""
    generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    numel = math.prod(shape)
    draws = torch.empty(min(numel, block), dtype=torch.bfloat16).normal_(
        0.0, 0.02, generator=generator
    )
    return draws.repeat(-(-numel // draws.numel()))[:numel].reshape(shape)


def write_hub_checkpoint(
    folder: Path,
    config: dict[str, Any],
    shapes: dict[str, tuple[int, ...]],
    draw: Callable[[str, tuple[int, ...]], torch.Tensor],
    shard_bytes: int,
    dtype: torch.dtype = torch.bfloat16,
) -> int:
    """A checkpoint folder in the hub's layout: ``config.json``, safetensors shards of at most
    ``shard_bytes`` each (a larger tensor gets a shard of its own) and
    ``model.safetensors.index.json``. Each tensor is ``draw(key, shape)`` cast to ``dtype`` and
    written before the next is drawn, so the writer holds one tensor at a time, never a shard.
    Returns the bytes of all tensors (the index's ``total_size``)."""
    element = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    sizes = [0]
    for key, shape in shapes.items():
        size = element * math.prod(shape)
        if sizes[-1] and sizes[-1] + size > shard_bytes:
            shards.append([])
            sizes.append(0)
        shards[-1].append(key)
        sizes[-1] += size
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    weight_map: dict[str, str] = {}
    for i, keys in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors_streamed(folder / name, {k: shapes[k] for k in keys}, draw, dtype)
        weight_map |= dict.fromkeys(keys, name)
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return sum(sizes)


def _write_safetensors_streamed(
    path: Path,
    shapes: dict[str, tuple[int, ...]],
    draw: Callable[[str, tuple[int, ...]], torch.Tensor],
    dtype: torch.dtype,
) -> None:
    """One safetensors file (an 8-byte little-endian header length, a JSON header padded with
    spaces to 8 bytes, then the tensors' bytes back to back), its header written from the shapes
    alone and each tensor drawn as it is written."""
    element = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, shape in shapes.items():
        end = offset + element * math.prod(shape)
        entry = {"dtype": SAFETENSORS_DTYPE_NAMES[dtype], "shape": list(shape)}
        header[key] = entry | {"data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with path.open("wb") as file:
        file.write(struct.pack("<Q", len(text)) + text)
        for key, shape in shapes.items():
            tensor = draw(key, shape).to(dtype).contiguous()
            assert tuple(tensor.shape) == tuple(shape), (key, tensor.shape, shape)
            file.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
            del tensor


# Run in a fresh process: the load's time and peak host memory from /proc/self/status (VmHWM is
# this process's own peak; ru_maxrss would carry the forking test process's peak across exec),
# then, with ``forward`` > 0, one short forward at that many iterations counting the hooks.
MEASURE_LOAD = """
import json, sys, time
import torch
from dcp_lens.zoo.registry import load

spec, module, forward = sys.argv[1], sys.argv[2], int(sys.argv[3])
with open("/proc/self/oom_score_adj", "w") as adj:  # out of memory: end this, not a neighbour
    adj.write("1000")
__import__(module)

def status(field):
    line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024

before = status("VmRSS")
start, cpu_start = time.perf_counter(), time.process_time()
model = load(spec)
seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
for parameter in model.parameters():  # every page read in, whether copied or mapped from disk
    parameter.detach().sum()
figures = {
    "seconds": seconds, "cpu_seconds": cpu_seconds,
    "before": before, "peak": status("VmHWM"), "after": status("VmRSS"),
    "parameters": sum(p.numel() for p in model.parameters()),
    "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
}
if forward:
    names = ["hook_embed", *(model.state_hook_name(t) for t in range(forward + 1)),
             model.readout_hook_name, "ln_final.hook_normalized"]
    fired = dict.fromkeys(names, 0)
    def count(value, hook):
        fired[hook.name] += 1
    tokens = torch.arange(1, 6).unsqueeze(0) * (model.cfg.d_vocab // 6)
    start = time.perf_counter()
    with torch.no_grad():
        logits = model.run_with_hooks(tokens, n_iterations=forward,
                                      fwd_hooks=[(name, count) for name in names])
    figures["forward"] = {"seconds": time.perf_counter() - start, "shape": list(logits.shape),
                          "finite": bool(logits.isfinite().all()), "fired": fired,
                          "dtype": str(logits.dtype)}
print(json.dumps(figures))
"""


def measure_load(spec: str, module: str, forward: int = 0, timeout: int = 1800) -> dict[str, Any]:
    """`MEASURE_LOAD` of the `load` spec ``spec`` in a fresh process (``module``, the loader's,
    imported before the count starts); the figures it prints."""
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", MEASURE_LOAD, spec, module, str(forward)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def out_of_memory_from(call: Callable[..., Any], nth: int) -> Callable[..., Any]:
    """``call``, raising `torch.OutOfMemoryError` from its ``nth`` call on (a device that
    runs out part way through a stage)."""
    calls: list[int] = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) >= nth:
            raise torch.OutOfMemoryError("simulated: out of memory")
        return call(*args, **kwargs)

    return failing
