"""TransformerLens conformance: every public call a TransformerLens user makes on a model, run on
``default``, ``huginn_tiny`` and ``ouro_tiny``, either matches a reference it is checked against or
raises a `DCPLensError` saying what is unsupported and what to use instead.

The calls are enumerated from the library (``dir(ActivationCache)``, ``transformer_lens.patching``,
`WeightViews`), so a new public name fails `test_every_public_name_is_classified` until it
gets a check here. The outcome table is committed as ``docs/tl_conformance.md``; regenerate it
with ``python tests/integration/model/test_conformance.py --write``
(`test_the_committed_table_is_generated`).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor
from transformer_lens import patching
from transformer_lens import utilities as tl_utils
from transformer_lens.ActivationCache import ActivationCache
from transformer_lens.FactoredMatrix import FactoredMatrix

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from helpers import data_path  # noqa: E402
from tl_names import STATUSES, surface_table, tl_public_names  # noqa: E402

from dcp_lens import load  # noqa: E402
from dcp_lens.model import stream as stream_module  # noqa: E402
from dcp_lens.model.cache import RecurrentActivationCache  # noqa: E402
from dcp_lens.model.names import DepthMismatchError, PatchShapeError  # noqa: E402
from dcp_lens.model.weights import WeightViews  # noqa: E402
from dcp_lens.utils.errors import DCPLensError  # noqa: E402

ATOL = 1e-5
TABLE = Path(__file__).resolve().parents[3] / "docs" / "tl_conformance.md"
MODELS = {
    "default": lambda: load("default"),
    "huginn_tiny": lambda: load(f"huginn:{data_path('fixtures', 'huginn_tiny')}"),
    "ouro_tiny": lambda: load(f"ouro:{data_path('fixtures', 'ouro_tiny')}"),
}
# The utilities a user calls directly (the rest of transformer_lens.utilities is internal).
USER_UTILITIES = [
    "test_prompt",
    "get_act_name",
    "get_attention_mask",
    "lm_cross_entropy_loss",
    "lm_accuracy",
]
# Names in transformer_lens.patching that are not calls on a model.
NOT_CALLS = {"PatchingResult": "a result type, not a call"}


# ------------------------------------------------------------------------------- context


@dataclass
class Context:
    """One model with the inputs and caches every check reads (built once per model)."""

    name: str
    model: Any
    tokens: Tensor  # [2, pos] random ids
    logits: Tensor
    cache: RecurrentActivationCache
    clean: Tensor  # [1, 3] for patching
    corrupted: Tensor
    clean_cache: RecurrentActivationCache
    corrupted_cache: RecurrentActivationCache
    prompt: str  # text in the model's vocabulary
    memo: dict[str, Any] = field(default_factory=dict)

    @property
    def layer(self) -> int:
        """A core block in iteration 2: the block whose weights iteration 1 also used."""
        return self.model.block_index(2, 0)

    def metric(self, logits: Tensor) -> Tensor:
        return logits[0, -1, 3] - logits[0, -1, 5]


@functools.cache
def context(name: str) -> Context:
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, model.cfg.d_vocab, (2, 7), generator=generator)
    logits, cache = model.run_with_cache(tokens)
    clean = tokens[:1, :3]
    corrupted = clean.clone()
    corrupted[0, 0] = (corrupted[0, 0] + 7) % model.cfg.d_vocab
    _, clean_cache = model.run_with_cache(clean)
    _, corrupted_cache = model.run_with_cache(corrupted)
    symbols = getattr(model.tokenizer, "symbols", None)
    prompt = " ".join(symbols[5:9]) if symbols else "hello world"
    return Context(
        name, model, tokens, logits, cache, clean, corrupted, clean_cache, corrupted_cache, prompt
    )


def close(actual: Tensor, expected: Tensor, what: str, atol: float = ATOL) -> None:
    """``actual`` equals ``expected`` within ``atol`` (`ATOL`, the conformance tolerance)."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    difference = (actual.double() - expected.double()).abs()
    difference[actual == expected] = 0.0  # equal infinities (masked attention scores)
    error = difference.max().item() if actual.numel() else 0.0
    assert error <= atol, f"{what}: max abs difference {error:.3g} > {atol}"


def stream_at(ctx: Context, layer: int, mlp_input: bool = False) -> Tensor:
    """The stream a decomposition at ``layer`` must sum to, read from the cache by hand."""
    model, cache = ctx.model, ctx.cache
    if layer < model.cfg.n_layers:
        return cache[f"blocks.{layer}.hook_resid_{'mid' if mlp_input else 'pre'}"]
    if model.cfg.n_coda or model.is_dense:
        return cache[f"blocks.{layer - 1}.hook_resid_post"]
    if model.ln_pre_coda is not None:
        return cache["ln_pre_coda.hook_normalized"]
    return cache["hook_readout_in"]


def layers(ctx: Context) -> list[int]:
    n = ctx.model.cfg.n_layers
    return sorted({0, 1, ctx.layer, n - 1, n})


# ----------------------------------------------------------------------------- registry

CHECKS: dict[str, Callable[[Context], str]] = {}


def check(*names: str) -> Callable[[Callable[[Context], str]], Callable[[Context], str]]:
    """Register a check of one or more calls; it returns the reference it was checked against."""

    def decorator(function: Callable[[Context], str]) -> Callable[[Context], str]:
        for name in names:
            assert name not in CHECKS, f"{name} registered twice"
            CHECKS[name] = function
        return function

    return decorator


# ------------------------------------------------------------------------ ActivationCache


@check("ActivationCache.decompose_resid")
def _decompose_resid(ctx: Context) -> str:
    for layer in layers(ctx):
        for mlp_input in (False, True) if layer < ctx.model.cfg.n_layers else (False,):
            parts = ctx.cache.decompose_resid(layer, mlp_input=mlp_input)
            close(parts.sum(0), stream_at(ctx, layer, mlp_input), f"decompose_resid({layer})")
    attn = ctx.cache.decompose_resid(mode="attn", incl_embeds=False)
    mlp = ctx.cache.decompose_resid(mode="mlp", incl_embeds=False)
    rest = ctx.cache.decompose_resid().sum(0) - attn.sum(0) - mlp.sum(0)
    close(rest + attn.sum(0) + mlp.sum(0), stream_at(ctx, ctx.model.cfg.n_layers), "modes")
    return "components sum to the cached stream at every layer (resid_pre, resid_mid, final)"


@check("ActivationCache.get_full_resid_decomposition")
def _full_decomposition(ctx: Context) -> str:
    for layer in layers(ctx):
        for expand in (True, False):
            parts = ctx.cache.get_full_resid_decomposition(layer, expand_neurons=expand)
            close(parts.sum(0), stream_at(ctx, layer), f"full decomposition({layer}, {expand})")
    return "heads + neurons (or MLPs) + embeds + injections + bias sum to the stream"


@check("ActivationCache.accumulated_resid")
def _accumulated_resid(ctx: Context) -> str:
    model, cache = ctx.model, ctx.cache
    stack = cache.accumulated_resid(apply_ln=True)
    close(stack[-1] @ model.W_U + model.b_U, ctx.logits, "accumulated_resid(apply_ln)[-1]")
    plain = cache.accumulated_resid(incl_mid=True)
    n = model.cfg.n_layers
    close(plain[-1], stream_at(ctx, n), "final entry")
    close(plain[2 * ctx.layer], cache[f"blocks.{ctx.layer}.hook_resid_pre"], "resid_pre entry")
    bias = getattr(model.ln_final, "b", 0.0)
    entry = model.ln_final(cache[f"blocks.{ctx.layer}.hook_resid_pre"]) - bias
    close(stack[ctx.layer], entry, "ln_final less its bias")
    return (
        "final entry @ W_U + b_U = logits; entries are the cached streams (ln_final applied, "
        "its bias in b_U)"
    )


@check("ActivationCache.apply_ln_to_stack")
def _apply_ln(ctx: Context) -> str:
    cache, model = ctx.cache, ctx.model
    layer = ctx.layer
    scaled = cache.apply_ln_to_stack(cache.decompose_resid(layer), layer)
    x = cache[f"blocks.{layer}.hook_resid_pre"]
    if model.cfg.normalization_type == "LN":
        x = x - x.mean(-1, keepdim=True)
    close(scaled.sum(0), x / cache[f"blocks.{layer}.ln1.hook_scale"], "block input")
    final = cache.apply_ln_to_stack(cache.decompose_resid())
    direction = model.tokens_to_residual_directions(torch.arange(model.cfg.d_vocab))
    close(final.sum(0) @ direction.T + model.b_U, ctx.logits, "final stack -> logits")
    return "scaled components sum to the block's normalised input; final @ W_U + b_U = logits"


@check("ActivationCache.logit_attrs")
def _logit_attrs(ctx: Context) -> str:
    model, cache = ctx.model, ctx.cache
    targets = ctx.tokens
    attrs = cache.logit_attrs(cache.decompose_resid(), targets)
    expected = ctx.logits.gather(-1, targets[..., None])[..., 0]
    close(attrs.sum(0) + model.b_U[targets], expected, "sum of logit_attrs + b_U")
    wrong = (targets + 1) % model.cfg.d_vocab
    diff = cache.logit_attrs(cache.decompose_resid(), targets, incorrect_tokens=wrong)
    wrong_logit = ctx.logits.gather(-1, wrong[..., None])[..., 0]
    gap = model.b_U[targets] - model.b_U[wrong]
    close(diff.sum(0) + gap, expected - wrong_logit, "logit difference attribution")
    return "attributions of all components + b_U[token] = the token's logit"


@check("ActivationCache.stack_head_results")
def _stack_heads(ctx: Context) -> str:
    cache = ctx.cache
    for layer in layers(ctx)[1:]:
        heads = cache.stack_head_results(layer)
        attn = cache.decompose_resid(layer, mode="attn", incl_embeds=False)
        close(heads.sum(0), attn.sum(0), f"heads = attn outputs before {layer}")
        with_rest = cache.stack_head_results(layer, incl_remainder=True)
        close(with_rest.sum(0), stream_at(ctx, layer), "heads + remainder")
    return "heads sum to decompose_resid(mode='attn'); with the remainder, to the stream"


@check("ActivationCache.compute_head_results")
def _compute_heads(ctx: Context) -> str:
    cache = ctx.cache
    cache.compute_head_results()
    for index in range(ctx.model.cfg.n_layers):
        result = cache[f"blocks.{index}.attn.hook_result"]
        close(result.sum(-2), cache[f"blocks.{index}.hook_attn_out"], f"block {index} heads")
    return "hook_result summed over heads = hook_attn_out in every block"


def _mlp_biases(ctx: Context, layer: int) -> Tensor:
    """Sum of b_out over blocks < layer: valid where nothing rescales the stream after them."""
    model = ctx.model
    total = torch.zeros(model.cfg.d_model)
    for index in range(layer):
        b_out = getattr(model.blocks[index].mlp, "b_out", None)
        if b_out is not None:
            assert model.blocks[index].placement == "pre" and model.cfg.iteration_norm == "none"
            total = total + b_out
    return total


@check("ActivationCache.get_neuron_results")
def _neuron_results(ctx: Context) -> str:
    model, cache = ctx.model, ctx.cache
    for index in (0, ctx.layer):
        neurons = cache.get_neuron_results(index)
        b_out = getattr(model.blocks[index].mlp, "b_out", None)
        rest = 0 if b_out is None else b_out
        close(neurons.sum(-2) + rest, cache[f"blocks.{index}.hook_mlp_out"], "neurons")
    return "neuron results (+ b_out) sum to hook_mlp_out"


@check("ActivationCache.stack_neuron_results")
def _stack_neurons(ctx: Context) -> str:
    cache = ctx.cache
    layer = ctx.layer + 1
    neurons = cache.stack_neuron_results(layer)
    mlp = cache.decompose_resid(layer, mode="mlp", incl_embeds=False)
    close(neurons.sum(0) + _mlp_biases(ctx, layer), mlp.sum(0), "neurons = MLP outputs")
    with_rest = cache.stack_neuron_results(layer, incl_remainder=True)
    close(with_rest.sum(0), stream_at(ctx, layer), "neurons + remainder")
    return "neurons (+ b_out) sum to decompose_resid(mode='mlp'); with the remainder, the stream"


@check("ActivationCache.stack_activation")
def _stack_activation(ctx: Context) -> str:
    stacked = ctx.cache.stack_activation("resid_post")
    expected = torch.stack([ctx.cache[f"blocks.{i}.hook_resid_post"] for i in range(len(stacked))])
    close(stacked, expected, "stack_activation")
    return "equals the cached blocks.{i}.hook_resid_post stacked"


@check("ActivationCache.apply_slice_to_batch_dim")
def _slice_batch(ctx: Context) -> str:
    sliced = ctx.cache.apply_slice_to_batch_dim(1)
    assert isinstance(sliced, RecurrentActivationCache)
    for key in list(ctx.cache.keys())[:20]:
        close(sliced[key], ctx.cache[key][1], key)
    return "every entry equals the cached entry at that batch index"


@check("ActivationCache.remove_batch_dim")
def _remove_batch(ctx: Context) -> str:
    _, cache = ctx.model.run_with_cache(ctx.clean)
    kept = {key: value.clone() for key, value in cache.items()}
    cache.remove_batch_dim()
    assert not cache.has_batch_dim
    for key, value in kept.items():
        close(cache[key], value[0], key)
    return "every entry equals the batch-1 entry without its batch dim"


@check("ActivationCache.keys", "ActivationCache.values", "ActivationCache.items")
def _mapping(ctx: Context) -> str:
    cache = ctx.cache
    assert list(cache.keys()) == list(cache.cache_dict)
    assert all(a is b for a, b in zip(cache.values(), cache.cache_dict.values(), strict=True))
    assert all(cache.cache_dict[k] is v for k, v in cache.items())
    assert "loop.1.hook_state" in cache.keys() and f"blocks.{ctx.layer}.hook_resid_pre" in cache
    return "the recorded hook names and tensors, every iteration under its own name"


@check("ActivationCache.to")
def _to(ctx: Context) -> str:
    moved = ctx.cache.to("cpu")
    close(moved["hook_embed"], ctx.cache["hook_embed"], "to(cpu)")
    return "same tensors on the target device"


@check("ActivationCache.toggle_autodiff")
def _toggle(ctx: Context) -> str:
    before = torch.is_grad_enabled()
    try:
        ctx.cache.toggle_autodiff(False)
        assert not torch.is_grad_enabled()
        ctx.cache.toggle_autodiff(True)
        assert torch.is_grad_enabled()
    finally:
        torch.set_grad_enabled(before)
    return "torch.is_grad_enabled() follows the toggle"


@check("ActivationCache.ssm_layers")
def _ssm_layers(ctx: Context) -> str:
    assert ctx.cache.ssm_layers() == []
    return "[] (attention blocks only)"


def _must_refuse(name: str, call: Callable[[Context], Any]) -> Callable[[Context], str]:
    def run(ctx: Context) -> str:
        call(ctx)  # raises a DCPLensError; returning would leave a number unchecked
        raise AssertionError(f"{name} returned instead of refusing")

    return run


for _name, _call in {
    "ActivationCache.logit_lens": lambda ctx: ctx.cache.logit_lens(),
    "ActivationCache.compute_ssm_effective_attention": (
        lambda ctx: ctx.cache.compute_ssm_effective_attention()
    ),
    "ActivationCache.compute_ssm_state": lambda ctx: ctx.cache.compute_ssm_state(),
}.items():
    check(_name)(_must_refuse(_name, _call))


# ---------------------------------------------------------------------------- patching


def _hand_patch(ctx: Context, hook: str, where: tuple[Any, ...]) -> float:
    """The metric with ``clean_cache[hook][where]`` written into the corrupted run."""

    def patch(activation: Tensor, hook: Any) -> Tensor:
        activation = activation.clone()
        activation[where] = ctx.clean_cache[hook.name][where]
        return activation

    logits = ctx.model.run_with_hooks(ctx.corrupted, fwd_hooks=[(hook, patch)])
    return float(ctx.metric(logits))


def _index(ctx: Context, activation: str, axes: tuple[str, ...]) -> tuple[tuple, tuple]:
    """(index into the result, index into the activation) for the chosen layer/pos/head."""
    value = {"layer": ctx.layer, "pos": 1, "head": 1, "head_index": 1, "dest_pos": 2, "src_pos": 1}
    result = tuple(value[a] for a in axes)
    head_first = activation == "pattern"
    axes = tuple("head_index" if a == "head" else a for a in axes)
    if axes == ("layer", "pos"):
        act: tuple = (slice(None), 1)
    elif axes == ("layer", "head_index"):
        act = (slice(None), 1) if head_first else (slice(None), slice(None), 1)
    elif axes == ("layer", "pos", "head_index"):
        act = (slice(None), 1, 1)
    elif axes == ("layer", "head_index", "dest_pos"):
        act = (slice(None), 1, 2)
    else:
        assert axes == ("layer", "head_index", "dest_pos", "src_pos"), axes
        act = (slice(None), 1, 2, 1)
    return result, act


def _basic_patch(name: str) -> Callable[[Context], str]:
    def run(ctx: Context) -> str:
        function = getattr(patching, name)
        activation = function.keywords["activation_name"]
        axes = tuple(function.keywords["index_axis_names"])
        result = function(ctx.model, ctx.corrupted, ctx.clean_cache, ctx.metric)
        at, act = _index(ctx, activation, axes)
        hook = tl_utils.get_act_name(activation, ctx.layer)
        expected = _hand_patch(ctx, hook, act)
        assert abs(float(result[at]) - expected) <= ATOL, (name, float(result[at]), expected)
        ctx.memo[name] = result
        return f"entry {dict(zip(axes, at, strict=True))} = a hand-written patch of {hook}"

    return run


BASIC = sorted(
    n
    for n in dir(patching)
    if n.startswith("get_act_patch_")
    and isinstance(getattr(patching, n), functools.partial)
    and "activation_name" in getattr(patching, n).keywords
)
for _name in BASIC:
    check(f"patching.{_name}")(_basic_patch(_name))


def _stacked(ctx: Context, name: str, parts: list[str]) -> str:
    result = getattr(patching, name)(ctx.model, ctx.corrupted, ctx.clean_cache, ctx.metric)
    for i, part in enumerate(parts):
        if part not in ctx.memo:
            CHECKS[f"patching.{part}"](ctx)
        expected = torch.as_tensor(ctx.memo[part])
        if part.endswith("pattern_by_pos"):  # stacked as [layer, pos, head] beside the others
            expected = expected.transpose(-1, -2)
        close(torch.as_tensor(result[i]), expected, f"{name}[{i}]")
    return "stacks the checked " + ", ".join(p.removeprefix("get_act_patch_") for p in parts)


@check("patching.get_act_patch_block_every")
def _block_every(ctx: Context) -> str:
    parts = ["resid_pre", "attn_out", "mlp_out"]
    return _stacked(ctx, "get_act_patch_block_every", [f"get_act_patch_{p}" for p in parts])


@check("patching.get_act_patch_attn_head_all_pos_every")
def _head_all_pos_every(ctx: Context) -> str:
    parts = [f"get_act_patch_attn_head_{p}_all_pos" for p in ("out", "q", "k", "v", "pattern")]
    return _stacked(ctx, "get_act_patch_attn_head_all_pos_every", parts)


@check("patching.get_act_patch_attn_head_by_pos_every")
def _head_by_pos_every(ctx: Context) -> str:
    parts = [f"get_act_patch_attn_head_{p}_by_pos" for p in ("out", "q", "k", "v", "pattern")]
    return _stacked(ctx, "get_act_patch_attn_head_by_pos_every", parts)


@check("patching.generic_activation_patch")
def _generic(ctx: Context) -> str:
    result = patching.generic_activation_patch(
        ctx.model,
        ctx.corrupted,
        ctx.clean_cache,
        ctx.metric,
        patch_setter=patching.layer_pos_patch_setter,
        activation_name="resid_mid",
        index_axis_names=("layer", "pos"),
    )
    expected = _hand_patch(ctx, f"blocks.{ctx.layer}.hook_resid_mid", (slice(None), 1))
    assert abs(float(result[ctx.layer, 1]) - expected) <= ATOL
    return "entry (layer, pos) = a hand-written patch of resid_mid"


check("patching.get_act_patch_direct_path")(
    _must_refuse(
        "get_act_patch_direct_path",
        lambda ctx: patching.get_act_patch_direct_path(
            ctx.model, ctx.corrupted, ctx.clean_cache, ctx.corrupted_cache, ctx.metric, 0, 0
        ),
    )
)
check("patching.get_act_patch_direct_path_all_sources")(
    _must_refuse(
        "get_act_patch_direct_path_all_sources",
        lambda ctx: patching.get_act_patch_direct_path_all_sources(
            ctx.model, ctx.corrupted, ctx.clean_cache, ctx.corrupted_cache, ctx.metric
        ),
    )
)


SETTERS = {
    "layer_pos_patch_setter": ((2, 1), (slice(None), 1)),
    "layer_pos_head_vector_patch_setter": ((2, 1, 0), (slice(None), 1, 0)),
    "layer_head_vector_patch_setter": ((2, 1), (slice(None), slice(None), 1)),
    "layer_head_pattern_patch_setter": ((2, 1), (slice(None), 1)),
    "layer_head_pos_pattern_patch_setter": ((2, 1, 0), (slice(None), 1, 0)),
    "layer_head_dest_src_pos_pattern_patch_setter": ((2, 1, 0, 1), (slice(None), 1, 0, 1)),
}


def _setter(name: str) -> Callable[[Context], str]:
    def run(ctx: Context) -> str:
        index, where = SETTERS[name]
        generator = torch.Generator().manual_seed(1)
        corrupted, clean = torch.randn(2, 3, 3, 3, 3, generator=generator)
        expected = corrupted.clone()
        expected[where] = clean[where]
        patched = getattr(patching, name)(corrupted.clone(), index, clean)
        close(patched, expected, name)
        return "equals a hand-written index assignment"

    return run


for _name in SETTERS:
    check(f"patching.{_name}")(_setter(_name))


@check("patching.make_df_from_ranges")
def _df(ctx: Context) -> str:
    frame = patching.make_df_from_ranges([2, 3], ["layer", "pos"])
    assert [tuple(r) for r in frame.itertuples(index=False)] == list(
        itertools.product(range(2), range(3))
    )
    return "rows = itertools.product of the ranges"


# ---------------------------------------------------------------------------- utilities


@check("utilities.test_prompt")
def _test_prompt(ctx: Context) -> str:
    model = ctx.model
    prompt_tokens = model.to_tokens(ctx.prompt)
    answer = model.to_single_str_token(7)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        tl_utils.test_prompt(ctx.prompt, answer, model, prepend_space_to_answer=False)
    line = next(x for x in printed.getvalue().splitlines() if "Ranks of the answer" in x)
    ranks = ast.literal_eval(line.split(":", 1)[1].strip())
    answer_ids = model.to_tokens(answer, prepend_bos=False)
    logits = model(torch.cat([prompt_tokens, answer_ids], dim=1))[0, prompt_tokens.shape[1] - 1]
    expected = int((logits > logits[answer_ids[0, 0]]).sum())
    assert ranks[0][1] == expected, (ranks, expected)
    return "printed rank of the answer = its rank in the model's logits"


@check("utilities.get_act_name")
def _act_name(ctx: Context) -> str:
    name = tl_utils.get_act_name("resid_pre", ctx.layer)
    assert name == f"blocks.{ctx.layer}.hook_resid_pre" and name in ctx.cache
    assert tl_utils.get_act_name("pattern", 0) in ctx.cache
    return "names a hook the cache holds"


@check("utilities.get_attention_mask")
def _attention_mask(ctx: Context) -> str:
    model = ctx.model
    texts = [ctx.prompt, ctx.prompt.split()[0]]
    tokens, mask = model.to_tokens_with_mask(texts, prepend_bos=False)
    library = tl_utils.get_attention_mask(model.tokenizer, tokens, prepend_bos=False)
    assert torch.equal(library.bool(), mask), (library, mask)
    return "equals the mask to_tokens_with_mask pads with"


@check("utilities.lm_cross_entropy_loss")
def _loss(ctx: Context) -> str:
    loss = tl_utils.lm_cross_entropy_loss(ctx.logits, ctx.tokens)
    close(loss, ctx.model(ctx.tokens, return_type="loss"), "loss")
    return "equals model(tokens, return_type='loss')"


@check("utilities.lm_accuracy")
def _accuracy(ctx: Context) -> str:
    accuracy = tl_utils.lm_accuracy(ctx.logits, ctx.tokens)
    expected = (ctx.logits[:, :-1].argmax(-1) == ctx.tokens[:, 1:]).float().mean()
    close(torch.as_tensor(accuracy).float(), expected, "accuracy")
    return "equals argmax agreement with the next token"


# ------------------------------------------------------------------------------ model


@check("model.to_tokens", "model.to_string")
def _round_trip(ctx: Context) -> str:
    model = ctx.model
    tokens = model.to_tokens(ctx.prompt, prepend_bos=False)
    assert tokens.ndim == 2 and tokens.shape[1] >= 2
    assert (
        model.to_tokens(model.to_string(tokens[0]), prepend_bos=False).tolist() == tokens.tolist()
    )
    close(model(ctx.prompt), model(model.to_tokens(ctx.prompt)), "string input")
    return "text -> tokens -> text -> the same tokens; string input = token input"


@check("model.to_str_tokens", "model.to_single_token")
def _str_tokens(ctx: Context) -> str:
    model = ctx.model
    tokens = model.to_tokens(ctx.prompt, prepend_bos=False)[0]
    pieces = model.to_str_tokens(tokens)
    assert len(pieces) == len(tokens)
    for piece, token in zip(pieces, tokens.tolist(), strict=True):
        assert model.to_single_token(model.to_string([token])) == token
        assert piece == model.to_single_str_token(token)
    return "one piece per token; to_single_token(piece text) = the token"


def _greedy(ctx: Context, steps: int) -> Tensor:
    tokens = ctx.clean
    for _ in range(steps):
        next_token = ctx.model(tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, next_token], dim=1)
    return tokens


@check("model.generate")
def _generate(ctx: Context) -> str:
    expected = _greedy(ctx, 3)
    for kv in (True, False):
        assert torch.equal(ctx.model.generate(ctx.clean, 3, use_past_kv_cache=kv), expected)
    return "greedy (with and without the KV cache) = an argmax loop by hand"


@check("model.generate(top_p)")
def _top_p(ctx: Context) -> str:
    sampled = ctx.model.generate(ctx.clean, 3, do_sample=True, top_p=1e-6, seed=0)
    assert torch.equal(sampled, _greedy(ctx, 3))
    return "top_p -> 0 keeps only the most likely token: = greedy"


@check("model.generate(freq_penalty)")
def _freq_penalty(ctx: Context) -> str:
    sampled = ctx.model.generate(ctx.clean, 2, do_sample=True, top_p=1e-6, freq_penalty=1e4)
    counts = torch.bincount(ctx.clean[0], minlength=ctx.model.cfg.d_vocab).float()
    logits = ctx.model(ctx.clean)[0, -1] - 1e4 * counts
    assert int(sampled[0, 3]) == int(logits.argmax())
    return "the token sampled = argmax(logits - penalty x counts) by hand"


@check("model.run_with_cache(names_filter)")
def _names_filter(ctx: Context) -> str:
    _, cache = ctx.model.run_with_cache(ctx.tokens, names_filter=lambda n: "hook_state" in n)
    assert set(cache.keys()) == {k for k in ctx.cache.keys() if "hook_state" in k}
    close(cache["loop.2.hook_state"], ctx.cache["loop.2.hook_state"], "filtered")
    return "exactly the filtered names, same values"


@check("model.run_with_cache(remove_batch_dim)")
def _remove_batch_dim(ctx: Context) -> str:
    _, cache = ctx.model.run_with_cache(ctx.tokens[:1], remove_batch_dim=True)
    close(cache["hook_embed"], ctx.cache["hook_embed"][0], "remove_batch_dim")
    return "entries = the batched cache's row 0"


@check("model.run_with_cache(return_cache_object=False)")
def _plain_dict(ctx: Context) -> str:
    _, cache = ctx.model.run_with_cache(ctx.tokens, return_cache_object=False)
    assert type(cache) is dict and not isinstance(cache, ActivationCache)
    close(cache["loop.1.hook_state"], ctx.cache["loop.1.hook_state"], "plain dict")
    return "a dict of the same tensors"


@check("model.run_with_cache(n_iterations)")
def _n_iterations(ctx: Context) -> str:
    logits, cache = ctx.model.run_with_cache(ctx.tokens, n_iterations=2)
    close(logits, ctx.model(ctx.tokens, n_iterations=2), "logits")
    assert "loop.2.hook_state" in cache and "loop.3.hook_state" not in cache
    return "logits = model(tokens, n_iterations=k); states 0..k"


@check("model.forward(stop_at_layer)")
def _stop(ctx: Context) -> str:
    stream = ctx.model(ctx.tokens, stop_at_layer=ctx.layer)
    close(stream, ctx.cache[f"blocks.{ctx.layer}.hook_resid_pre"], "stop_at_layer")
    return "the cached blocks.{layer}.hook_resid_pre"


@check("model.forward(stop_at_layer, then start_at_layer)")
def _resume(ctx: Context) -> str:
    stream = ctx.model(ctx.tokens, stop_at_layer=ctx.layer)
    close(ctx.model(stream, start_at_layer=ctx.layer), ctx.logits, "resumed logits")
    return "resumed logits = the full forward's"


def _weight(name: str) -> Callable[[Context], str]:
    def run(ctx: Context) -> str:
        view = getattr(ctx.model, name)
        if isinstance(view, FactoredMatrix):
            left, right = (
                (ctx.model.W_Q, ctx.model.W_K.transpose(-2, -1))
                if name == "QK"
                else (ctx.model.W_V, ctx.model.W_O)
            )
            close(view.AB, left @ right, name)
            first, second = ctx.model.block_index(1, 0), ctx.layer
            close(view.AB[first], view.AB[second], "shared across iterations")
            return "FactoredMatrix; AB = the product of the stacked weights; shared per iteration"
        if name in MODEL_WIDE:
            return _model_wide(ctx, name, view)
        part = {"W_in": "mlp", "W_out": "mlp", "W_gate": "mlp", "b_in": "mlp", "b_out": "mlp"}
        module = part.get(name, "attn")
        weight = getattr(getattr(ctx.model.blocks[ctx.layer], module), name)
        if name in ("W_K", "W_V", "b_K") and weight.shape[0] != ctx.model.cfg.n_heads:
            weight = weight.repeat_interleave(ctx.model.cfg.n_heads // weight.shape[0], dim=0)
        close(view[ctx.layer], weight, name)
        close(view[ctx.model.block_index(1, 0)], view[ctx.layer], "shared across iterations")
        return "view[i] = blocks[i]'s weight; the core's equal at every iteration"

    return run


MODEL_WIDE = {"W_E", "W_U", "b_U", "W_pos"}  # one tensor for the model, not one per block


def _model_wide(ctx: Context, name: str, view: Tensor) -> str:
    model = ctx.model
    untied = model.W_U_untied if model.W_U_untied is not None else model.embed.W_E.T
    bias = getattr(model.ln_final, "b", None)
    expected = {
        "W_E": lambda: model.embed.W_E,
        "W_U": lambda: untied,
        "b_U": lambda: torch.zeros(model.cfg.d_vocab) if bias is None else bias @ untied,
        "W_pos": lambda: model.pos_embed.W_pos,
    }[name]()
    close(view, expected, name)
    return {
        "W_E": "= the embedding's W_E",
        "W_U": "= the unembedding (W_E^T where tied)",
        "b_U": "= ln_final.b @ W_U (zeros without a LayerNorm bias)",
        "W_pos": "= the learned position table",
    }[name]


WEIGHT_VIEWS = sorted(
    n for n, v in vars(WeightViews).items() if not n.startswith("_") and isinstance(v, property)
)
for _name in WEIGHT_VIEWS:
    check(f"model.{_name}")(_weight(_name))


@check("model.all_composition_scores")
def _composition(ctx: Context) -> str:
    model = ctx.model
    first, second = model.block_index(1, 0), ctx.layer
    for mode in ("Q", "K", "V"):
        scores = model.all_composition_scores(mode)
        ov = model.W_V[first, 1] @ model.W_O[first, 1]
        if mode == "V":
            right = model.W_V[second, 2] @ model.W_O[second, 2]
        else:
            right = model.W_Q[second, 2] @ model.W_K[second, 2].T
            right = right.T if mode == "K" else right
        expected = (ov @ right).norm() / ov.norm() / right.norm()
        close(scores[first, 1, second, 2].detach(), expected.detach(), f"{mode} score")
        assert float(scores[second, 2, first, 1]) == 0.0
    return "an entry = ||OV W|| / (||OV|| ||W||) by hand; zero where not earlier"


# --------------------------------------------------------------- workflows at realistic lengths
# Calls in the combinations TransformerLens's tutorials use them, on prompts of 32 tokens (the
# context allowing) and 16 generated: the invariants a patching or lens experiment relies on.

LONG, NEW = 32, 16


def long_tokens(ctx: Context, batch: int = 8, length: int = LONG) -> Tensor:
    """[batch, length] random ids, length capped by the model's context."""
    length = min(length, ctx.model.cfg.n_ctx)
    generator = torch.Generator().manual_seed(5)
    return torch.randint(2, ctx.model.cfg.d_vocab, (batch, length), generator=generator)


@check("workflow.prefix_invariance")
def _prefix(ctx: Context) -> str:
    tokens = long_tokens(ctx, batch=4)
    full = ctx.model(tokens)
    for p in range(1, tokens.shape[1] + 1):
        # float32 logits of order 10 through kernels that tile by length: a few ulps apart.
        prefix = ctx.model(tokens[:, :p])
        close(full[:, :p], prefix, f"model(t)[:, :{p}] vs model(t[:, :{p}])", atol=5 * ATOL)
    with ctx.model.iterations(6):
        deeper = ctx.model(tokens)
        prefix = ctx.model(tokens[:, :9])
        close(deeper[:, :9], prefix, "prefix under model.iterations(6)", atol=5 * ATOL)
    return f"model(t)[:, :p] = model(t[:, :p]) for every p <= {tokens.shape[1]}, and at k = 6"


@check("workflow.generate_kv_equals_no_kv")
def _generate_long(ctx: Context) -> str:
    model = ctx.model
    prompt = long_tokens(ctx, length=min(LONG, model.cfg.n_ctx - NEW))
    with_cache = model.generate(prompt, NEW, use_past_kv_cache=True)
    assert torch.equal(with_cache, model.generate(prompt, NEW, use_past_kv_cache=False))
    tokens = prompt
    for _ in range(NEW):  # the argmax loop by hand
        tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(with_cache, tokens)
    with model.iterations(6):
        a = model.generate(prompt[:2], 4, use_past_kv_cache=True)
        assert torch.equal(a, model.generate(prompt[:2], 4, use_past_kv_cache=False))
    return (
        f"{prompt.shape[0]} prompts of {prompt.shape[1]} tokens, {NEW} new: KV = no KV = an "
        "argmax loop by hand (also at k = 6)"
    )


@check("workflow.test_prompt_ranks")
def _test_prompt_long(ctx: Context) -> str:
    model = ctx.model
    prompt = ctx.prompt  # repeated up to LONG tokens, the context allowing (and the answer)
    while len(model.to_tokens(prompt)[0]) < LONG:
        longer = prompt + " " + ctx.prompt
        if len(model.to_tokens(longer)[0]) > model.cfg.n_ctx - 2:
            break
        prompt = longer
    prompt_tokens = model.to_tokens(prompt)
    answer = model.to_single_str_token(7)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        tl_utils.test_prompt(prompt, answer, model, prepend_space_to_answer=False)
    line = next(x for x in printed.getvalue().splitlines() if "Ranks of the answer" in x)
    ranks = ast.literal_eval(line.split(":", 1)[1].strip())
    logits = model(prompt_tokens)[0, -1]  # the prompt alone: its last position
    expected = int((logits > logits[7]).sum())
    assert ranks[0][1] == expected, (ranks, expected)
    return f"a {prompt_tokens.shape[1]}-token prompt: printed rank = its rank in model(prompt)"


@check("workflow.full_patch_gives_clean")
def _full_patch(ctx: Context) -> str:
    model = ctx.model
    clean = long_tokens(ctx, batch=2)
    corrupted = clean.clone()
    corrupted[:, [1, clean.shape[1] // 2]] += 1
    logits, cache = model.run_with_cache(clean)
    names = ["hook_embed", "loop.0.hook_state"]
    names += ["hook_pos_embed"] if model.pos_embed is not None else []

    def restore(activation: Tensor, hook: Any) -> Tensor:
        return cache[hook.name]

    patched = model.run_with_hooks(corrupted, fwd_hooks=[(n, restore) for n in names])
    # Against the clean run's own forward: the cached run materialises the attention pattern,
    # the patched run takes the fused kernel, which rounds differently (about 1e-5).
    close(patched, model(clean), "every position's embeddings and s_0 patched from clean")
    assert (model(corrupted) - logits).abs().max() > 1e-3  # the corruption mattered
    return "clean embeddings and s_0 at every position in the corrupted run = the clean logits"


@check("workflow.batch_order_padding_invariance")
def _batch(ctx: Context) -> str:
    model = ctx.model
    tokens = long_tokens(ctx)
    logits = model(tokens)
    order = torch.tensor([5, 2, 7, 0, 1, 6, 3, 4])
    close(model(tokens[order]), logits[order], "shuffled batch")
    close(model(tokens[3:4]), logits[3:4], "one example alone")
    cut = tokens.shape[1] - 6
    padded = torch.cat([tokens[:, :cut], torch.zeros_like(tokens[:, cut:])], dim=1)
    close(model(padded)[:, :cut], logits[:, :cut], "right padding")
    return "an example's logits do not depend on its batch, order or right padding"


@check("workflow.left_padding_with_attention_mask")
def _left_padding(ctx: Context) -> str:
    model = ctx.model
    tokens = long_tokens(ctx, batch=2, length=min(LONG, model.cfg.n_ctx - 3))
    short = tokens[1:, : tokens.shape[1] // 2]
    pads = tokens.shape[1] - short.shape[1]
    padded = torch.cat([tokens[:1], torch.cat([torch.zeros_like(tokens[1:, :pads]), short], 1)])
    mask = torch.ones_like(padded, dtype=torch.bool)
    mask[1, :pads] = False
    logits, cache = model.run_with_cache(padded, attention_mask=mask)
    alone_logits, alone = model.run_with_cache(short)
    close(logits[1, pads:], alone_logits[0], "the left-padded row's logits")
    close(logits[:1], model(tokens[:1]), "the unpadded row's logits")
    for name in (model.state_hook_name(0), model.state_hook_name(model.n_iterations)):
        close(cache[name][1, pads:], alone[name][0], name)
    continued = model.generate(padded, 3, attention_mask=mask)[1, pads:]
    assert torch.equal(continued, model.generate(short, 3)[0]), "generate with the mask"
    return (
        "a left-padded row with attention_mask = its tokens alone (logits, s_0, the last "
        "state, 3 generated tokens), in one masked pass"
    )


def _answers(ctx: Context) -> tuple[Tensor, Tensor, Tensor, RecurrentActivationCache]:
    tokens = long_tokens(ctx, batch=2)
    logits, cache = ctx.model.run_with_cache(tokens)
    return tokens, logits, torch.tensor([3, 9]), cache


@check("workflow.logit_difference_lens")
def _logit_diff(ctx: Context) -> str:
    model = ctx.model
    tokens, logits, answers, cache = _answers(ctx)
    direction = model.tokens_to_residual_directions(answers[0]) - (
        model.tokens_to_residual_directions(answers[1])
    )
    stack = cache.accumulated_resid(apply_ln=True)
    difference = logits[..., answers[0]] - logits[..., answers[1]]
    gap = model.b_U[answers[0]] - model.b_U[answers[1]]
    close(stack[-1] @ direction + gap, difference, "accumulated_resid(apply_ln=True) @ dirs")
    close(stack[-1] @ model.W_U + model.b_U, logits, "accumulated_resid(apply_ln)[-1] @ W_U")
    return (
        "accumulated_resid(apply_ln=True)[-1] @ (dir(a) - dir(b)) + b_U[a] - b_U[b] = the "
        "logit difference"
    )


@check("workflow.apply_ln_to_stack_then_directions")
def _ln_stack(ctx: Context) -> str:
    model = ctx.model
    tokens, logits, answers, cache = _answers(ctx)
    parts = cache.apply_ln_to_stack(cache.decompose_resid(), layer=-1)
    direction = model.tokens_to_residual_directions(answers)  # [2, d_model]
    attributed = (parts.sum(0) @ direction.T) + model.b_U[answers]
    close(attributed, logits[..., answers], "apply_ln_to_stack(layer=-1) @ directions + b_U")
    return "decompose_resid -> apply_ln_to_stack(layer=-1) @ directions + b_U = the logits"


@check("workflow.head_and_neuron_attribution_plus_b_U")
def _attribution(ctx: Context) -> str:
    model = ctx.model
    tokens, logits, answers, cache = _answers(ctx)
    direction = model.tokens_to_residual_directions(answers[0])
    target = logits[..., answers[0]]
    heads = cache.stack_head_results(layer=-1, incl_remainder=True, apply_ln=True)
    close((heads @ direction).sum(0) + model.b_U[answers[0]], target, "heads + remainder + b_U")
    neurons = cache.stack_neuron_results(layer=-1, incl_remainder=True, apply_ln=True)
    close((neurons @ direction).sum(0) + model.b_U[answers[0]], target, "neurons + rest + b_U")
    assert (heads[:-1] @ direction).abs().sum() > 0
    return "per-head and per-neuron attributions (with the remainder) + b_U = the logit"


@check("workflow.patching_inside_another_view")
def _patch_deeper(ctx: Context) -> str:
    model = ctx.model
    if model.is_dense:
        return "dense model: no other depth"
    with model.iterations(6):
        _, clean_cache = model.run_with_cache(ctx.clean)
        result = patching.get_act_patch_resid_pre(model, ctx.corrupted, clean_cache, ctx.metric)
        layer = model.block_index(6, 0)
        hook = f"blocks.{layer}.hook_resid_pre"

        def patch(activation: Tensor, hook: Any) -> Tensor:
            activation = activation.clone()
            activation[:, 1] = clean_cache[hook.name][:, 1]
            return activation

        expected = ctx.metric(model.run_with_hooks(ctx.corrupted, fwd_hooks=[(hook, patch)]))
        assert abs(float(result[layer, 1]) - float(expected)) <= ATOL
    return "inside model.iterations(6), a cache recorded there: entry = a hand patch at k = 6"


@check("workflow.mixed_depths_say_so")
def _mixed(ctx: Context) -> str:
    model = ctx.model
    if model.is_dense:
        return "dense model: one depth only"
    r = model.n_iterations
    with model.iterations(r + 2):
        try:
            patching.get_act_patch_resid_pre(model, ctx.corrupted, ctx.clean_cache, ctx.metric)
        except DepthMismatchError as error:
            assert f"k = {r}" in str(error) and f"k = {r + 2}" in str(error), error
        else:
            raise AssertionError("a cache of another depth was used silently")
    deeper = f"blocks.{model.cfg.layers_for(r + 2) - 1}.hook_resid_pre"
    try:
        model.run_with_hooks(ctx.clean, fwd_hooks=[(deeper, lambda a, hook: a)])
    except DepthMismatchError as error:
        assert f"k = {r}" in str(error) and "model.iterations" in str(error), error
    else:
        raise AssertionError("a hook name of another depth was accepted")
    longer = long_tokens(ctx, batch=1, length=12)
    _, long_cache = model.run_with_cache(longer)
    name = model.hook_name(2, 0, "hook_resid_pre")
    try:
        model.run_with_hooks(ctx.clean, fwd_hooks=[(name, lambda a, hook: long_cache[hook.name])])
    except PatchShapeError as error:
        assert name in str(error) and "(1, 12," in str(error) and "(1, 3," in str(error)
    else:
        raise AssertionError("a patch of another shape was accepted")
    return (
        "a cache or hook name of another depth, or a patch of another shape: a DCPLensError "
        "naming both depths (or shapes) and the fix"
    )


# -------------------------------------------------------------------------------- runner

_OUTCOMES: dict[tuple[str, str], tuple[str, str]] = {}


def outcome(call: str, model: str) -> tuple[str, str]:
    """("checked", reference) or ("refused", the DCPLensError's first sentence)."""
    key = (call, model)
    if key not in _OUTCOMES:
        ctx = context(model)
        try:
            with torch.no_grad():
                result = ("checked", CHECKS[call](ctx))
        except DCPLensError as error:
            result = ("refused", f"{type(error).__name__}: {error}")
        _OUTCOMES[key] = result
    return _OUTCOMES[key]


def public_names() -> list[str]:
    """Every call the suite must classify, found from the libraries themselves."""
    inherited = set(dir(object))  # nnsight, once imported, mounts `save` on every object
    cache = [
        f"ActivationCache.{n}"
        for n in dir(ActivationCache)
        if not n.startswith("_") and n not in inherited
    ]
    found = [
        f"patching.{n}"
        for n in dir(patching)
        if not n.startswith("_")
        and n not in NOT_CALLS
        and callable(getattr(patching, n))
        and (
            isinstance(getattr(patching, n), functools.partial)
            or getattr(getattr(patching, n), "__module__", "") == patching.__name__
        )
    ]
    assert all(hasattr(tl_utils, n) for n in USER_UTILITIES)
    utilities = [f"utilities.{n}" for n in USER_UTILITIES]
    views = [f"model.{n}" for n in WEIGHT_VIEWS]
    return sorted(cache) + sorted(found) + utilities + views


def conformance_table() -> str:
    """The markdown table of every call on every model."""
    names = list(CHECKS)
    lines = [
        "# TransformerLens conformance",
        "",
        "Generated by `python tests/integration/model/test_conformance.py --write`",
        "(do not edit). Every call either matched the reference named (within 1e-5) or raised a",
        "`DCPLensError` (its message shown).",
        "",
        "| call | " + " | ".join(MODELS) + " |",
        "|---|" + "---|" * len(MODELS),
    ]
    counts = {m: {"checked": 0, "refused": 0} for m in MODELS}
    for name in names:
        cells = []
        for model in MODELS:
            kind, text = outcome(name, model)
            counts[model][kind] += 1
            cells.append(f"{kind}: {text}".replace("|", "\\|").replace("\n", " "))
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    lines += ["", "| model | checked | refused |", "|---|---|---|"]
    lines += [f"| {m} | {c['checked']} | {c['refused']} |" for m, c in counts.items()]
    return "\n".join(lines + surface_section()) + "\n"


def refusal_message(name: str) -> str:
    """The message a refused ``model.{name}`` raises on ``default``."""
    try:
        getattr(context("default").model, name)("gpt2")
    except DCPLensError as error:
        return str(error)
    raise AssertionError(f"model.{name} did not refuse")


def surface_section() -> list[str]:
    """Every public name of TransformerLens's user-facing classes and modules (enumerated from
    the installed library by ``tests/tl_names.py``), with its status."""
    table = surface_table(set(CHECKS))
    counts = {status: 0 for status in STATUSES}
    rows = []
    for name, (status, note) in table.items():
        counts[status] += 1
        if status == "refused" and not note:
            note = refusal_message(name.rsplit(".", 1)[1])
        elif status == "conformance":
            note = f"row `{name}` above" if name in CHECKS else "the model's rows above"
        rows.append(f"| `{name}` | {status} | {note} |".replace("\n", " "))
    lines = [
        "",
        "## Every public TransformerLens name",
        "",
        "Every public method, property and function of the TransformerLens classes and modules "
        "a user reaches through a dcp-lens model (`HookedRootModule`, `TransformerBridge` (the "
        "successor of `HookedTransformer`), `ActivationCache`, `FactoredMatrix`, "
        "`SVDInterpreter`, `patching`, `utilities`, `evals`, `head_detector`, `tools.analysis`), "
        "enumerated from the installed library. A status says:",
        "",
    ]
    lines += [
        f"- **{status}**: {meaning} ({counts[status]} names)"
        for status, meaning in STATUSES.items()
    ]
    lines += ["", "| name | status | reference or way out |", "|---|---|---|", *rows]
    return lines


# --------------------------------------------------------------------------------- tests


def test_every_transformer_lens_name_is_in_the_surface_table() -> None:
    """Fast: a public name TransformerLens grows fails here until it is classified."""
    table = surface_table(set(CHECKS))
    missing = [name for name in tl_public_names() if name not in table]
    assert not missing, f"TransformerLens names with no row in tests/tl_names.py: {missing}"
    unchecked = [n for n, (s, _) in table.items() if s == "conformance" and n not in CHECKS]
    assert not unchecked, f"rows marked conformance with no check here: {unchecked}"
    assert len(table) >= 250


def test_every_public_name_is_classified() -> None:
    """Fast: the classification itself, from dir() of the classes and modules."""
    missing = [name for name in public_names() if name not in CHECKS]
    assert not missing, f"public calls with no conformance check: {missing}"
    assert {"patching.get_act_patch_resid_pre", "ActivationCache.decompose_resid"} <= set(CHECKS)
    assert len(BASIC) >= 15, BASIC  # with the 3 *_every, generic and direct path: 20


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("call", list(CHECKS))
def test_call_is_checked_or_refused(call: str, model: str) -> None:
    kind, text = outcome(call, model)
    assert kind in ("checked", "refused") and text


@pytest.mark.parametrize(
    "call",
    [
        "ActivationCache.decompose_resid",
        "ActivationCache.get_full_resid_decomposition",
        "ActivationCache.logit_attrs",
        "ActivationCache.accumulated_resid",
        "workflow.logit_difference_lens",
        "workflow.apply_ln_to_stack_then_directions",
        "workflow.head_and_neuron_attribution_plus_b_U",
        "workflow.full_patch_gives_clean",
        "workflow.mixed_depths_say_so",
    ],
)
@pytest.mark.parametrize("model", list(MODELS))
def test_decompositions_are_checked_not_refused(call: str, model: str) -> None:
    assert outcome(call, model)[0] == "checked"


@pytest.mark.parametrize("model", list(MODELS))
def test_a_dropped_component_fails_the_check(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    original = stream_module.StreamWalk.components

    def drop_one(self: Any, point: Any) -> Any:
        """The components less one: the first re-injection, else the last of two or more."""
        sources, values = original(self, point)
        injected = [i for i, s in enumerate(sources) if s.kind == "inject"]
        dropped = injected[0] if injected else (len(sources) - 1 if len(sources) > 1 else None)
        keep = [i for i in range(len(sources)) if i != dropped]
        return [sources[i] for i in keep], [values[i] for i in keep]

    monkeypatch.setattr(stream_module.StreamWalk, "components", drop_one)
    with pytest.raises(AssertionError, match="decompose_resid"):
        CHECKS["ActivationCache.decompose_resid"](context(model))


@pytest.mark.parametrize("spec", ["default", "planted:readout_shift", "huginn"])
def test_every_load_takes_a_dtype_and_carries_a_tokenizer(spec: str) -> None:
    if spec == "huginn":
        spec = f"huginn:{data_path('fixtures', 'huginn_tiny')}"
    model = load(spec, dtype=torch.float64)
    assert model.W_E.dtype == torch.float64
    ids = torch.arange(3, 9)
    text = model.to_string(ids)
    assert model.to_tokens(text, prepend_bos=False)[0].tolist() == ids.tolist()
    assert len(model.to_str_tokens(ids)) == len(ids)


@pytest.mark.slow
def test_the_committed_table_is_generated() -> None:
    assert TABLE.read_text() == conformance_table(), (
        "docs/tl_conformance.md is stale; run "
        "python tests/integration/model/test_conformance.py --write"
    )


if __name__ == "__main__" and "--write" in sys.argv:
    TABLE.write_text(conformance_table())
    print(f"wrote {TABLE}")
