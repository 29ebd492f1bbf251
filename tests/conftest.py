from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Small tensors: one thread avoids oversubscription on a busy 2-core machine.
torch.set_num_threads(1)
