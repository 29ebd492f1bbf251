"""Training the models of the controlled training intervention (docs/design.md §6).

>>> from dcp_lens.training import preset, train
>>> result = train(preset("tiny", regime="sampled"), "runs/tiny-sampled")   # doctest: +SKIP
>>> from dcp_lens.report.html import format_accuracy_table
>>> print(format_accuracy_table(result.accuracy_table))                     # doctest: +SKIP
"""

from __future__ import annotations

from dcp_lens.training.config import TrainConfig
from dcp_lens.training.evaluation import AccuracyTable, evaluate_accuracy
from dcp_lens.training.loop import TrainResult, learning_rate, train
from dcp_lens.training.presets import PRESETS, model_config, preset
from dcp_lens.training.regimes import (
    REGIMES,
    SAMPLINGS,
    RegimeConfig,
    build_regime_model,
    dense_config,
    every_iteration_loss,
    readout_logits,
    regime_loss,
    sample_iterations,
    scored_cross_entropy,
    truncated_backprop_loss,
)

__all__ = [
    "PRESETS",
    "REGIMES",
    "SAMPLINGS",
    "AccuracyTable",
    "RegimeConfig",
    "TrainConfig",
    "TrainResult",
    "build_regime_model",
    "dense_config",
    "evaluate_accuracy",
    "every_iteration_loss",
    "learning_rate",
    "model_config",
    "preset",
    "readout_logits",
    "regime_loss",
    "sample_iterations",
    "scored_cross_entropy",
    "train",
    "truncated_backprop_loss",
]
