"""What peer libraries look up on a model, provided without importing them.

pyvene's `IntervenableModel` reads ``model.config`` and ``model.device`` and looks the model's
class up in its ``type_to_module_mapping`` / ``type_to_dimension_mapping``. When pyvene is
imported, the model's class is entered there the first time pyvene reads ``model.config``, with
TransformerLens-style components (``block_output`` at layer i is ``blocks[i]``'s output, ...), so
pyvene's documented usage works unmodified; a full module path (``"loop[2].hook_state.output"``)
works as for any PyTorch model.
"""

from __future__ import annotations

import sys

_OUTPUT, _INPUT = "register_forward_hook", "register_forward_pre_hook"
PYVENE_COMPONENTS: dict[str, tuple[str, str]] = {
    "block_input": ("blocks[%s]", _INPUT),
    "block_output": ("blocks[%s]", _OUTPUT),
    "attention_input": ("blocks[%s].ln1", _INPUT),
    "attention_output": ("blocks[%s].hook_attn_out", _OUTPUT),
    "mlp_input": ("blocks[%s].ln2", _INPUT),
    "mlp_output": ("blocks[%s].hook_mlp_out", _OUTPUT),
    "state": ("loop[%s].hook_state", _OUTPUT),
}


def register_with_pyvene(model_class: type) -> None:
    """Enter ``model_class`` in pyvene's mappings if pyvene is imported (idempotent)."""
    modelcard = sys.modules.get("pyvene.models.intervenable_modelcard")
    if modelcard is None or model_class in modelcard.type_to_module_mapping:
        return
    modelcard.type_to_module_mapping[model_class] = dict(PYVENE_COMPONENTS)
    modelcard.type_to_dimension_mapping[model_class] = {
        name: ("d_model",) for name in PYVENE_COMPONENTS
    }
