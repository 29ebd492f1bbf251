from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, settings

# Test modules live in unit/, integration/ and acceptance/; the shared builders (helpers.py) and
# the independent reference implementations (reference.py) beside this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Small tensors: one thread avoids oversubscription on a busy 2-core machine.
torch.set_num_threads(1)

# Property tests: a default profile that keeps the default suite under a minute; tests marked
# slow raise max_examples themselves.
settings.register_profile(
    "dcp-lens",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("dcp-lens")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    from helpers import FUZZ_TALLY

    if FUZZ_TALLY:
        terminalreporter.section("fuzz and property inputs")
        for key in sorted(FUZZ_TALLY):
            terminalreporter.write_line(f"{key}: {FUZZ_TALLY[key]}")
