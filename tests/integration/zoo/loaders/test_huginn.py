"""Huginn-0125 at its full shape: a random-weight checkpoint in the hub's layout loads on the CPU
within 1.2x its weights' bytes of host memory, and runs. (Its outputs against the reference
implementation are checked on the tiny fixture in ``tests/integration/zoo/test_loaders.py``.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import measure_load, seeded_weight, write_hub_checkpoint

from dcp_lens.zoo.loaders.huginn import (
    HUGINN_0125,
    ROPE_BUFFER,
    TIED_HEAD,
    huginn_config,
    huginn_tensor_shapes,
)

SHARD_BYTES = 2 << 30  # four shards of Huginn-0125 in bfloat16
EMBEDDING = "transformer.wte.weight"


def _draw(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A key's random tensor; the tied head's stored copy equals the embedding."""
    return seeded_weight(EMBEDDING if key == TIED_HEAD else key, shape)


@pytest.mark.slow
def test_huginn_0125_in_the_hub_layout_loads_within_1_2x_its_weights(tmp_path: Path) -> None:
    """Every key of the reference's state_dict (the tied head's copy and the RoPE table too), in
    bfloat16 shards with an index; the load's time and peak host memory measured in a fresh
    process (from after the imports), then one forward at two iterations with its hooks counted.
    docs/models.md reports the figures."""
    cfg = huginn_config(HUGINN_0125)
    expected, _ = huginn_tensor_shapes(cfg)
    rope = (1, cfg.n_ctx, 1, cfg.d_head // 2, 2)
    shapes = {**expected, TIED_HEAD: expected[EMBEDDING], ROPE_BUFFER: rope}
    folder = tmp_path / "huginn-0125"
    try:
        file_bytes = write_hub_checkpoint(folder, HUGINN_0125, shapes, _draw, SHARD_BYTES)
        figures = measure_load(f"huginn:{folder}", "dcp_lens.zoo.loaders.huginn", forward=2)
    finally:  # gigabytes: not left among the temporary folders pytest keeps
        shutil.rmtree(folder, ignore_errors=True)
    weights = figures["parameter_bytes"]
    print(f"\nfiles {file_bytes / 1e9:.2f} GB, weights {weights / 1e9:.2f} GB, {figures}")
    assert figures["dtypes"] == ["torch.bfloat16"]
    assert weights == 2 * sum(torch.Size(shape).numel() for shape in expected.values())
    assert figures["peak"] - figures["before"] <= 1.2 * weights
    forward = figures["forward"]
    assert forward["shape"] == [1, 5, cfg.d_vocab] and forward["finite"]
    assert all(count == 1 for count in forward["fired"].values()), forward["fired"]
