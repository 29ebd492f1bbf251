"""Named training presets; each comes in the four regimes, identical apart from the regime.

>>> from dcp_lens.training import preset, train
>>> config = preset("tiny", regime="every-iteration", seed=1)
>>> result = train(config, "runs/tiny-every-iteration-1")      # doctest: +SKIP

- ``tiny``: for tests and smoke runs, not for science.
- ``default``: variable binding over 8 variables and 8 lines with one token per assignment
  (``c=b``), answers not shown, one chain of exactly 4 hops per program plus distractor chains,
  every variable queried; a 0 prelude + 1 core x 4 + 0 coda model (one block per iteration),
  d_model 96, 4 heads; AdamW lr 2e-3, batch 64, 4000 steps, a mastery curriculum over h. One
  block resolves one hop, so the fixed model needs iteration h for a query of h hops and its
  accuracy at k = 1 is the one-hop queries plus chance on the rest; with a prelude and a coda
  block around the core, the first iteration already resolved two hops. In text format
  (``c = b ;``), or with 16 variables, the same budget stays on the plateau: a lookup then
  needs a two-layer composition that small models take thousands of steps to form, or the
  line tokens of 16 variables are each seen too rarely.
- ``lm``: character-level language modelling of tinyshakespeare (`lm_text`: the bundled 1.1 MB
  file; 65 symbols, windows of 64 characters, every position scored), trained from scratch: a
  1 prelude + 1 core x 4 + 1 coda model, d_model 64, 4 heads; AdamW lr 3e-3, batch 32, 2000
  steps, no curriculum. From scratch rather than a retrofit of stories260K, so that all four
  regimes, the dense control included, are trained the same way from the same initialisation
  rule; character-level, so that the vocabulary is small and a step cheap. Language modelling
  is where readout shift shows: the fixed model's early states, read out through the final
  norm and unembedding it was never trained to read them with, are off-distribution.
- ``lm-tiny``: the same pipeline at a toy size (d_model 32, r = 3, 60 steps, windows of 32); its
  models barely learn.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dcp_lens import data
from dcp_lens.model.config import RecurrentConfig
from dcp_lens.tasks import Task, get_task
from dcp_lens.training.config import TrainConfig
from dcp_lens.training.regimes import REGIMES, RegimeConfig


def model_config(task: Task, **fields: Any) -> RecurrentConfig:
    """A `RecurrentConfig` sized for ``task`` (its d_vocab and n_ctx) with ``fields`` set."""
    return RecurrentConfig(d_vocab=task.d_vocab, n_ctx=task.n_ctx, **fields)


def _tiny(regime: RegimeConfig, seed: int) -> TrainConfig:
    task = get_task("variable_binding", n_variables=8, n_lines=4, max_hops=3, queries="all")
    model = model_config(
        task,
        d_model=32,
        n_heads=2,
        d_head=16,
        d_mlp=64,
        n_prelude=1,
        n_core=1,
        n_coda=1,
        n_iterations=3,
    )
    return TrainConfig(
        model=model,
        task=task.to_dict(),
        regime=regime,
        steps=60,
        batch_size=16,
        lr=3e-3,
        warmup_steps=10,
        eval_interval=20,
        eval_programs=32,
        table_programs=64,
        table_extra_iterations=2,
        checkpoint_interval=20,
        curriculum="mastery",
        curriculum_start=1,
        curriculum_threshold=0.9,
        seed=seed,
    )


def _default(regime: RegimeConfig, seed: int) -> TrainConfig:
    task = get_task(
        "variable_binding",
        n_variables=8,
        n_lines=8,
        max_hops=4,
        queries="all",
        chain_layout="longest",
        line_format="token",
        show_answers=False,
    )
    model = model_config(
        task,
        d_model=96,
        n_heads=4,
        d_head=24,
        d_mlp=384,
        n_prelude=0,
        n_core=1,
        n_coda=0,
        n_iterations=4,
    )
    return TrainConfig(
        model=model,
        task=task.to_dict(),
        regime=regime,
        steps=4000,
        batch_size=64,
        lr=2e-3,
        warmup_steps=100,
        eval_interval=100,
        eval_programs=256,
        table_programs=1024,
        table_extra_iterations=4,
        checkpoint_interval=500,
        curriculum="mastery",
        curriculum_start=1,
        curriculum_threshold=0.9,
        seed=seed,
    )


LM_TEXT_VARIABLE = "DCP_LENS_LM_TEXT"


def lm_text() -> Path:
    """The text the ``lm`` presets train on: ``$DCP_LENS_LM_TEXT`` if set, else the
    tinyshakespeare corpus shipped with the package (`dcp_lens.data`, see its README.md)."""
    variable = os.environ.get(LM_TEXT_VARIABLE)
    path = Path(variable) if variable else data.path("tinyshakespeare")
    if not path.is_file():
        raise FileNotFoundError(
            f"the lm presets train on {path}, which does not exist. Set {LM_TEXT_VARIABLE} to a "
            "UTF-8 text file (unset, the tinyshakespeare text shipped with dcp_lens is used)."
        )
    return path


def _lm_config(
    regime: RegimeConfig,
    seed: int,
    *,
    n_ctx: int,
    d_model: int,
    n_iterations: int,
    **training: Any,
) -> TrainConfig:
    task = get_task("char_lm", path=str(lm_text()), n_ctx=n_ctx, seed=0)
    model = model_config(
        task,
        d_model=d_model,
        n_heads=4,
        d_head=d_model // 4,
        d_mlp=4 * d_model,
        n_prelude=1,
        n_core=1,
        n_coda=1,
        n_iterations=n_iterations,
    )
    return TrainConfig(
        model=model,
        task=task.to_dict(),
        regime=regime,
        curriculum="none",
        table_extra_iterations=2,
        seed=seed,
        **training,
    )


def _lm(regime: RegimeConfig, seed: int) -> TrainConfig:
    return _lm_config(
        regime,
        seed,
        n_ctx=64,
        d_model=64,
        n_iterations=4,
        steps=2000,
        batch_size=32,
        lr=3e-3,
        warmup_steps=100,
        eval_interval=500,
        eval_programs=64,
        table_programs=256,
        checkpoint_interval=500,
    )


def _lm_tiny(regime: RegimeConfig, seed: int) -> TrainConfig:
    return _lm_config(
        regime,
        seed,
        n_ctx=32,
        d_model=32,
        n_iterations=3,
        steps=60,
        batch_size=16,
        lr=3e-3,
        warmup_steps=10,
        eval_interval=30,
        eval_programs=16,
        table_programs=32,
        checkpoint_interval=30,
    )


PRESETS: dict[str, Callable[[RegimeConfig, int], TrainConfig]] = {
    "tiny": _tiny,
    "default": _default,
    "lm": _lm,
    "lm-tiny": _lm_tiny,
}


def preset(
    name: str, regime: str | RegimeConfig = "fixed", seed: int = 0, **overrides: Any
) -> TrainConfig:
    """The `TrainConfig` of preset ``name`` in ``regime`` (a name from `REGIMES` or a full
    `RegimeConfig`) with ``seed``; ``overrides`` replace other TrainConfig fields."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}.")
    if isinstance(regime, str):
        if regime not in REGIMES:
            raise ValueError(f"regime={regime!r} is not one of {REGIMES}.")
        regime = RegimeConfig(name=regime)
    config = PRESETS[name](regime, seed)
    if not overrides:
        return config
    # The unresolved regime again, so its defaults follow an overridden model's r.
    return dataclasses.replace(config, **{"regime": regime, **overrides})
