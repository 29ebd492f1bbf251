"""`AffineTranslator`: a learned affine map of the residual stream, h -> h + h W^T + b, fitted so
that a readout of the moved state matches target logits (KL), as tuned-lens's translators.

Self-contained (torch and safetensors only) so the lenses (a tuned lens per iteration) and the
protocol (paired translators of a bracketed S) use the same object. It starts at the identity
(W = 0, b = 0). The tuned lens fits it by KL (`AffineTranslator.fit`); the protocol solves its
paired translators in closed form instead (ridge least squares onto full depth's states,
`dcp_lens.protocol.fit.fit_translators`). Fitted to each example's own full-depth output either way,
it can carry out missing *linear* computation: report it as an upper bound on a readout shift, never
as a label-free calibration.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from jaxtyping import Float
from torch import Tensor

from dcp_lens.utils.errors import DCPLensError

ReadoutCall = Callable[[Tensor], Tensor]  # [batch, pos, d_model] -> [batch, pos, d_vocab]


class TranslatorError(DCPLensError):
    """A translator given states, targets or a file it cannot use."""


class AffineTranslator:
    """h -> h + h W^T + b on [..., d_model] (identity at W = 0, b = 0).

    Args:
        d_model: width of the states.
        weight, bias: [d_model, d_model] and [d_model] (default zeros: the identity).
    """

    def __init__(self, d_model: int, weight: Tensor | None = None, bias: Tensor | None = None):
        if d_model < 1:
            raise TranslatorError(f"d_model={d_model} must be >= 1.")
        self.d_model = d_model
        self.weight = torch.zeros(d_model, d_model) if weight is None else weight.detach().clone()
        self.bias = torch.zeros(d_model) if bias is None else bias.detach().clone()
        # (I + W)^T and b per device and dtype, keyed on the tensors' identity and version (a
        # refit or an in-place edit of weight or bias makes a new entry).
        self._cast: dict[
            tuple[torch.device, torch.dtype, int, int, int, int], tuple[Tensor, Tensor]
        ] = {}
        # Whether W and b are zero, keyed the same way without the device and dtype: asked on
        # every call, read from the tensors (a synchronisation on an accelerator) once.
        self._identity: tuple[tuple[int, int, int, int], bool] | None = None
        if self.weight.shape != (d_model, d_model) or self.bias.shape != (d_model,):
            raise TranslatorError(
                f"weight {tuple(self.weight.shape)} / bias {tuple(self.bias.shape)} do not fit "
                f"d_model={d_model}: expected ({d_model}, {d_model}) and ({d_model},)."
            )

    @property
    def is_identity(self) -> bool:
        key = (id(self.weight), self.weight._version, id(self.bias), self.bias._version)
        if self._identity is None or self._identity[0] != key:
            self._identity = (key, not bool(self.weight.any() or self.bias.any()))
        return self._identity[1]

    def __call__(self, state: Float[Tensor, "*batch d_model"]) -> Float[Tensor, "*batch d_model"]:
        if state.shape[-1] != self.d_model:
            raise TranslatorError(
                f"state has width {state.shape[-1]}, this translator d_model={self.d_model}."
            )
        if self.is_identity:
            return state
        # h + h W^T + b as one fused product and sum: h (I + W)^T + b (the identity added once
        # per device and dtype, not once per call).
        key = (
            state.device,
            state.dtype,
            id(self.weight),
            self.weight._version,
            id(self.bias),
            self.bias._version,
        )
        if key not in self._cast:
            self._cast.clear()
            weight = self.weight.to(state.device, state.dtype)
            weight = weight + torch.eye(self.d_model, device=state.device, dtype=state.dtype)
            self._cast[key] = (weight.T, self.bias.to(state.device, state.dtype))
        transposed, bias = self._cast[key]
        flat = torch.addmm(bias, state.reshape(-1, self.d_model), transposed)
        return flat.reshape(state.shape)

    def fit(
        self,
        states: Float[Tensor, "batch pos d_model"],
        target_logits: Float[Tensor, "batch pos d_vocab"],
        readout: ReadoutCall,
        *,
        steps: int = 200,
        lr: float = 1e-2,
        weight_decay: float = 0.0,
        mask: Tensor | None = None,
    ) -> list[float]:
        """Fit W and b by Adam on KL(softmax(target) || softmax(readout(translate(states)))),
        averaged over the positions ``mask`` [batch, pos] keeps (default all). Returns the loss
        before each step (and after the last)."""
        if states.shape[:-1] != target_logits.shape[:-1]:
            raise TranslatorError(
                f"states {tuple(states.shape)} and target_logits {tuple(target_logits.shape)} "
                "must share [batch, pos]."
            )
        if steps < 0 or lr <= 0:
            raise TranslatorError(f"steps={steps} must be >= 0 and lr={lr} > 0.")
        states = states.detach()
        target = target_logits.detach().float().log_softmax(-1)
        keep = torch.ones(states.shape[:-1], dtype=torch.bool) if mask is None else mask.bool()
        keep = keep.to(states.device)
        weight = self.weight.to(states.device, states.dtype).clone().requires_grad_(True)
        bias = self.bias.to(states.device, states.dtype).clone().requires_grad_(True)
        optimizer = torch.optim.Adam([weight, bias], lr=lr, weight_decay=weight_decay)

        def loss() -> Tensor:
            moved = states + states @ weight.T + bias
            log_q = readout(moved).float().log_softmax(-1)
            kl = (target.exp() * (target - log_q)).sum(-1)
            return kl[keep].mean()

        history = []
        with torch.enable_grad():
            for _ in range(steps):
                optimizer.zero_grad()
                value = loss()
                history.append(float(value.detach()))
                value.backward()
                optimizer.step()
            history.append(float(loss().detach()))
        self.weight, self.bias = weight.detach(), bias.detach()  # on the states' device
        return history

    def state_dict(self, prefix: str = "") -> dict[str, Tensor]:
        """``weight`` and ``bias`` on the host (what a file holds)."""
        return {
            f"{prefix}weight": self.weight.contiguous().cpu(),
            f"{prefix}bias": self.bias.contiguous().cpu(),
        }

    @classmethod
    def from_state_dict(cls, tensors: dict[str, Tensor], prefix: str = "") -> AffineTranslator:
        try:
            weight, bias = tensors[f"{prefix}weight"], tensors[f"{prefix}bias"]
        except KeyError as error:
            raise TranslatorError(
                f"no {prefix}weight / {prefix}bias in the tensors (keys: {sorted(tensors)[:6]})."
            ) from error
        return cls(int(bias.shape[0]), weight, bias)

    def save(self, path: str | Path) -> Path:
        """Write ``weight`` and ``bias`` to a safetensors file."""
        from safetensors.torch import save_file

        save_file(self.state_dict(), str(path), metadata={"format": "dcp-lens-translator"})
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> AffineTranslator:
        from safetensors.torch import load_file

        if not Path(path).is_file():
            raise TranslatorError(f"{path} does not exist; write one with translator.save(path).")
        return cls.from_state_dict(load_file(str(path)))


class MeanTranslator(AffineTranslator):
    """The translator with no information: every state to ``mean`` (W = -I, b = ``mean``), so
    its readout is that of the mean target state. The protocol puts it where a paired
    translator's least-squares fit predicted no held-out target better than the targets' mean
    (`dcp_lens.protocol.fit`).

    Args:
        mean: [d_model], the mean target state.
    """

    def __init__(self, mean: Float[Tensor, " d_model"]) -> None:
        d_model = int(mean.shape[-1])
        eye = torch.eye(d_model, dtype=mean.dtype, device=mean.device)
        super().__init__(d_model, -eye, mean)
