"""HRM-Text (transformers' ``hrm_text``) through ``load("hrm-text:PATH")`` against the
transformers class itself: tiny random configs built here with a fixed seed, saved with the
class's own ``save_pretrained`` (the hub's fused layout), no network.

Tolerance: float32 logits within ATOL of ``HrmTextForCausalLM`` at H_cycles = 1, 2, 3 and 4
(the same operations in the same order; the measured difference is at float32 rounding).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_every_map_matches_hooks,
    assert_fast_path_matches_hooks,
    data_path,
    lm_sets,
)
from torch import Tensor

from dcp_lens import DepthControlProtocol, hooks, load
from dcp_lens.cli import main
from dcp_lens.model.hooked_recurrent_transformer import ResumeError
from dcp_lens.model.stream import DecompositionError
from dcp_lens.utils.errors import ConfigError, UnsupportedToolError
from dcp_lens.zoo.loaders.hrm_text import HrmRecurrentTransformer
from dcp_lens.zoo.registry import foreign_checkpoint

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
SHAKESPEARE = data_path("tinyshakespeare.txt")
# A tiny HRM-Text: stacks of 2 layers, 3 inner passes, 2 outer cycles by default.
SHAPE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    head_dim=8,
    H_cycles=2,
    L_cycles=3,
    initializer_range=0.1,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
N, INNER = SHAPE["num_hidden_layers"], SHAPE["L_cycles"]
PER_CYCLE = (INNER + 1) * N


def reference(folder: Path, cycles: int) -> torch.nn.Module:
    """The transformers class on ``folder``'s weights, run for ``cycles`` outer cycles."""
    config = transformers.HrmTextConfig.from_pretrained(folder, H_cycles=cycles)
    return transformers.HrmTextForCausalLM.from_pretrained(folder, config=config).eval()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = transformers.HrmTextForCausalLM(transformers.HrmTextConfig(**SHAPE)).eval()
    with torch.no_grad():  # a non-zero z_L_init, so the test sees whether it is read
        model.model.z_L_init.normal_()
    path = tmp_path_factory.mktemp("hrm") / "tiny"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokens() -> Tensor:
    return torch.randint(
        0, SHAPE["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1)
    )


def test_logits_match_the_transformers_class_at_every_cycle_count(
    folder: Path, tokens: Tensor
) -> None:
    model = load(f"hrm-text:{folder}")
    assert isinstance(model, HrmRecurrentTransformer) and model.n_iterations == SHAPE["H_cycles"]
    outputs = {}
    for cycles in (1, 2, 3, 4):
        with torch.no_grad():
            expected = reference(folder, cycles)(tokens, use_cache=False).logits
            outputs[cycles] = model(tokens, n_iterations=cycles)
        torch.testing.assert_close(outputs[cycles], expected, atol=ATOL, rtol=0)
    # The cycles matter far beyond the tolerance, so matching at each is not vacuous.
    assert (outputs[1] - outputs[4]).abs().max() > 1000 * ATOL


def test_every_pass_is_hooked_and_the_state_is_z_h(folder: Path, tokens: Tensor) -> None:
    k = 3
    model = load(f"hrm-text:{folder}", n_iterations=k)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    assert model.cfg.n_layers == k * PER_CYCLE
    for i in range(k * PER_CYCLE):  # every layer of every inner and outer pass
        for name in ("hook_resid_pre", "hook_resid_post", "attn.hook_gate", "mlp.hook_post"):
            assert f"blocks.{i}.{name}" in cache
    for t in range(k + 1):
        assert model.state_hook_name(t) in cache and f"inner.{t}.hook_state" in cache
    for t in range(1, k + 1):  # s_t is the transformers model's z_H after t outer cycles
        with torch.no_grad():
            z_high = reference(folder, t).model(tokens, use_cache=False).last_hidden_state
        torch.testing.assert_close(cache[model.state_hook_name(t)], z_high, atol=ATOL, rtol=0)
        first_h = model.hook_name(t, INNER * N, "hook_resid_pre")  # the H stack reads z_H + z_L
        expected_input = cache[model.state_hook_name(t - 1)] + cache[f"inner.{t}.hook_state"]
        torch.testing.assert_close(cache[first_h], expected_input)
    # One weight per L layer across its inner passes and cycles; the H stack its own.
    blocks = model.blocks
    folded = repr(blocks)  # the whole cycle is the core's period, not one inner pass
    assert f"core, {PER_CYCLE} layers x {k} iterations" in folded and "coda" not in folded
    assert blocks[0].attn.W_Q is blocks[N].attn.W_Q is blocks[PER_CYCLE].attn.W_Q
    assert blocks[INNER * N].attn.W_Q is not blocks[0].attn.W_Q


def test_transformer_lens_surface(folder: Path, tokens: Tensor) -> None:
    """run_with_cache, hook_name and transformer_lens.patching work on the unrolled blocks."""
    from transformer_lens import patching

    model = load(f"hrm-text:{folder}")
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens)  # attention materialised: same logits
        torch.testing.assert_close(logits, model(tokens), atol=1e-6, rtol=0)
    with model.iterations(3):  # a longer view's new hooks are in eval mode too (patching asks)
        assert not any(module.training for module in model.modules())
    name = model.hook_name(2, INNER * N + 1, "hook_resid_post")  # cycle 2's second H layer
    assert name == f"blocks.{PER_CYCLE + INNER * N + 1}.hook_resid_post" and name in cache
    clean, corrupted = tokens[:1, :3], tokens[1:, :3]
    _, clean_cache = model.run_with_cache(clean)

    def metric(patched: Tensor) -> Tensor:
        return patched[0, -1, 0]

    with torch.no_grad():
        table = patching.get_act_patch_resid_pre(model, corrupted, clean_cache, metric)
    assert table.shape == (model.cfg.n_layers, 3)
    for layer, position in [(0, 2), (INNER * N, 1), (PER_CYCLE + 3, 2)]:
        hook = f"blocks.{layer}.hook_resid_pre"

        def patch(
            stream: Tensor, hook: object, position: int = position, name: str = hook
        ) -> Tensor:
            stream[:, position] = clean_cache[name][:, position]
            return stream

        with torch.no_grad():
            manual = metric(model.run_with_hooks(corrupted, fwd_hooks=[(hook, patch)]))
        torch.testing.assert_close(table[layer, position], manual, atol=1e-6, rtol=0)


def test_an_edit_of_the_inner_state_reaches_the_logits(folder: Path, tokens: Tensor) -> None:
    model = load(f"hrm-text:{folder}")

    def zero(state: Tensor, hook: object) -> Tensor:
        return torch.zeros_like(state)

    with torch.no_grad():
        plain = model(tokens)
        edited = model.run_with_hooks(tokens, fwd_hooks=[("inner.1.hook_state", zero)])
    assert (plain - edited).abs().max() > 1000 * ATOL


def test_reset_hooks_reaches_the_inner_state_of_a_longer_view(folder: Path, tokens: Tensor) -> None:
    model = load(f"hrm-text:{folder}")  # r = 2

    def zero(state: Tensor, hook: object) -> Tensor:
        return torch.zeros_like(state)

    with torch.no_grad(), model.iterations(4):
        plain = model(tokens)
        model.add_hook("inner.4.hook_state", zero)
        assert (model(tokens) - plain).abs().max() > 1000 * ATOL
    model.reset_hooks()  # in the r = 2 view, which has no inner.4
    with torch.no_grad(), model.iterations(4):
        torch.testing.assert_close(model(tokens), plain, atol=0, rtol=0)


def test_truncate_and_replay_run_as_hooks(folder: Path, tokens: Tensor) -> None:
    model = load(f"hrm-text:{folder}", n_iterations=4)
    with torch.no_grad():
        truncated = model.run_with_hooks(tokens, fwd_hooks=hooks.truncate(2).fwd_hooks(model))
        expected = reference(folder, 2)(tokens, use_cache=False).logits
        torch.testing.assert_close(truncated, expected, atol=ATOL, rtol=0)
        _, cache = model.run_with_cache(tokens)
        states = torch.stack([cache[model.state_hook_name(t)] for t in range(5)])
        replayed = model.run_with_hooks(tokens, fwd_hooks=hooks.replay(2).fwd_hooks(model))
        torch.testing.assert_close(replayed, model.readout(hooks.replay(2).readout_input(states)))


def test_every_condition_matches_its_hook_form(folder: Path) -> None:
    """The protocol's closed forms over cached z_H states equal the hook forms on a forward pass
    (truncate, replay, calibrate, shift, translate, base rate), with the default map."""
    model = load(f"hrm-text:{folder}", n_iterations=3, dtype="float64")
    evaluation, calibration = lm_sets(model, n=24, pos=8)
    protocol = DepthControlProtocol(model, n_bootstrap=5, probe="none", progress=False)
    protocol.fit(calibration)
    checked = assert_fast_path_matches_hooks(protocol, evaluation.tokens[:4], tol=1e-9)
    assert {"truncate", "replay", "calibrate_truncate", "translate_truncate"} <= set(checked)


@pytest.mark.slow
def test_every_calibration_map_matches_its_hook_form(folder: Path) -> None:
    model = load(f"hrm-text:{folder}", n_iterations=3, dtype="float64")
    evaluation, calibration = lm_sets(model, n=24, pos=8)
    checked = assert_every_map_matches_hooks(
        model, calibration, evaluation.tokens[:4], tol=1e-9, n_bootstrap=5
    )
    assert {"mean", "full", "translate_truncate"} <= set(checked)


def test_dcp_runs_and_results_name_the_broken_assumptions(folder: Path) -> None:
    model = load(f"hrm-text:{folder}", n_iterations=3, dtype="float64")
    evaluation, calibration = lm_sets(model, n=32, pos=8)
    protocol = DepthControlProtocol(model, n_bootstrap=10, probe="none", progress=False)
    results = protocol.run(evaluation, calibration)
    assert results.architecture == "recurrent" and results.n_iterations == 3
    assert results.null_control["max_abs_logit_diff"] <= 1e-9
    table = results.table()
    assert set(table["k"]) == set(results.metadata["k_grid"]) and 1 in set(table["k"])
    assert (table["S"] + table["B"] + table["D"] - table["gap"]).abs().max() <= 1e-9
    caveats = results.metadata["model_caveats"]
    assert {"nested_loop", "second_state", "injection", "prefix_lm"} <= set(caveats)
    assert "outer H cycles" in caveats["nested_loop"]


def test_cli_runs_on_the_folder(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = main(
        [
            "run",
            "--model",
            f"hrm-text:{folder}",
            "--task",
            f"char_lm:{SHAKESPEARE}",
            "--k",
            "1",
            "--n-eval",
            "32",
            "--n-calibration",
            "32",
            "--bootstrap",
            "10",
            "--probe",
            "none",
            "--quiet",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    (record,) = json.loads((out / "results.json").read_text())["runs"]
    assert record["model"] == f"hrm-text:{folder}"
    assert "second_state" in record["metadata"]["model_caveats"]


def test_what_is_not_defined_is_refused(folder: Path, tokens: Tensor) -> None:
    with pytest.raises(ConfigError, match="outer cycles with the inner loop complete"):
        load(f"hrm-text:{folder}", n_core=3)
    with pytest.raises(ConfigError, match="n_prelude"):
        load(f"hrm-text:{folder}", n_prelude=1)
    model = load(f"hrm-text:{folder}")
    with pytest.raises(ResumeError, match="start_at_layer"):
        model(torch.zeros(2, 12, SHAPE["hidden_size"]), start_at_layer=N)
    with pytest.raises(UnsupportedToolError, match="hrm-text:PATH"):
        model.save_pretrained(folder.parent / "ours")
    _, cache = model.run_with_cache(tokens)
    with pytest.raises(DecompositionError, match="z_L is carried"):
        cache.decompose_resid()
    assert foreign_checkpoint(str(folder)) is not None
    with pytest.raises(ConfigError, match="hrm-text:"):
        load(str(folder))


def test_unsupported_settings_are_refused_with_the_field(folder: Path, tmp_path: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    for field, value, message in [
        ("attention_bias", True, "attention_bias"),
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1.0}, "rope_type"),
        ("head_dim", 16, "hidden_size"),
        ("model_type", "llama", "not 'hrm_text'"),
    ]:
        bad = tmp_path / field
        bad.mkdir()
        (bad / "model.safetensors").symlink_to(folder / "model.safetensors")
        (bad / "config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(ConfigError, match=message):
            load(f"hrm-text:{bad}")
