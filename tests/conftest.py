from __future__ import annotations

import os
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Small tensors: one thread avoids oversubscription on a busy 2-core machine.
torch.set_num_threads(1)

DATA_DIR = Path(__file__).resolve().parents[1] / "demos" / "data"


def data_path(*parts: str) -> Path:
    """A file or folder of the repository's ``demos/data`` (the data and fixtures the tests read).

    Raises FileNotFoundError naming the path when the checkout lacks it.
    """
    path = DATA_DIR.joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: the tests read the data and fixtures committed under demos/data"
            " (see demos/data/README.md); restore them with `git checkout -- demos/data`"
        )
    return path
