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
    "checked": "checked against the reference named, in tests/integration/model/test_tl_surface.py",
    "refused": "raises a DCPLensError whose message names what to use instead (shown)",
    "inherited": "TransformerLens's own HookedRootModule code, run unchanged on this model's "
    "hook points (every patching row above goes through it)",
    "independent": "takes no model (tensors, devices, files, result types): TransformerLens's "
    "own code, unaffected by dcp-lens",
    "unverified": "takes a model or its tokenizer and is not yet checked against a reference",
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
    "loss_fn": "= model(tokens, return_type='loss')",
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
_TOKENIZER = "the tokenizer's TransformerLens attributes are being extended; not yet checked"
_UNVERIFIED = {
    "utilities.tokenize_and_concatenate": _TOKENIZER,
    "utilities.get_input_with_manually_prepended_bos": _TOKENIZER,
    "utilities.get_tokens_with_bos_removed": _TOKENIZER,
    "utilities.get_tokenizer_with_bos": _TOKENIZER,
    "evals.IOIDataset": _TOKENIZER,
    "evals.ioi_eval": _TOKENIZER,
    "evals.evaluate": "downloads its data sets (no network at run time here)",
    "evals.mmlu_eval": "downloads MMLU (no network at run time here)",
    "evals.sanity_check": "runs the model on a fixed English string (not checked)",
    "evals.make_code_data_loader": "downloads its data set",
    "evals.make_mmlu_data_loader": "downloads its data set",
    "evals.make_owt_data_loader": "downloads its data set",
    "evals.make_pile_data_loader": "downloads its data set",
    "evals.make_wiki_data_loader": "downloads its data set",
}
_ANALYSIS_WITH_MODEL = (
    "attention_head_subspace_affinity attribution_patch collect_activations faithfulness "
    "fit_das fit_sparse_probe get_sparse_decomposition intervened_logits jacobian_lens "
    "jacobian_lens_coordinate_patch jacobian_lens_decomposition mean_difference_basis "
    "neuron_basis probe_basis projection_kernel random_init_bridge random_neuron_basis "
    "random_projection_kernel_moments reinitialized run_with_intervention solve_coordinate_patch "
    "sparse_probing sweep_sparse_probe JacobianLens SubspaceInterchange"
).split()
# Kinds whose every name must be classified here or checked per model: a new name fails the
# coverage test instead of passing as "independent".
_MODEL_KINDS = ("model", "ActivationCache", "patching", "SVDInterpreter")


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
        elif name in _UNVERIFIED:
            table[name] = ("unverified", _UNVERIFIED[name])
        elif kind == "tools.analysis" and short in _ANALYSIS_WITH_MODEL:
            table[name] = ("unverified", "takes the model; not yet checked against a reference")
        elif kind in _MODEL_KINDS and name not in RESULT_TYPES:
            continue  # unclassified: the coverage test names it
        else:
            table[name] = ("independent", "")
    return table
