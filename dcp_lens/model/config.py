"""`RecurrentConfig`: the shape of a depth-recurrent (or dense) transformer.

The model it describes (docs/design.md §2)::

    e   = Prelude(embed_scale * Embed(x))          # n_prelude distinct blocks
    s_0 = Init(e)                                  # state_init
    u_t = Inject(s_{t-1}, e)                       # injection, t = 1..k
    s_t = IterationNorm(Core(u_t))                 # n_core weight-shared blocks
    logits = Unembed(LnFinal(Coda(PreCodaNorm(s_k))))

With ``n_core == 0`` the model is dense: ``n_prelude + n_coda`` distinct blocks and no loop.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from transformer_lens.config import TransformerLensConfig

from dcp_lens.utils.checks import (
    as_declared_floats,
    check_field_types,
    check_limit,
    naming_file,
    read_json_object,
)
from dcp_lens.utils.errors import ConfigError, ConfigTypeError
from dcp_lens.utils.files import write_text_atomically

INJECTIONS = ("none", "add", "concat_adapter")
STATE_INITS = ("zeros", "embed", "normal", "huginn")
NORMALIZATION_TYPES = ("LN", "RMS")
NORM_PLACEMENTS = ("pre", "sandwich", "sandwich_residual", "post")
EXTRA_NORMS = ("none", "own", "final")
POSITIONAL_EMBEDDINGS = ("learned", "rotary_interleaved", "rotary_rotate_half")
ACT_FNS = ("gelu", "silu_gated")

# Fields that are derived from others (or describe the machine) and so are not written to JSON.
_DERIVED_FIELDS = ("n_layers", "device", "dtype")
# Fields added after the file format was first written: a file without them gets the default.
_LATER_FIELDS = ("qk_norm", "rotary_scaling")
# The fields of ``rotary_scaling``, in order (Llama 3's frequency scaling).
ROTARY_SCALING_FIELDS = (
    "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
)  # fmt: skip


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {choices}; pick one of those strings.")


def _check_count(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(f"{name} must be an int, got {type(value).__name__} ({value!r}).")
    if value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}.")
    check_limit(name, value, "RecurrentConfig")


@dataclass
class RecurrentConfig(TransformerLensConfig):
    """Configuration of a `HookedRecurrentTransformer`.

    ``n_layers`` is not an input: it always equals the number of block applications in the
    active unrolled view, ``n_prelude + k * n_core + n_coda`` (k = active iterations), so
    TransformerLens utilities that read ``cfg.n_layers`` see the model as it runs.

    Norm placement: ``"pre"`` is x + Sub(Norm(x)); ``"sandwich"`` (Ouro, Gemma-2) is
    x + Norm(Sub(Norm(x))); ``"sandwich_residual"`` (Huginn) is Norm(x + Sub(Norm(x)));
    ``"post"`` (OLMo-2) is x + Norm(Sub(x)).
    ``qk_norm``: RMSNorm over the whole query projection (n_heads * d_head features) and the whole
    key projection (n_key_value_heads * d_head) before the split into heads and the rotary
    embedding (OLMo-2). ``rotary_scaling``: Llama 3's rotary frequency scaling, the values of
    `ROTARY_SCALING_FIELDS` (None: unscaled frequencies).
    ``pre_coda_norm`` and ``iteration_norm`` are ``"none"``, ``"own"`` (a norm with its own
    weights) or ``"final"`` (the final norm's weights, as Huginn's ln_f and Ouro's model.norm).
    """

    # TransformerLens's switches for hook points this model does not build (always off: the
    # model's set_use_hook_mlp_in / set_use_attn_in refuse True, naming the hook to use).
    use_hook_mlp_in: ClassVar[bool] = False
    use_attn_in: ClassVar[bool] = False

    d_model: int = 64
    d_head: int = 16
    n_layers: int = 0
    n_ctx: int = 128
    n_heads: int = 4
    d_mlp: int | None = 256
    d_vocab: int = 64

    n_prelude: int = 1
    n_core: int = 2
    n_coda: int = 1
    n_iterations: int = 4

    injection: str = "add"
    state_init: str = "zeros"
    state_init_std: float = 1.0
    state_init_seed: int = 0

    normalization_type: str | None = "LN"
    norm_placement: str = "pre"
    pre_coda_norm: str = "none"
    iteration_norm: str = "none"
    final_norm: bool = True
    eps: float = 1e-5

    positional_embedding_type: str = "learned"
    rotary_base: float = 10000.0
    n_key_value_heads: int | None = None
    qk_bias: bool = False
    qk_norm: bool = False
    rotary_scaling: tuple[float, float, float, float] | None = None
    act_fn: str = "gelu"
    tie_unembed: bool = False
    embed_scale: float = 1.0
    init_std: float = 0.02
    seed: int | None = None
    default_prepend_bos: bool = False

    def __post_init__(self) -> None:
        # Types first: a string seed or "false" for a boolean is refused, never coerced.
        fields = {name: getattr(self, name) for name in SERIALISED_FIELDS}
        check_field_types(RecurrentConfig, fields, "RecurrentConfig")
        for name in ("d_model", "d_head", "n_ctx", "n_heads", "d_vocab"):
            _check_count(name, getattr(self, name), 1)
        for name in ("n_prelude", "n_core", "n_coda"):
            _check_count(name, getattr(self, name), 0)
        _check_count("n_iterations", self.n_iterations, 1 if self.n_core > 0 else 0)
        if self.n_core == 0 and self.n_prelude + self.n_coda == 0:
            raise ConfigError("a model needs at least one block: n_prelude + n_core + n_coda > 0.")
        if self.d_model != self.n_heads * self.d_head:
            raise ConfigError(
                f"d_model={self.d_model} must equal n_heads * d_head = {self.n_heads} * "
                f"{self.d_head}; choose d_head = d_model // n_heads with d_model divisible "
                "into heads."
            )
        if self.d_mlp is None:
            self.d_mlp = 4 * self.d_model
        _check_count("d_mlp", self.d_mlp, 1)
        if self.n_key_value_heads is None:
            self.n_key_value_heads = self.n_heads
        _check_count("n_key_value_heads", self.n_key_value_heads, 1)
        if self.n_heads % self.n_key_value_heads:
            raise ConfigError(
                f"n_key_value_heads={self.n_key_value_heads} must divide n_heads={self.n_heads} "
                "(each kv head serves n_heads // n_key_value_heads query heads)."
            )
        _check_choice("injection", self.injection, INJECTIONS)
        _check_choice("state_init", self.state_init, STATE_INITS)
        _check_choice("normalization_type", self.normalization_type, NORMALIZATION_TYPES)
        _check_choice("norm_placement", self.norm_placement, NORM_PLACEMENTS)
        _check_choice("pre_coda_norm", self.pre_coda_norm, EXTRA_NORMS)
        _check_choice("iteration_norm", self.iteration_norm, EXTRA_NORMS)
        _check_choice(
            "positional_embedding_type", self.positional_embedding_type, POSITIONAL_EMBEDDINGS
        )
        _check_choice("act_fn", self.act_fn, ACT_FNS)
        self._check_rotary_scaling()
        if self.positional_embedding_type != "learned" and self.d_head % 2:
            raise ConfigError(f"rotary embeddings need an even d_head, got d_head={self.d_head}.")
        for name in ("eps", "state_init_std", "init_std", "rotary_base", "embed_scale"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive finite number.")
        for name in ("pre_coda_norm", "iteration_norm"):
            if getattr(self, name) == "final" and not self.final_norm:
                raise ConfigError(f"{name}='final' shares the final norm, but final_norm=False.")
        if self.is_dense:
            # A dense model has no loop: nothing is injected and its layers are its iterations.
            self.injection, self.n_iterations = "none", 0
        self.uses_rms_norm = self.normalization_type == "RMS"
        self.final_rms = self.uses_rms_norm
        self.gated_mlp = self.act_fn == "silu_gated"
        self.n_layers = self.layers_for(self.n_iterations)
        if self.device is None:
            self.device = "cpu"

    def _check_rotary_scaling(self) -> None:
        if self.rotary_scaling is None:
            return
        factor, low, high, context = (float(v) for v in self.rotary_scaling)
        values = (factor, low, high, context)
        named = dict(zip(ROTARY_SCALING_FIELDS, values, strict=True))
        if min(values) <= 0 or named["high_freq_factor"] <= named["low_freq_factor"]:
            raise ConfigError(
                f"rotary_scaling={named} needs positive values and high_freq_factor > "
                "low_freq_factor (Llama 3 uses factor 32 or 8, low 1, high 4, original 8192)."
            )
        if self.positional_embedding_type == "learned":
            raise ConfigError("rotary_scaling scales rotary frequencies; this model has none.")
        self.rotary_scaling = values

    @property
    def is_dense(self) -> bool:
        """True when there is no weight-shared core: every block is distinct."""
        return self.n_core == 0

    def layers_for(self, n_iterations: int) -> int:
        """Number of block applications with ``n_iterations`` loop iterations."""
        return self.n_prelude + n_iterations * self.n_core + self.n_coda

    def to_dict(self) -> dict[str, object]:
        """The constructor fields as plain JSON values (derived fields left out)."""
        return {name: getattr(self, name) for name in SERIALISED_FIELDS}

    @classmethod
    def from_dict(cls, config_dict: object) -> RecurrentConfig:
        """Build a config from `to_dict` output; unknown or missing keys are an error."""
        if not isinstance(config_dict, dict):
            raise ConfigTypeError(
                f"a RecurrentConfig is built from a dict of fields, got "
                f"{type(config_dict).__name__}."
            )
        known = set(SERIALISED_FIELDS)
        unknown = sorted(set(config_dict) - known - set(_DERIVED_FIELDS))
        if unknown:
            raise ConfigError(
                f"unknown RecurrentConfig keys {unknown}; the known keys are {sorted(known)}."
            )
        missing = sorted(known - set(config_dict) - set(_LATER_FIELDS))
        if missing:
            raise ConfigError(
                f"config is missing keys {missing}; write it with RecurrentConfig.to_dict()."
            )
        # JSON has no tuples: a tuple field (rotary_scaling) comes back as a list.
        values = {
            k: tuple(v) if isinstance(v, list) else v for k, v in config_dict.items() if k in known
        }
        check_field_types(cls, values, "RecurrentConfig")  # before the constructor sees them
        return cls(**as_declared_floats(cls, values))

    def to_json(self, path: str | Path) -> None:
        """Write `to_dict` as JSON to ``path``, whole or not at all (`write_text_atomically`)."""
        write_text_atomically(path, json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> RecurrentConfig:
        """Read `to_json` output; errors name the file, the field and the value."""
        data = read_json_object(path)
        with naming_file(path):
            return cls.from_dict(data)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items())
        return f"RecurrentConfig({inner})"


# TransformerLens fields that are derived here or never read stay out of the file format.
_UNUSED_TL_FIELDS = {
    "use_attn_result", "use_split_qkv_input", "attn_only", "gated_mlp", "uses_rms_norm",
    "layer_norm_folding", "num_experts", "experts_per_token", "final_rms",
}  # fmt: skip
# The fields a config file holds: every constructor field but the derived and unused ones.
SERIALISED_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(RecurrentConfig)
    if f.init and f.name not in _UNUSED_TL_FIELDS and f.name not in _DERIVED_FIELDS
)
