"""The registry of calibration maps (`CALIBRATION_MAPS`) and what the protocol needs of one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import Tensor

from dcp_lens.protocol.calibration.affine import AFFINE_MODES, AffineCalibration, fit_calibration
from dcp_lens.protocol.calibration.mixture import MixtureCalibration
from dcp_lens.protocol.calibration.moments import StreamingMoments
from dcp_lens.protocol.maps import FittedMap
from dcp_lens.utils.registry import add_entry


@runtime_checkable
class MapSettings(Protocol):
    """The protocol settings a map's fit may read (a `dcp_lens.protocol.config.ProtocolConfig`)."""

    @property
    def mixture_components(self) -> int: ...

    @property
    def calibration_points(self) -> int: ...

    @property
    def seed(self) -> int: ...


@dataclass(frozen=True)
class CalibrationMap:
    """One kind of calibration map of the S control, as `CALIBRATION_MAPS` registers it.

    A map is fitted either from the streamed moments of the source and reference readout inputs
    (``from_moments``; no states kept) or, when ``from_moments`` is None, from fixed-size
    subsamples of them (``from_states``; the protocol keeps ``calibration_points`` states per
    condition). ``from_states`` also fits the calibration null (between two halves of full
    depth's states), so every map has it.

    Attributes:
        name: the ``calibration_mode`` that picks it.
        from_states: ``(source [n, d], reference [m, d], settings) -> map``.
        from_moments: ``(source, reference, settings) -> map`` from `StreamingMoments`, or None.
        describe: ``settings -> dict``: what results record of the map beyond its mode.
        lower_bound: whether the map's gain bounds readout shift from below (docs/bracket.md):
            an affine moment-matching map cannot add information about the example; a map that
            can move each state anywhere on the other marginal (optimal transport between
            mixtures) can carry out the remaining computation itself, so with it S is never
            identified and the verdict stays inconclusive.
    """

    name: str
    from_states: Callable[[Tensor, Tensor, MapSettings], FittedMap]
    from_moments: Callable[[StreamingMoments, StreamingMoments, MapSettings], FittedMap] | None = (
        None
    )
    describe: Callable[[MapSettings], dict[str, int | str]] = lambda settings: {}
    lower_bound: bool = True

    @property
    def needs_states(self) -> bool:
        """Whether the protocol must keep subsamples of states to fit it."""
        return self.from_moments is None


CALIBRATION_MAPS: dict[str, CalibrationMap] = {}


def register_calibration_map(entry: CalibrationMap) -> CalibrationMap:
    """Add ``entry`` to `CALIBRATION_MAPS` (a second entry under a taken name is refused); its
    name is then a ``calibration_mode`` of the protocol and of ``dcp-lens run``."""
    return add_entry(CALIBRATION_MAPS, entry.name, entry, "calibration map")


def _affine(mode: str) -> CalibrationMap:
    return CalibrationMap(
        mode,
        from_states=lambda source, reference, settings: fit_calibration(source, reference, mode),
        from_moments=lambda source, reference, settings: AffineCalibration.fit(
            source, reference, mode
        ),
    )


for _mode in AFFINE_MODES:
    register_calibration_map(_affine(_mode))
register_calibration_map(
    CalibrationMap(
        "mixture",
        from_states=lambda source, reference, settings: MixtureCalibration.fit(
            source, reference, settings.mixture_components, settings.seed
        ),
        describe=lambda settings: {
            "components": settings.mixture_components,
            "calibration_points": settings.calibration_points,
            "plan": "optimal transport between cluster weights, Wasserstein-2 (Bures) cost",
        },
        lower_bound=False,
    )
)
