"""TransformerLens's public surface, enumerated from the installed library: `tl_public_names`."""

from __future__ import annotations

import functools
import inspect
from types import ModuleType

from torch import nn
from transformer_lens import (
    ActivationCache,
    FactoredMatrix,
    HookedRootModule,
    SVDInterpreter,
    TransformerBridge,
    evals,
    head_detector,
    patching,
)
from transformer_lens import utilities as tl_utilities
from transformer_lens.tools import analysis


def _class_names(cls: type, label: str) -> list[str]:
    # object's names too: nnsight, once imported, mounts `save` on every object.
    module_names = set(dir(nn.Module) if issubclass(cls, nn.Module) else dir(object))
    return [f"{label}.{n}" for n in dir(cls) if not n.startswith("_") and n not in module_names]


def _module_names(module: ModuleType, label: str) -> list[str]:
    """Public functions and classes defined in ``module`` (or its submodules), and partials."""
    found = []
    exported = getattr(module, "__all__", None)
    for name in exported if exported is not None else dir(module):
        value = getattr(module, name, None)
        if name.startswith("_") or value is None or not callable(value):
            continue
        home = getattr(value, "__module__", "") or ""
        if isinstance(value, functools.partial) or home.startswith(module.__name__):
            found.append(f"{label}.{name}")
    return found


def tl_public_names() -> list[str]:
    """Every public name a user of a TransformerLens model reaches, introspected: the model's
    methods and properties (`HookedRootModule` and `TransformerBridge`, the successor of
    HookedTransformer), `ActivationCache`, `FactoredMatrix`, `SVDInterpreter`, and the functions
    of ``patching``, ``utilities``, ``evals``, ``head_detector`` and ``tools.analysis``."""
    names = set(_class_names(HookedRootModule, "model"))
    names |= set(_class_names(TransformerBridge, "model"))
    names |= set(_class_names(ActivationCache, "ActivationCache"))
    names |= {n for n in _class_names(FactoredMatrix, "FactoredMatrix")}
    names |= set(_class_names(SVDInterpreter, "SVDInterpreter"))
    for module, label in [
        (patching, "patching"),
        (tl_utilities, "utilities"),
        (evals, "evals"),
        (head_detector, "head_detector"),
        (analysis, "tools.analysis"),
    ]:
        names |= set(_module_names(module, label))
    return sorted(names)


def is_static(name: str) -> bool:
    """Whether ``model.{name}`` is a static method on TransformerLens's bridge."""
    attribute = inspect.getattr_static(TransformerBridge, name.split(".", 1)[1], None)
    return isinstance(attribute, staticmethod)


# ------------------------------------------------------------------------------- the table
# status -> what it means (the generated docs print this legend).
STATUSES = {
    "conformance": "checked against a reference on default, huginn_tiny and ouro_tiny: a row "
    "of the per-model table above",
    "checked": "checked against the reference named, in tests/integration/model/test_tl_surface.py "
    "or test_tl_tools.py",
    "refused": "raises a DCPLensError whose message names what to use instead (shown)",
    "inherited": "TransformerLens's own HookedRootModule code, run unchanged on this model's "
    "hook points (every patching row above goes through it)",
    "independent": "takes no model (tensors, devices, files, result types): TransformerLens's "
    "own code, unaffected by dcp-lens",
}
_HOOKED_ROOT = (
    "add_caching_hooks add_hook add_perma_hook cache_all cache_some check_and_add_hook "
    "check_hooks_to_add clear_contexts get_caching_hooks hook_dict hook_points hooks list_hooks "
    "mod_dict remove_all_hook_fns reset_hooks run_with_hooks setup"
).split()
_CONFORMANCE_MODEL = (
    "OV QK W_E W_K W_O W_Q W_U W_V W_gate W_in W_out W_pos b_K b_Q b_U b_in b_out "
    "all_composition_scores generate to_tokens to_string to_str_tokens to_single_token"
).split()
_CHECKED_MODEL = {
    "run_with_cache": "test_conformance's run_with_cache rows: names_filter, remove_batch_dim, …",
    "unembed": "unembed(accumulated_resid(apply_ln=True)[-1]) = the logits",
    "tl_parameters": "blocks.{i}.attn.W_V of every unrolled block = that block's weight",
    "tl_named_parameters": "the same names and tensors as tl_parameters()",
    "refactor_factored_attn_matrices": "QK, OV and logits unchanged; factors balanced",
    "fold_value_biases": "no b_V or b_O: weights and logits unchanged",
    "set_use_attn_result": "False accepted; True refused naming compute_head_results()",
    "set_use_hook_mlp_in": "False accepted; True refused naming ln2.hook_normalized",
    "set_use_split_qkv_input": "False accepted; True refused (conformance: direct path rows)",
    "set_use_attn_in": "False accepted; True refused naming ln1.hook_normalized",
    "W_E_pos": "= cat(W_E, W_pos); refused on rotary models",
    "all_head_labels": "L{i}H{h} for every head of every unrolled block",
    "attn_head_labels": "= all_head_labels (every block has attention)",
    "n_params_total": "= the numel of every tensor stored once",
    "hook_aliases": "{} (no hook point has a second name)",
    "original_model": "None (no wrapped Hugging Face model; TransformerLens's tools read it)",
    "QK_for_attn_layers": "(every block index, model.QK)",
    "OV_for_attn_layers": "(every block index, model.OV)",
    "composition_layer_indices": "every block index",
    "block_hooks": "= the hook_dict names under blocks.{i}.",
    "block_submodules": "= blocks[i]'s child modules that are not hook points",
    "blocks_with": "(i, blocks[i]) for every block with that submodule",
    "get_hook_point": "= hook_dict[name]; None for an unknown name",
    "loss_fn": "= model(tokens, return_type='loss'); with attention_mask = TransformerLens's "
    "lm_cross_entropy_loss and the masked forward's loss",
    "init_weights": "two models of one config agree after init_weights()",
    "accumulated_bias": "= the sum of b_out over earlier blocks (pre-norm)",
    "tokens_to_residual_directions": "conformance workflow rows: directions @ stack + b_U",
    "to_single_str_token": "conformance to_str_tokens row: one piece per token",
    "get_token_position": "the position of a token found in to_tokens(prompt)",
    "tokenizer": "conformance to_tokens rows (the model's own tokenizer)",
    "b_O": "refused: WeightViewError, the output projection has no bias",
    "b_V": "refused: WeightViewError, the value projection has no bias",
}
_REFUSED_MODEL = (
    "boot_transformers boot_native boot_tl_legacy list_supported_models "
    "check_model_support enable_compatibility_mode process_weights get_params stack_params_for "
    "layer_types input_to_embed generate_stream hf_generate diffusion_generate encoder_output "
    "predict_next_sentence to_sentence_pair_tokens prepare_multimodal_inputs "
    "clear_hook_registry close mps"
).split()
_CHECKED_FUNCTIONS = {
    "SVDInterpreter.get_singular_vectors": "OV and w_in vectors of two iterations' blocks = an "
    "SVD of that block's weights by hand",
    "tools.analysis.direct_logit_attribution": "attributions by component and by head + b_U = "
    "the logit",
    "head_detector.detect_head": "= compute_head_attention_similarity_score of each cached "
    "pattern by hand",
    "evals.induction_loss": "= the per-token loss of model on the repeated half, by hand",
    "evals.evaluate_on_dataset": "= the mean of model(batch, return_type='loss') by hand",
    "utilities.move_to_and_update_config": "cfg.dtype and the weights follow; logits of a model "
    "built in that dtype",
    "utilities.get_device_for_block_index": "= the model's device on one device",
}
_REFUSED_FUNCTIONS = {
    "tools.analysis.logit_lens": "dcp_lens.lenses.logit_lens(model, tokens)",
    "tools.analysis.logit_readout": "model.unembed(cache.accumulated_resid(apply_ln=True)[-1])",
    "tools.analysis.get_act_patch_direct_path": "the patching row above (same function)",
    "tools.analysis.get_act_patch_direct_path_all_sources": "the patching row above",
}
RESULT_TYPES = {"patching.PatchingResult"}  # classes in a model kind that take no model
_LOCAL = "with the data set in the local Hugging Face cache"
_OFFLINE = (
    "; with no cache and no network, datasets raises ConnectionError (OfflineModeIsEnabled) "
    "before the model runs: pass your own rows to evaluate_on_dataset"
)
_CHECKED_FUNCTIONS |= {
    "utilities.tokenize_and_concatenate": "= the texts' ids joined by EOS, cut into rows, BOS "
    "first (a tokenizer with no EOS: TransformerLens's assertion says so)",
    "utilities.get_input_with_manually_prepended_bos": "= bos_token + each text; a dcp-lens "
    "tokenizer reads that text as characters, not as the BOS id: use to_tokens(text, "
    "prepend_bos=True)",
    "utilities.get_tokens_with_bos_removed": "= tokens[:, 1:] (BOS first, right padding)",
    "utilities.get_tokenizer_with_bos": "the tokenizer itself (it prepends BOS, or has none); "
    "one with a BOS it does not prepend is refused naming to_tokens(..., prepend_bos=True)",
    "evals.IOIDataset": "prompt = BOS + encode(text); a task vocabulary names the symbols it lacks",
    "evals.ioi_eval": "logit difference and accuracy = one forward per prompt by hand",
    "evals.sanity_check": "= model(to_tokens(its text), return_type='loss')",
    "evals.mmlu_eval": f"{_LOCAL}: accuracy = the likeliest answer letter by hand (offline, "
    "TransformerLens loads no question and says so)",
    "evals.evaluate": f"{_LOCAL}: each loss = the mean loss of its rows by hand (its "
    f"evaluate_on_dataset runs on device 'cuda'){_OFFLINE}",
    "tools.analysis.attention_head_subspace_affinity": "= the squared Frobenius norm of U_Oᵀ "
    "U_role, orthonormal bases of the stored W_O and W_Q/W_K/W_V of each unrolled block, by "
    "hand (weights as stored: norm weights not folded in)",
    "tools.analysis.attribution_patch": "node scores = (a_clean - a_corrupt) · grad on the "
    "corrupt run by hand; edge granularity refused (use_attn_result)",
    "tools.analysis.collect_activations": "= the cached hook at each example's position",
    "tools.analysis.run_with_intervention": "= the forward patched by hand in the subspace",
    "tools.analysis.intervened_logits": "= the forward patched by hand in the subspace",
    "tools.analysis.fit_das": "its loss at lr=0 = the cross-entropy of the hand-patched forward",
}
for _name in ("code", "owt", "pile", "wiki"):
    _CHECKED_FUNCTIONS[f"evals.make_{_name}_data_loader"] = (
        f"{_LOCAL}: rows = tokenize_and_concatenate by the model's tokenizer{_OFFLINE}"
    )
_REFUSED_FUNCTIONS |= {
    "tools.analysis.faithfulness": "per-head outputs come from the cache: "
    "cache.compute_head_results(); patch blocks.{i}.attn.hook_z per head",
    "tools.analysis.reinitialized": "HookedRecurrentTransformer(dataclasses.replace(model.cfg, "
    "seed=seed)), a fresh model of the same architecture",
}
# Functions of tools.analysis that take tensors, not a model (the model-taking ones that
# consume them are checked above), and TransformerLens's own model-name loaders.
_INDEPENDENT_FUNCTIONS = {
    "tools.analysis.random_init_bridge": "boots a Hugging Face model by name; for a dcp-lens "
    "model see reinitialized's row",
    "evals.make_mmlu_data_loader": "loads MMLU questions, takes no model or tokenizer",
    "tools.analysis.SubspaceInterchange": "the intervention of the run_with_intervention row",
    **{
        f"tools.analysis.{name}": "a configuration, node, basis or result type: no model"
        for name in (
            "EdgeAttributionConfig FaithfulnessConfig JSpaceDecomposition LearnedSubspace Node "
            "NormMatchedPlacebo SparseProbeConvergenceError SubspaceBasis arbitrary_targets "
            "orthonormal_subspace random_basis"
        ).split()
    },
    **{
        f"tools.analysis.{name}": "takes tensors, not the model"
        for name in (
            "fit_sparse_probe get_sparse_decomposition mean_difference_basis neuron_basis "
            "probe_basis projection_kernel random_neuron_basis random_projection_kernel_moments "
            "solve_coordinate_patch sweep_sparse_probe"
        ).split()
    },
}
# TransformerLens's checks that take only its TransformerBridge read ``model.__class__``, which
# refuses there (`dcp_lens.model.tl_surface.BRIDGE_ONLY_CHECKS`) naming dcp-lens's equivalent.
_REFUSED_FUNCTIONS |= {
    "tools.analysis.JacobianLens": "dcp_lens.lenses.tuned.JacobianLens.fit(model, tokens): the "
    "Jacobian of each iteration's state to the stream entering ln_final",
}
# Kinds whose every name must be classified here or checked per model: a new name fails the
# coverage test instead of passing as "independent".
_MODEL_KINDS = ("model", "ActivationCache", "patching", "SVDInterpreter", "evals", "tools.analysis")


def surface_table(conformance: set[str]) -> dict[str, tuple[str, str]]:
    """{name: (status, note)} for every name of `tl_public_names`; ``conformance`` is the set of
    names test_conformance checks per model (its ``CHECKS``)."""
    table: dict[str, tuple[str, str]] = {}
    for name in tl_public_names():
        kind, short = name.rsplit(".", 1)
        if name in conformance or (kind == "model" and short in _CONFORMANCE_MODEL):
            table[name] = ("conformance", "")
        elif kind == "model" and short in _CHECKED_MODEL:
            table[name] = ("checked", _CHECKED_MODEL[short])
        elif kind == "model" and short in _REFUSED_MODEL:
            table[name] = ("refused", "")
        elif kind == "model" and short in _HOOKED_ROOT:
            table[name] = ("inherited", "")
        elif name in _CHECKED_FUNCTIONS:
            table[name] = ("checked", _CHECKED_FUNCTIONS[name])
        elif name in _REFUSED_FUNCTIONS:
            table[name] = ("refused", _REFUSED_FUNCTIONS[name])
        elif name in _INDEPENDENT_FUNCTIONS:
            table[name] = ("independent", _INDEPENDENT_FUNCTIONS[name])
        elif kind in _MODEL_KINDS and name not in RESULT_TYPES:
            continue  # unclassified: the coverage test names it
        else:
            table[name] = ("independent", "")
    return table
