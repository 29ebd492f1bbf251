"""Ouro's larger siblings (2.6B and the Thinking variants: 48 layers) load from their config with
no special case: a tiny-width checkpoint in their layer layout, written in the original key names
and read back by the ``ouro:`` loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import data_path
from safetensors.torch import save_file

from dcp_lens import load
from dcp_lens.utils.errors import ConfigError
from dcp_lens.zoo.loaders.ouro import OuroRecurrentTransformer, ouro_config, ouro_tensor_shapes

N_LAYERS = 48  # Ouro-2.6B and Ouro-2.6B-Thinking; the 1.4B models have 24


def _config() -> dict[str, object]:
    """ouro_tiny's config.json (width 64) with the 2.6B models' layer layout."""
    config = json.loads((data_path("fixtures", "ouro_tiny") / "config.json").read_text())
    config |= {
        "num_hidden_layers": N_LAYERS,
        "layer_types": ["full_attention"] * N_LAYERS,
        "max_window_layers": N_LAYERS,
        "total_ut_steps": 4,
    }
    return config


def _write(folder: Path, config: dict[str, object]) -> dict[str, torch.Tensor]:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    expected, _ = ouro_tensor_shapes(ouro_config(_config()))  # the shapes of the valid layout
    generator = torch.Generator().manual_seed(0)
    tensors = {
        key: 0.1 * torch.randn(shape, generator=generator) for key, shape in expected.items()
    }
    for key in tensors:
        if "layernorm" in key or key == "model.norm.weight":
            tensors[key] = 1 + tensors[key]
    save_file(tensors, folder / "model.safetensors")
    return tensors


def test_the_48_layer_layout_loads_with_every_layer_in_the_loop(tmp_path: Path) -> None:
    tensors = _write(tmp_path / "ouro48", _config())
    model = load(f"ouro:{tmp_path / 'ouro48'}")
    assert isinstance(model, OuroRecurrentTransformer)
    assert (model.cfg.n_prelude, model.cfg.n_core, model.cfg.n_coda) == (0, N_LAYERS, 0)
    assert model.cfg.n_iterations == 4 and model.cfg.n_layers == 4 * N_LAYERS
    weights = model.canonical_state_dict()
    last = N_LAYERS - 1  # the last layer's weights are where the checkpoint put them
    assert torch.equal(
        weights[f"core.{last}.mlp.W_out"], tensors[f"model.layers.{last}.mlp.down_proj.weight"].T
    )
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
        exits = model.exit_probabilities(tokens)
    assert f"blocks.{4 * N_LAYERS - 1}.hook_resid_post" in cache
    assert all(model.state_hook_name(t) in cache for t in range(1, 5))
    assert torch.allclose(exits.sum(-1), torch.ones(2, 8, dtype=exits.dtype), atol=1e-5)


def test_a_sliding_window_layer_is_refused(tmp_path: Path) -> None:
    config = _config()
    config["layer_types"] = ["full_attention"] * (N_LAYERS - 1) + ["sliding_attention"]
    _write(tmp_path / "sliding", config)
    with pytest.raises(ConfigError, match="sliding_attention"):
        load(f"ouro:{tmp_path / 'sliding'}")
