"""``load("bridge:PATH")``: a dense TransformerLens 4 `TransformerBridge` as the negative control.

A dense model's iterations are its layers (docs/design.md §6): iteration t is block t-1, and the
readout is the final norm and unembedding. `BridgeModel` wraps a bridge and names the bridge's own
hook points for the protocol and `dcp_lens.hooks`::

    s_0      = the stream entering block 0          blocks.0.hook_in     (alias hook_resid_pre)
    s_t      = the output of block t-1, t = 1..r    blocks.{t-1}.hook_out (alias hook_resid_post)
    readout  = the stream entering the final norm   ln_final.hook_in
    logits   = transform(unembed(ln_final(s_r)))    the adapter's logit transform (soft cap, scale)

PATH is a local Hugging Face folder (``config.json``, safetensors weights, tokenizer files). Build
one from Python with `BridgeModel.from_bridge(bridge)` or `BridgeModel.from_hf_model(model,
tokenizer)`. Every wrap runs one short forward that checks each hook fires exactly once and that
`BridgeModel.readout` reproduces the bridge's logits, so a bridge whose output path is not
``ln_final -> unembed`` (a looped-depth bridge, an extra output projection) is refused up front.

``transformer_lens.model_bridge`` is imported only when a bridge is built: it is slow to import,
and `dcp_lens.load` imports every loader module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.config import TransformerBridgeConfig
from transformer_lens.hook_points import HookPoint

from dcp_lens.model.folder import CONFIG_FILE, PICKLE_SUFFIXES, pickle_message
from dcp_lens.model.tokenization import Tokenizer
from dcp_lens.utils.checks import check_inside, read_json_object
from dcp_lens.utils.devices import check_device, check_dtype
from dcp_lens.utils.errors import MissingFileError, WeightsError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
# Readout error allowed relative to the logits' per-position spread. TransformerLens measures
# recomputed readouts at ~1e-6 (float32) and ~1e-2 (bfloat16), a skipped logit transform at ~1.
READOUT_RTOL = {torch.float64: 1e-6, torch.float32: 1e-4}
READOUT_RTOL_HALF = 5e-2
CHECK_LENGTH = 8


class BridgeModel:
    """A dense `TransformerBridge` seen as an iteration model: one iteration per layer.

    It has what `DepthControlProtocol` and `dcp_lens.hooks` need (``n_iterations``, ``is_dense``,
    ``state_hook_name``, ``readout_hook_name``, ``readout``, ``run_with_hooks``) and forwards the
    rest of the usual model surface (``cfg``, ``to_tokens``, ``eval``, ``to``, ``hooks``,
    ``run_with_cache``) to the bridge, which stays available as ``model.bridge``.

    Args:
        bridge: a booted `transformer_lens.model_bridge.TransformerBridge` of a decoder-only
            model (raw weights or compatibility mode).
        check: run the hook and readout check (`check_readout`) now; turn off only for a bridge
            already checked.

    Raises:
        TypeError: ``bridge`` is not a `TransformerBridge`.
        ValueError: the bridge has no ``blocks``, ``ln_final`` or ``unembed``, or fails the check.
    """

    def __init__(self, bridge: object, *, check: bool = True) -> None:
        from transformer_lens.model_bridge import TransformerBridge

        if not isinstance(bridge, TransformerBridge):
            raise TypeError(
                f"BridgeModel wraps a transformer_lens TransformerBridge, got "
                f"{type(bridge).__name__}; boot one with TransformerBridge.boot_transformers(...) "
                "or use BridgeModel.from_hf_model(model, tokenizer)."
            )
        modules = bridge._modules
        missing = [name for name in ("blocks", "ln_final", "unembed") if name not in modules]
        if missing:
            raise ValueError(
                f"this bridge ({bridge.cfg.model_name}) has no {missing}: DCP reads a dense model "
                "out through ln_final -> unembed after its blocks, so it needs a decoder-only "
                "causal LM with a final norm."
            )
        n_blocks = len(bridge.blocks)
        if n_blocks < 1 or n_blocks != bridge.cfg.n_layers:
            raise ValueError(
                f"the bridge has {n_blocks} blocks but cfg.n_layers={bridge.cfg.n_layers}; "
                "expected one block per layer."
            )
        self.bridge = bridge
        if check:
            self.check_readout()

    # ------------------------------------------------------------------------ construction

    @classmethod
    def from_bridge(cls, bridge: object, *, check: bool = True) -> BridgeModel:
        """Wrap a booted `TransformerBridge` (checked with `check_readout`)."""
        return cls(bridge, check=check)

    @classmethod
    def from_hf_model(
        cls,
        hf_model: nn.Module,
        tokenizer: Tokenizer | None = None,
        *,
        name: str | None = None,
        check: bool = True,
    ) -> BridgeModel:
        """Boot a bridge around an already built Hugging Face causal LM and wrap it.

        The bridge modifies ``hf_model`` in place (its submodules become bridge components and
        its attention turns eager); it keeps its device, dtype and train/eval mode.

        Args:
            hf_model: a ``transformers`` causal LM (e.g. ``GPT2LMHeadModel``).
            tokenizer: its tokenizer; may be omitted when ``hf_model`` was loaded from a local
                folder that holds one.
            name: the model's name in ``cfg.model_name`` (default: the folder it came from, or
                its ``model_type``); only recorded, never downloaded.
        """
        from transformer_lens.model_bridge import TransformerBridge

        source = str(getattr(hf_model, "name_or_path", "") or "")
        if tokenizer is None and not _holds_tokenizer(Path(source) if source else None):
            raise ValueError(
                f"no tokenizer: pass tokenizer=... (hf_model came from {source or 'no folder'!r}, "
                f"which is not a local folder holding one of {list(TOKENIZER_FILES)})."
            )
        name = name or source or str(getattr(hf_model.config, "model_type", "hf_model"))
        first = next(hf_model.parameters())
        bridge = TransformerBridge.boot_transformers(
            name, hf_model=hf_model, tokenizer=tokenizer, device=first.device, dtype=first.dtype
        )
        return cls(bridge, check=check)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        **boot_options: Any,
    ) -> BridgeModel:
        """Boot a bridge from a local Hugging Face folder and wrap it, in eval mode.

        Args:
            path: a folder with ``config.json``, safetensors weights and tokenizer files.
            device: where to put the model (default CPU).
            dtype: a ``torch.dtype`` or its name (``"bfloat16"``); default float32.
            boot_options: further keywords of ``TransformerBridge.boot_transformers`` (e.g.
                ``n_ctx``, ``hf_config_overrides``).

        Raises:
            FileNotFoundError: ``path`` is not a folder holding ``config.json`` and a tokenizer.
            WeightsError: the folder holds pickle weights only (``pytorch_model.bin``, never
                unpickled), or a weight file links outside it.
            DeviceError: ``device`` is not available here, or ``dtype`` is not floating.
        """
        from transformer_lens.model_bridge import TransformerBridge

        folder = Path(path)
        if not (folder / CONFIG_FILE).is_file():
            raise MissingFileError(
                f"{folder} is not a Hugging Face model folder (no {CONFIG_FILE}); pass a local "
                "folder written by save_pretrained (config, safetensors weights, tokenizer)."
            )
        if not _holds_tokenizer(folder):
            raise MissingFileError(
                f"{folder} holds no tokenizer (none of {list(TOKENIZER_FILES)}); save the "
                "tokenizer there with tokenizer.save_pretrained(folder)."
            )
        read_json_object(folder / CONFIG_FILE)  # a clear error for a binary or broken config
        _check_weight_files(folder)
        target, dtype = check_device(device), _as_dtype(dtype)
        try:
            bridge = TransformerBridge.boot_transformers(
                str(folder), device=target, dtype=dtype, **boot_options
            )
        except Exception as error:  # never pass on torch's advice to unpickle (weights_only)
            if "weights_only" in str(error) or "pickle" in type(error).__name__.lower():
                raise WeightsError(pickle_message(folder)) from None
            raise
        return cls(bridge).eval()

    # ------------------------------------------------------------------------ iteration model

    @property
    def cfg(self) -> TransformerBridgeConfig:
        """The bridge's config (``n_layers``, ``d_model``, ``d_vocab``, ``n_ctx``, ...)."""
        return self.bridge.cfg

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.bridge.tokenizer

    @property
    def n_iterations(self) -> int:
        """r: the number of layers (a dense model's iterations are its layers)."""
        return len(self.bridge.blocks)

    @property
    def is_dense(self) -> bool:
        return True

    def state_hook_name(self, t: int) -> str:
        """Hook name of the state after t layers: ``blocks.0.hook_in`` for t = 0 (the embedded
        stream), ``blocks.{t-1}.hook_out`` for t = 1..r."""
        r = self.n_iterations
        if isinstance(t, bool) or not 0 <= t <= r:
            raise ValueError(f"t={t!r} must be an int in 0..{r} (the model's layers).")
        return "blocks.0.hook_in" if t == 0 else f"blocks.{t - 1}.hook_out"

    @property
    def readout_hook_name(self) -> str:
        """Hook name of the stream entering the readout (final norm, unembedding)."""
        return "ln_final.hook_in"

    def readout(
        self, state: Float[Tensor, "batch pos d_model"]
    ) -> Float[Tensor, "batch pos d_vocab"]:
        """Logits of a state read out as the last block's output: the bridge's ``ln_final`` and
        ``unembed`` components (their hooks fire) and the architecture's logit transform."""
        bridge = self.bridge
        logits = bridge.unembed(bridge.ln_final(state))
        return bridge.adapter.apply_output_logits_transform(logits)

    @torch.no_grad()
    def check_readout(self, tokens: Int[Tensor, "batch pos"] | None = None) -> float:
        """Check on one forward that DCP's hooks see this bridge as a dense iteration model.

        Each of ``state_hook_name(0..r)`` and ``readout_hook_name`` must fire exactly once, and
        ``readout(s_r)`` must reproduce the bridge's logits. Runs in eval mode and restores the
        mode. Run it again after changing the bridge (e.g. ``enable_compatibility_mode()``).

        Args:
            tokens: the input to check on (default: one sequence of 8 token ids).

        Returns:
            max |readout(s_r) - logits| over the check's positions.

        Raises:
            ValueError: a hook fired not exactly once (e.g. a looped-depth bridge), or the readout
                differs from the logits (something between the last block and the logits that
                ``ln_final -> unembed`` does not reproduce).
        """
        if tokens is None:
            length = min(CHECK_LENGTH, int(self.cfg.n_ctx))
            tokens = torch.arange(length)[None] % int(self.cfg.d_vocab)
        names = [self.state_hook_name(t) for t in range(self.n_iterations + 1)]
        names.append(self.readout_hook_name)
        seen: dict[str, list[Tensor]] = {name: [] for name in names}

        def recorder(name: str) -> Callable[[Tensor, HookPoint], None]:
            # Keyed by the name asked for: an alias reports its hook point's canonical name.
            def record(state: Tensor, hook: HookPoint) -> None:
                seen[name].append(state)

            return record

        was_training = self.training
        self.eval()
        try:
            logits = self.run_with_hooks(
                tokens.to(self._device()), fwd_hooks=[(name, recorder(name)) for name in names]
            )
            counts = {name: len(states) for name, states in seen.items()}
            if set(counts.values()) != {1}:
                raise ValueError(
                    f"hooks must fire exactly once per forward, but fired {counts}: this bridge "
                    "is not a dense stack of blocks (a looped-depth model fires its blocks "
                    "several times; load it with its own dcp_lens loader)."
                )
            readout = self.readout(seen[names[-2]][0])
        finally:
            self.train(was_training)
        error = float((readout.float() - logits.float()).abs().max())
        spread = float((logits.float() - logits.float().mean(-1, keepdim=True)).abs().max())
        tolerance = READOUT_RTOL.get(logits.dtype, READOUT_RTOL_HALF) * max(spread, 1.0)
        if not error <= tolerance:
            raise ValueError(
                f"readout(s_r) = transform(unembed(ln_final(last block's output))) differs from "
                f"the bridge's logits by {error:.3g} (tolerance {tolerance:.3g}): this model "
                "changes the stream or the logits in a way ln_final -> unembed does not "
                "reproduce, so truncated states cannot be read out like the full one."
            )
        return error

    # ------------------------------------------------------------------------ model surface

    def __call__(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_vocab"]:
        """The bridge's logits for ``tokens``."""
        return self.bridge(tokens)

    def run_with_hooks(self, *model_args: Any, **kwargs: Any) -> Any:
        """``bridge.run_with_hooks``: logits with temporary hooks (by default)."""
        return self.bridge.run_with_hooks(*model_args, **kwargs)

    def run_with_cache(self, *model_args: Any, **kwargs: Any) -> Any:
        """``bridge.run_with_cache``: (logits, `ActivationCache`)."""
        return self.bridge.run_with_cache(*model_args, **kwargs)

    def hooks(self, *args: Any, **kwargs: Any) -> Any:
        """``bridge.hooks(fwd_hooks=...)``: a context manager that attaches hooks."""
        return self.bridge.hooks(*args, **kwargs)

    def to_tokens(
        self, text: str | list[str], prepend_bos: bool | None = None
    ) -> Int[Tensor, "batch pos"]:
        """Tokenize with the bridge's tokenizer (BOS as the bridge's config says): [batch, pos]."""
        return self.bridge.to_tokens(text, prepend_bos=prepend_bos)

    def to_string(self, tokens: Tensor | Sequence[int]) -> str | list[str]:
        """Decode [pos] tokens to a string, or [batch, pos] to a list of strings."""
        return self.bridge.to_string(tokens if isinstance(tokens, Tensor) else list(tokens))

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.bridge.parameters(recurse=recurse)

    @property
    def training(self) -> bool:
        return bool(self.bridge.training)

    def train(self, mode: bool = True) -> BridgeModel:
        self.bridge.train(mode)
        return self

    def eval(self) -> BridgeModel:
        return self.train(False)

    def to(self, *args: Any, **kwargs: Any) -> BridgeModel:
        """Move or cast the bridge (``bridge.to``, without its printout); returns self."""
        kwargs.setdefault("print_details", False)
        self.bridge.to(*args, **kwargs)
        return self

    def __repr__(self) -> str:
        cfg = self.cfg
        return (
            f"BridgeModel({cfg.model_name!r}, n_layers={self.n_iterations}, "
            f"d_model={cfg.d_model}, d_vocab={cfg.d_vocab})"
        )

    def _device(self) -> torch.device:
        return next(self.parameters()).device


def _holds_tokenizer(folder: Path | None) -> bool:
    return folder is not None and any((folder / name).is_file() for name in TOKENIZER_FILES)


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    return check_dtype(dtype)


def _check_weight_files(folder: Path) -> None:
    """Safetensors weights inside ``folder``: pickle-only folders are refused before
    transformers sees them (it would hand them to ``torch.load``)."""
    weights = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.safetensors.index.json"))
    if not weights:
        pickles = sorted(p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise WeightsError(pickle_message(pickles[0]))
        raise MissingFileError(
            f"{folder} holds no .safetensors weights; save the model there with "
            "model.save_pretrained(folder) (safetensors is its default)."
        )
    for file in weights:
        check_inside(file, folder)


def load_bridge(path: str | Path, **options: Any) -> BridgeModel:
    """``load("bridge:PATH")``: a local Hugging Face folder booted as a `TransformerBridge`.

    Args:
        path: a folder with ``config.json``, safetensors weights and tokenizer files.
        options: ``device`` (default CPU), ``dtype`` (default float32) and other keywords of
            ``TransformerBridge.boot_transformers``.

    Returns:
        A checked `BridgeModel` in eval mode.
    """
    return BridgeModel.from_pretrained(path, **options)


__all__ = ["BridgeModel", "load_bridge"]
