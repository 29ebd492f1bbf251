"""Training the models of the controlled training intervention (docs/design.md §6).

>>> from dcp_lens.training import preset, train
>>> result = train(preset("tiny", regime="sampled"), "runs/tiny-sampled")   # doctest: +SKIP
>>> print(result.accuracy_table.format())                                    # doctest: +SKIP
"""

from __future__ import annotations

from dcp_lens.training.presets import PRESETS, model_config, preset
from dcp_lens.training.regimes import (
    REGIMES,
    SAMPLINGS,
    RegimeConfig,
    build_model,
    dense_config,
    every_iteration_loss,
    readout_logits,
    regime_loss,
    sample_iterations,
    scored_cross_entropy,
    truncated_backprop_loss,
)
from dcp_lens.training.trainer import (
    AccuracyTable,
    TrainConfig,
    TrainResult,
    evaluate_accuracy,
    learning_rate,
    train,
)

__all__ = [
    "PRESETS",
    "REGIMES",
    "SAMPLINGS",
    "AccuracyTable",
    "RegimeConfig",
    "TrainConfig",
    "TrainResult",
    "build_model",
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
