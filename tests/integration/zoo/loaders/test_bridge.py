"""`BridgeModel`: a TransformerLens 4 `TransformerBridge` as DCP's dense negative control.

Everything is built here, offline: a tiny random GPT-2 and a byte-level BPE tokenizer trained on a
few sentences, saved to a folder, booted as a bridge with ``boot_transformers``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformer_lens.model_bridge import TransformerBridge
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from dcp_lens import hooks, load
from dcp_lens.protocol.conditions import SWEEP
from dcp_lens.protocol.dcp import DepthControlProtocol, EvaluationSet
from dcp_lens.zoo.loaders import BridgeModel

N_LAYERS = 3
ATOL = 1e-5
SENTENCES = [
    "once upon a time there was a little cat",
    "the cat sat on the mat and looked at the moon",
    "a dog ran to the park with a red ball",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: a second thread only adds waiting on a busy machine (4x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local Hugging Face folder: config, safetensors weights and tokenizer files."""
    path = tmp_path_factory.mktemp("tiny_gpt2")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(SENTENCES, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=N_LAYERS,
        n_embd=32,
        n_head=4,
        n_positions=32,
        vocab_size=len(wrapped),
        bos_token_id=0,
        eos_token_id=0,
    )
    GPT2LMHeadModel(config).save_pretrained(path)
    wrapped.save_pretrained(path)
    return path


def boot(folder: Path) -> TransformerBridge:
    """The saved model booted as a bridge around an HF model and tokenizer read from ``folder``."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    hf_model = GPT2LMHeadModel.from_pretrained(folder).eval()
    return TransformerBridge.boot_transformers(
        str(folder), hf_model=hf_model, tokenizer=tokenizer, device="cpu"
    )


def lm_sets(model: BridgeModel, n: int = 40, pos: int = 12) -> tuple[EvaluationSet, ...]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.cfg.d_vocab, (2 * n, pos), generator=generator)
    return EvaluationSet.from_tokens(tokens[:n]), EvaluationSet.from_tokens(tokens[n:])


def fitted_protocol(model: BridgeModel) -> tuple[DepthControlProtocol, torch.Tensor]:
    evaluation, calibration = lm_sets(model)
    protocol = DepthControlProtocol(model, probe="none", progress=False)
    protocol.fit(calibration)
    return protocol, evaluation.tokens[:6]


def test_layers_are_iterations_on_the_bridges_own_hooks_each_firing_once(folder):
    model = BridgeModel.from_bridge(boot(folder))
    assert isinstance(model, hooks.IterationModel)
    assert model.n_iterations == N_LAYERS and model.is_dense
    assert model.state_hook_name(0) == "blocks.0.hook_in"
    assert [model.state_hook_name(t) for t in (1, 3)] == ["blocks.0.hook_out", "blocks.2.hook_out"]
    assert model.readout_hook_name == "ln_final.hook_in"
    names = [model.state_hook_name(t) for t in range(N_LAYERS + 1)] + [model.readout_hook_name]
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    record = [(name, lambda x, hook, name=name: seen[name].append(x)) for name in names]
    logits = model.run_with_hooks(torch.arange(10)[None], fwd_hooks=record)
    assert {name: len(states) for name, states in seen.items()} == dict.fromkeys(names, 1)
    # The readout input is the last block's output, and the readout reproduces the logits.
    assert torch.equal(seen[names[-1]][0], seen[names[-2]][0])
    assert (model.readout(seen[names[-2]][0]) - logits).abs().max() <= ATOL
    with pytest.raises(ValueError, match=r"t=4 must be an int in 0..3"):
        model.state_hook_name(4)


def test_truncate_at_full_depth_reads_out_the_bridges_own_logits(folder):
    bridge = boot(folder)
    model = BridgeModel.from_bridge(bridge)
    protocol, tokens = fitted_protocol(model)
    with torch.no_grad():
        expected = bridge(tokens)
        fast = protocol.condition_logits(tokens, "truncate", N_LAYERS)
        hooked = model.run_with_hooks(tokens, fwd_hooks=hooks.truncate(N_LAYERS).fwd_hooks(model))
    assert (fast - expected).abs().max() <= ATOL
    assert (hooked - expected).abs().max() <= ATOL
    # Shallower truncations do change the output: the hooks reach the readout.
    with torch.no_grad():
        shallow = protocol.condition_logits(tokens, "truncate", 1, via="hooks")
    assert (shallow - expected).abs().max() > 1e-3


def test_fast_path_equals_hook_path_for_every_condition(folder):
    model = BridgeModel.from_bridge(boot(folder))
    protocol, tokens = fitted_protocol(model)
    with torch.no_grad():
        for k in protocol.context.k_grid:
            for condition in ("full", *tuple(SWEEP)):
                if condition == "base_rate":  # no hook_logits on a bridge: no hook form
                    assert not protocol.condition(condition, k).realizable(model)
                    with pytest.raises(ValueError, match="no hook form"):
                        protocol.condition_logits(tokens, condition, k, via="hooks")
                    continue
                fast = protocol.condition_logits(tokens, condition, k)
                hooked = protocol.condition_logits(tokens, condition, k, via="hooks")
                assert (fast - hooked).abs().max() <= ATOL, (condition, k)


def test_protocol_runs_on_the_bridge_as_a_dense_negative_control(folder):
    model = BridgeModel.from_bridge(boot(folder)).train()
    evaluation, calibration = lm_sets(model)
    protocol = DepthControlProtocol(
        model,
        metrics=("cross_entropy", "kl_to_full"),
        n_bootstrap=50,
        probe_points=200,
        progress=False,
    )
    results = protocol.run(evaluation, calibration)
    assert model.training  # the protocol restores the mode it found
    assert results.architecture == "dense" and results.n_iterations == N_LAYERS
    assert results.replay_realizable is False
    assert results.null_control["max_abs_logit_diff"] <= ATOL
    assert results.null_control["shift_at_r_max_abs_logit_diff"] <= ATOL
    table = results.table()
    assert set(table["k"]) == {1, 2, 3} and table["gap"].notna().all()
    assert abs(table["S"] + table["B"] + table["D"] - table["gap"]).max() <= 1e-9
    kl = table.query("metric == 'kl_to_full'").set_index("k")["gap"]
    assert kl[3] == pytest.approx(0.0, abs=1e-6) and kl[1] > 0


def test_load_bridge_spec_boots_the_saved_folder(folder):
    model = load(f"bridge:{folder}")
    assert isinstance(model, BridgeModel) and not model.training
    assert model.cfg.n_ctx == 32 and model.cfg.d_vocab == len(model.tokenizer)
    tokens = model.to_tokens("the cat sat on the mat")
    assert tokens[0, 0] == model.tokenizer.bos_token_id
    reference = GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        assert (model(tokens) - reference(tokens).logits).abs().max() <= ATOL
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load(f"bridge:{folder / 'missing'}")


def test_from_hf_model_boots_a_model_built_in_memory(folder):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    hf_model = GPT2LMHeadModel(GPT2Config.from_pretrained(folder)).eval()
    model = BridgeModel.from_hf_model(hf_model, tokenizer)
    assert model.n_iterations == N_LAYERS and model.check_readout() <= ATOL
    with pytest.raises(ValueError, match="no tokenizer"):
        BridgeModel.from_hf_model(GPT2LMHeadModel(GPT2Config.from_pretrained(folder)))
    with pytest.raises(TypeError, match="wraps a transformer_lens TransformerBridge"):
        BridgeModel.from_bridge(hf_model)


def test_a_logit_transform_after_the_unembedding_is_applied_or_refused(folder):
    cap = 1.0

    def soft_cap(module, inputs, output):
        output.logits = cap * torch.tanh(output.logits / cap)
        return output

    bridge = boot(folder)
    bridge.original_model.register_forward_hook(soft_cap)
    with pytest.raises(ValueError, match="differs from the bridge's logits"):
        BridgeModel.from_bridge(bridge)
    # Declared as boot declares Gemma-2's final_logit_softcapping: the readout applies it.
    bridge.cfg.output_logits_soft_cap = cap
    model = BridgeModel.from_bridge(bridge)
    protocol, tokens = fitted_protocol(model)
    with torch.no_grad():
        expected = bridge(tokens)
        assert (
            protocol.condition_logits(tokens, "truncate", N_LAYERS) - expected
        ).abs().max() <= ATOL
