"""Real-scale Huginn-0125 and Ouro configs, built on the meta device, with parameter counts.

Run ``python demos/real_scale_configs.py``. Nothing is downloaded and no weight memory is used:
each model is instantiated under ``torch.device("meta")`` from the published ``config.json``
values, passed through the same translation the loaders use (`huginn_config`, `ouro_config`).

Unique parameters are counted (``model.parameters()`` yields a tied tensor once, so the 32
unrolled copies of Huginn's core and a tied unembedding count once).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from dcp_lens import HookedRecurrentTransformer, RecurrentConfig
from dcp_lens.zoo.loaders.huginn import HUGINN_0125, huginn_config
from dcp_lens.zoo.loaders.ouro import OuroRecurrentTransformer, ouro_config

# The count logged in Huginn's model registry (recpre/model_registry.py, "nebel-raven-3.5b").
HUGINN_0125_PUBLISHED = 3_509_051_040

# ByteDance/Ouro-1.4B config.json: the architecture fields; Ouro-2.6B has 48 layers.
OURO_1P4B: dict[str, Any] = {
    "hidden_act": "silu",
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "num_hidden_layers": 24,
    "intermediate_size": 5632,
    "vocab_size": 49152,
    "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "total_ut_steps": 4,
}
OURO_2P6B: dict[str, Any] = {**OURO_1P4B, "num_hidden_layers": 48}
# The model cards give only rounded sizes.
OURO_PUBLISHED = {"Ouro-1.4B": "1.4B", "Ouro-2.6B": "2.6B"}


def huginn_0125_config(**overrides: Any) -> RecurrentConfig:
    """Huginn-0125's `RecurrentConfig` (32 iterations, its truncated-normal initial state)."""
    return huginn_config(HUGINN_0125, source="Huginn-0125 config", **overrides)


def ouro_1p4b_config(**overrides: Any) -> RecurrentConfig:
    """Ouro-1.4B's `RecurrentConfig` (24 layers looped 4 times)."""
    return ouro_config(OURO_1P4B, source="Ouro-1.4B config", **overrides)


def ouro_2p6b_config(**overrides: Any) -> RecurrentConfig:
    """Ouro-2.6B's `RecurrentConfig` (48 layers looped 4 times)."""
    return ouro_config(OURO_2P6B, source="Ouro-2.6B config", **overrides)


def build_on_meta(
    cfg: RecurrentConfig, model_class: type[HookedRecurrentTransformer] = HookedRecurrentTransformer
) -> HookedRecurrentTransformer:
    """The model of ``cfg`` with every parameter on the meta device (shapes only)."""
    with torch.device("meta"):
        return model_class(cfg)


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters: ``model.parameters()`` yields each shared tensor once."""
    return sum(p.numel() for p in model.parameters())


def huginn_breakdown(cfg: RecurrentConfig) -> dict[str, int]:
    """Huginn's parameters by group, from the config alone (a check on the meta count)."""
    d, d_mlp, vocab = cfg.d_model, cfg.d_mlp, cfg.d_vocab
    assert d_mlp is not None
    n_blocks = cfg.n_prelude + cfg.n_core + cfg.n_coda
    matrices = 3 * d * d + d * d + 2 * d_mlp * d + d_mlp * d
    return {
        "embedding (tied with the unembedding)": vocab * d,
        "block matrices": n_blocks * matrices,
        "qk_bias": n_blocks * 2 * d,
        "block norms": n_blocks * 4 * d,
        "adapter": d * 2 * d,
        "ln_f": d,
    }


def ouro_breakdown(cfg: RecurrentConfig) -> dict[str, int]:
    """Ouro's parameters by group, from the config alone (a check on the meta count)."""
    d, d_mlp, vocab = cfg.d_model, cfg.d_mlp, cfg.d_vocab
    assert d_mlp is not None
    per_layer = 4 * d * d + 3 * d * d_mlp + 4 * d
    return {
        "embedding": vocab * d,
        "lm_head (untied)": 0 if cfg.tie_unembed else vocab * d,
        "layers": cfg.n_core * per_layer,
        "model.norm": d,
        "early-exit gate": d + 1,
    }


def main() -> None:
    """Build each real-scale model on meta; print its parameter count and the published one."""
    start = time.perf_counter()
    huginn = build_on_meta(huginn_0125_config())
    huginn_seconds = time.perf_counter() - start
    ours = count_parameters(huginn)
    groups = huginn_breakdown(huginn.cfg)
    assert ours == sum(groups.values())
    print(f"Huginn-0125 on meta in {huginn_seconds:.2f} s: {ours:,} parameters")
    for name, count in groups.items():
        print(f"    {name:40s} {count:>15,}")
    gap = ours - HUGINN_0125_PUBLISHED
    print(f"  published {HUGINN_0125_PUBLISHED:,}; ours - published = {gap:,}")
    print(
        f"  = adapter ({groups['adapter']:,}) + block norms ({groups['block norms']:,}): the "
        "registry's count leaves those out"
    )
    for name, cfg in (("Ouro-1.4B", ouro_1p4b_config()), ("Ouro-2.6B", ouro_2p6b_config())):
        start = time.perf_counter()
        model = build_on_meta(cfg, OuroRecurrentTransformer)
        seconds = time.perf_counter() - start
        count = count_parameters(model)
        groups = ouro_breakdown(cfg)
        assert count == sum(groups.values())
        print(f"{name} on meta in {seconds:.2f} s: {count:,} parameters")
        for group, size in groups.items():
            print(f"    {group:40s} {size:>15,}")
        print(f"  published {OURO_PUBLISHED[name]} (model card, rounded)")


if __name__ == "__main__":
    main()
