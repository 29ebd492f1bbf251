from __future__ import annotations

import os
import struct
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from hypothesis import HealthCheck, settings

if TYPE_CHECKING:  # dcp_lens is imported inside the helpers, after the environment is set
    from dcp_lens.config import RecurrentConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Small tensors: one thread avoids oversubscription on a busy 2-core machine.
torch.set_num_threads(1)

SHARED = Path(os.environ.get("DCP_LENS_SHARED", Path(__file__).resolve().parents[2] / "shared"))


@pytest.fixture
def shared_dir() -> Path:
    """The project's ../shared folder (data and fixtures); tests that need it skip without it."""
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent (set DCP_LENS_SHARED to the shared data folder)")
    return SHARED


# ----------------------------------------------------------------------- hardening helpers
# Shared by test_hardening.py and test_properties.py (test modules never import each other).


# Property tests: a default profile that keeps the default suite under a minute; tests marked
# slow raise max_examples themselves.
settings.register_profile(
    "dcp-lens",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("dcp-lens")

# Inputs tried by the fuzz and property tests, and what became of them (printed at the end).
FUZZ_TALLY: Counter[str] = Counter()


def outcome(action: Callable[[], Any], name: str) -> str:
    """Run ``action``; "works" or "clean error" (a `DCPLensError`, with a message), counted under
    ``name``. Any other exception propagates: it is what the property tests exist to find."""
    from dcp_lens.errors import DCPLensError

    FUZZ_TALLY[f"{name}: tried"] += 1
    try:
        action()
    except DCPLensError as error:
        assert str(error).strip(), f"{type(error).__name__} without a message"
        FUZZ_TALLY[f"{name}: clean error"] += 1
        return "clean error"
    FUZZ_TALLY[f"{name}: works"] += 1
    return "works"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if FUZZ_TALLY:
        terminalreporter.section("fuzz and property inputs")
        for key in sorted(FUZZ_TALLY):
            terminalreporter.write_line(f"{key}: {FUZZ_TALLY[key]}")


def tiny_config(**fields: Any) -> RecurrentConfig:
    """A 1 + 1 x 2 + 1 model small enough to build in milliseconds."""
    from dcp_lens.config import RecurrentConfig

    base: dict[str, Any] = dict(
        d_model=16, n_heads=2, d_head=8, d_mlp=32, d_vocab=20, n_ctx=16,
        n_prelude=1, n_core=1, n_coda=1, n_iterations=2, seed=0,
    )  # fmt: skip
    return RecurrentConfig(**{**base, **fields})


def save_tiny_model(folder: Path, **fields: Any) -> Path:
    """A `save_pretrained` folder of `tiny_config`."""
    from dcp_lens.hooked_recurrent_transformer import HookedRecurrentTransformer

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
    from dcp_lens.components.rotary import rotary_tables
    from dcp_lens.loading.llama2c_format import Llama2cHeader

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
