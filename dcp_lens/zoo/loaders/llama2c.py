"""``load("llama2c:PATH")``: a llama2.c checkpoint (e.g. stories260K) as a dense model.

PATH is a version-0 ``.bin`` checkpoint, or a folder holding exactly one checkpoint and its
tokenizer (``tokenizer.bin`` or ``tok{N}.bin``, as ``stories260K.bin`` + ``tok512.bin``). The
model is dense (``n_core=0``, ``n_prelude=n_layers``): pre-norm RMSNorm (eps 1e-5), interleaved
rotary embeddings (base 10000), grouped-query attention, SwiGLU ``w2(silu(w1 x) * w3 x)`` and an
unembedding tied to the token embedding unless the file stores ``wcls``. The tokenizer is attached,
so ``model.to_tokens("Once upon a time")`` prepends BOS as llama2.c does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from torch import Tensor

from dcp_lens.model.config import RecurrentConfig
from dcp_lens.model.folder import build_model, heads_in, heads_out, split_overrides
from dcp_lens.model.hooked_recurrent_transformer import HookedRecurrentTransformer
from dcp_lens.utils.checks import check_finite, check_inside, naming_file
from dcp_lens.utils.errors import MissingFileError, WeightsError
from dcp_lens.zoo.loaders.llama2c_format import Llama2cHeader, read_llama2c_checkpoint
from dcp_lens.zoo.loaders.tokenizer import Llama2cTokenizer

ROTARY_BASE = 10000.0
RMS_EPS = 1e-5
_TOKENIZER_NAME = re.compile(r"tok(enizer|\d+)\.bin")
# llama2.c's stored RoPE tables are fp32 cos/sin of angles up to seq_len; ours are recomputed.
_ROPE_TABLE_ATOL = 1e-3


def llama2c_config(header: Llama2cHeader, **overrides: Any) -> RecurrentConfig:
    """The dense `RecurrentConfig` of a llama2.c header; ``overrides`` replace any field."""
    fields: dict[str, Any] = dict(
        d_model=header.dim,
        n_heads=header.n_heads,
        d_head=header.head_size,
        n_key_value_heads=header.n_kv_heads,
        d_mlp=header.hidden_dim,
        d_vocab=header.vocab_size,
        n_ctx=header.seq_len,
        n_prelude=header.n_layers,
        n_core=0,
        n_coda=0,
        injection="none",
        normalization_type="RMS",
        norm_placement="pre",
        eps=RMS_EPS,
        positional_embedding_type="rotary_interleaved",
        rotary_base=ROTARY_BASE,
        act_fn="silu_gated",
        tie_unembed=header.shared_classifier,
        default_prepend_bos=True,
    )
    fields.update(overrides)
    with naming_file("llama2.c header"):
        return RecurrentConfig(**fields)


def llama2c_state_dict(
    tensors: dict[str, Tensor], header: Llama2cHeader, cfg: RecurrentConfig
) -> dict[str, Tensor]:
    """llama2.c arrays ([L, out, in] per layer) -> our `canonical_state_dict` names and layouts."""
    state = {"embed.W_E": tensors["token_embedding"], "ln_final.w": tensors["rms_final"]}
    if "wcls" in tensors:
        state["unembed.W_U"] = tensors["wcls"].T.contiguous()
    n_kv = cfg.n_key_value_heads
    assert n_kv is not None
    for layer in range(header.n_layers):
        target = f"prelude.{layer}"
        state.update(
            {
                f"{target}.ln1.w": tensors["rms_att"][layer],
                f"{target}.attn.W_Q": heads_in(tensors["wq"][layer], cfg.n_heads),
                f"{target}.attn.W_K": heads_in(tensors["wk"][layer], n_kv),
                f"{target}.attn.W_V": heads_in(tensors["wv"][layer], n_kv),
                f"{target}.attn.W_O": heads_out(tensors["wo"][layer], cfg.n_heads),
                f"{target}.ln2.w": tensors["rms_ffn"][layer],
                f"{target}.mlp.W_gate": tensors["w1"][layer].T.contiguous(),
                f"{target}.mlp.W_in": tensors["w3"][layer].T.contiguous(),
                f"{target}.mlp.W_out": tensors["w2"][layer].T.contiguous(),
            }
        )
    return state


def _check_rope_tables(tensors: dict[str, Tensor], header: Llama2cHeader, path: Path) -> None:
    """The stored freq_cis tables must be the base-10000 angles our rotary embedding uses."""
    from dcp_lens.model.components.rotary import rotary_tables

    cos, sin = rotary_tables(header.seq_len, header.head_size, ROTARY_BASE)
    for name, ours in (("freq_cis_real", cos), ("freq_cis_imag", sin)):
        check_finite(name, tensors[name], str(path))  # a NaN gap would compare as "close"
        gap = (tensors[name] - ours).abs().max().item()
        if gap > _ROPE_TABLE_ATOL:
            raise WeightsError(
                f"{path}: {name} differs from rotary tables of base {ROTARY_BASE:g} by {gap:.3g}; "
                "this checkpoint uses another RoPE base or scaling, which is not supported."
            )


def find_llama2c_files(path: str | Path) -> tuple[Path, Path | None]:
    """(checkpoint, tokenizer or None) for a ``.bin`` file or a folder holding both.

    The tokenizer is ``tokenizer.bin`` or ``tok{N}.bin`` beside the checkpoint."""
    path = Path(path)
    if not path.exists():
        raise MissingFileError(f"{path} does not exist; pass a llama2.c .bin file or its folder.")
    folder = path if path.is_dir() else path.parent
    tokenizers = sorted(p for p in folder.glob("*.bin") if _TOKENIZER_NAME.fullmatch(p.name))
    if path.is_file():
        checkpoint = path
    else:
        candidates = sorted(p for p in folder.glob("*.bin") if p not in tokenizers)
        if len(candidates) != 1:
            raise WeightsError(
                f"{folder} holds {len(candidates)} checkpoint .bin files "
                f"{[p.name for p in candidates]}; pass the path of one file instead."
            )
        checkpoint = candidates[0]
    if len(tokenizers) > 1:
        raise WeightsError(
            f"{folder} holds several tokenizers {[p.name for p in tokenizers]}; keep one, or "
            "pass tokenizer=PATH."
        )
    for file in (checkpoint, *tokenizers):
        check_inside(file, folder)
    return checkpoint, tokenizers[0] if tokenizers else None


def load_llama2c(
    path: str | Path, tokenizer: str | Path | None = None, **overrides: Any
) -> HookedRecurrentTransformer:
    """Load a llama2.c version-0 checkpoint with its tokenizer as a dense model.

    Args:
        path: the ``.bin`` checkpoint, or a folder holding it and ``tok{N}.bin``.
        tokenizer: an explicit tokenizer file (default: the one found beside the checkpoint).
        overrides: `RecurrentConfig` fields, ``device`` and ``dtype`` (default float32, CPU).

    Returns:
        A dense `HookedRecurrentTransformer` in eval mode, with ``model.tokenizer`` set when a
        tokenizer was found (a `Llama2cTokenizer`).

    Raises:
        ValueError: the checkpoint is truncated or corrupt, or its tokenizer does not match its
            vocabulary (the file and the offending field or array are named).
    """
    checkpoint_path, found_tokenizer = find_llama2c_files(path)
    config_overrides, device, dtype = split_overrides(overrides)
    header, tensors = read_llama2c_checkpoint(checkpoint_path)
    _check_rope_tables(tensors, header, checkpoint_path)
    cfg = llama2c_config(header, **config_overrides)
    tokenizer_path = Path(tokenizer) if tokenizer is not None else found_tokenizer
    vocab = None
    if tokenizer_path is not None:
        vocab = Llama2cTokenizer.from_file(tokenizer_path, vocab_size=header.vocab_size)
    state = llama2c_state_dict(tensors, header, cfg)
    if dtype is not None:
        state = {key: value.to(dtype) for key, value in state.items()}
    return build_model(
        HookedRecurrentTransformer,
        cfg,
        state,
        str(checkpoint_path),
        tokenizer=vocab,
        device=device,
    )


__all__ = ["find_llama2c_files", "llama2c_config", "llama2c_state_dict", "load_llama2c"]
