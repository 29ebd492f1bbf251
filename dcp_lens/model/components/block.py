"""One transformer block, in the four norm placements real recurrent models use."""

from __future__ import annotations

from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from dcp_lens.model.components.attention import Attention, KVCacheEntry
from dcp_lens.model.components.mlp import make_mlp
from dcp_lens.model.components.norms import NoNorm, make_norm
from dcp_lens.model.config import RecurrentConfig
from dcp_lens.utils.errors import UnsupportedToolError

# What TransformerLens's readout tools (transformer_lens.tools.analysis: logit_lens,
# logit_readout) assume and a recurrent model breaks, and the way out.
ANALYSIS_READOUT_REFUSAL = (
    "transformer_lens.tools.analysis reads a model as unembed(ln_final(the last block's "
    "output)) and its lens as ln_final on each block's output; a recurrent model reads out "
    "through its per-iteration norm, pre-coda norm and coda, so those tools would not give its "
    "logits. Use dcp_lens.lenses.logit_lens(model, tokens) (the readout of every iteration), "
    "or model.unembed(cache.accumulated_resid(apply_ln=True)[-1]) for the final stream."
)

# Placements that normalise each sublayer's output before it is added to the stream.
OUTPUT_NORMED = ("sandwich", "post")


class TransformerBlock(nn.Module):
    """``pre``: x + Sub(ln(x)); ``sandwich`` (Ouro): x + ln_post(Sub(ln(x)));
    ``sandwich_residual`` (Huginn): ln_post(x + Sub(ln(x))); ``post`` (OLMo-2):
    x + ln_post(Sub(x)), for Sub = attention, then MLP.

    ``hook_attn_out`` and ``hook_mlp_out`` hold what each sublayer adds to the sum (after the
    output norm for ``sandwich`` and ``post``; before the residual renormalisation for
    ``sandwich_residual``). With ``post`` the sublayers read the stream itself: ``ln1`` and
    ``ln2`` are parameter-free identities that keep their ``hook_normalized``.
    """

    def __init__(self, cfg: RecurrentConfig):
        super().__init__()
        self.placement = cfg.norm_placement
        self.ln1: nn.Module = NoNorm(cfg) if self.placement == "post" else make_norm(cfg)
        self.attn = Attention(cfg)
        self.ln2: nn.Module = NoNorm(cfg) if self.placement == "post" else make_norm(cfg)
        self.mlp = make_mlp(cfg)
        if self.placement != "pre":
            self.ln1_post = make_norm(cfg)
            self.ln2_post = make_norm(cfg)
        self.hook_resid_pre = HookPoint()
        self.hook_attn_out = HookPoint()
        self.hook_resid_mid = HookPoint()
        self.hook_mlp_out = HookPoint()
        self.hook_resid_post = HookPoint()

    @property
    def hook_out_is_single_residual_stream(self) -> bool:
        """Read only by TransformerLens's readout tools: refused (`ANALYSIS_READOUT_REFUSAL`)."""
        raise UnsupportedToolError(ANALYSIS_READOUT_REFUSAL)

    def forward(
        self,
        resid_pre: Float[Tensor, "batch pos d_model"],
        rotary: tuple[Tensor, Tensor] | None = None,
        kv_cache: KVCacheEntry | None = None,
        key_mask: Tensor | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """``key_mask`` [batch, past + pos]: True on real tokens in a padded batch (see
        `Attention.forward`)."""
        x = self.hook_resid_pre(resid_pre)
        attn_out = self.attn(self.ln1(x), rotary, kv_cache, key_mask)
        if self.placement in OUTPUT_NORMED:
            attn_out = self.ln1_post(attn_out)
        attn_out = self.hook_attn_out(attn_out)
        mid = x + attn_out
        if self.placement == "sandwich_residual":
            mid = self.ln1_post(mid)
        mid = self.hook_resid_mid(mid)
        mlp_out = self.mlp(self.ln2(mid))
        if self.placement in OUTPUT_NORMED:
            mlp_out = self.ln2_post(mlp_out)
        mlp_out = self.hook_mlp_out(mlp_out)
        post = mid + mlp_out
        if self.placement == "sandwich_residual":
            post = self.ln2_post(post)
        return self.hook_resid_post(post)
