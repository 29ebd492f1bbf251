"""Label-free calibration of the readout input (docs/design.md §3, `calibrate` and `shift`): the
streamed moments a map is fitted from (`moments`), their linear algebra (`linalg`), the affine
moment-matching maps (`affine`), the input-dependent mixture map (`mixture`) and the registry of
kinds of map the protocol fits (`registry`)."""

from dcp_lens.protocol.calibration.affine import (
    AFFINE_MODES,
    MIN_STATES,
    AffineCalibration,
    CalibrationFallbackWarning,
    fit_calibration,
    usable_mode,
)
from dcp_lens.protocol.calibration.linalg import (
    FLOAT32_CONDITION,
    ShrunkCovariance,
    ledoit_wolf_shrinkage,
    symmetric_eigh,
    symmetric_power,
)
from dcp_lens.protocol.calibration.mixture import MixtureCalibration
from dcp_lens.protocol.calibration.moments import MomentsState, StreamingMoments, all_finite
from dcp_lens.protocol.calibration.registry import (
    CALIBRATION_MAPS,
    CalibrationMap,
    MapSettings,
    register_calibration_map,
)
from dcp_lens.protocol.maps import FittedMap, StateMap

__all__ = [
    "AFFINE_MODES",
    "CALIBRATION_MAPS",
    "FLOAT32_CONDITION",
    "MIN_STATES",
    "AffineCalibration",
    "CalibrationFallbackWarning",
    "CalibrationMap",
    "FittedMap",
    "MapSettings",
    "MixtureCalibration",
    "MomentsState",
    "ShrunkCovariance",
    "StateMap",
    "StreamingMoments",
    "all_finite",
    "fit_calibration",
    "ledoit_wolf_shrinkage",
    "register_calibration_map",
    "symmetric_eigh",
    "symmetric_power",
    "usable_mode",
]
