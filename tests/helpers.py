"""Helpers shared by the test modules (no test module imports another)."""

from __future__ import annotations

from pathlib import Path

import torch

from dcp_lens import (
    DepthControlProtocol,
    EvaluationSet,
    HookedRecurrentTransformer,
    RecurrentConfig,
)
from dcp_lens.conditions import SWEEP


def make_model(dtype: torch.dtype = torch.float64, **overrides) -> HookedRecurrentTransformer:
    fields = dict(
        d_model=32,
        n_heads=4,
        d_head=8,
        d_mlp=64,
        d_vocab=40,
        n_ctx=24,
        n_prelude=1,
        n_core=2,
        n_coda=1,
        n_iterations=4,
        init_std=0.2,
        seed=3,
    )
    fields.update(overrides)
    model = HookedRecurrentTransformer(RecurrentConfig(**fields)).eval()
    # Non-trivial norm weights so a norm applied in the wrong place shows.
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))
    return model.to(dtype)


def tokens_for(model: HookedRecurrentTransformer, batch: int = 2, pos: int = 12) -> torch.Tensor:
    return torch.randint(
        0, model.cfg.d_vocab, (batch, pos), generator=torch.Generator().manual_seed(0)
    )


def lm_sets(
    model: HookedRecurrentTransformer, n: int = 48, pos: int = 10, seed: int = 0
) -> tuple[EvaluationSet, EvaluationSet]:
    """Disjoint evaluation and calibration sets of random token sequences (language modelling)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.cfg.d_vocab, (2 * n, pos), generator=generator)
    return EvaluationSet.from_tokens(tokens[:n]), EvaluationSet.from_tokens(tokens[n:])


def assert_fast_path_matches_hooks(
    protocol: DepthControlProtocol, tokens: torch.Tensor, tol: float = 1e-6
) -> list[str]:
    """Every registered sweep condition (and full) at every k of the protocol's grid: the closed
    form over cached states equals the hook form on a forward pass, within ``tol``.

    Returns the names checked, so a caller can see that a newly registered condition was."""
    names = ["full", *SWEEP]
    for k in protocol.k_grid:
        for name in names:
            fast = protocol.condition_logits(tokens, name, k)
            hooked = protocol.condition_logits(tokens, name, k, via="hooks")
            assert (fast - hooked).abs().max() <= tol, (name, k)
    return names


DATA_DIR = Path(__file__).resolve().parents[1] / "demos" / "data"


def data_path(*parts: str) -> Path:
    """A file or folder of the repository's ``demos/data`` (the data and fixtures the tests read).

    Raises FileNotFoundError naming the path when the checkout lacks it.
    """
    path = DATA_DIR.joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: the tests read the data and fixtures committed under demos/data"
            " (see demos/data/README.md); restore them with `git checkout -- demos/data`"
        )
    return path
