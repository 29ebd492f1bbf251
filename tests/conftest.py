from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

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
