"""What the protocol needs of a map of readout inputs: a condition applies a `StateMap` and its
inverse; the fit stage hands over `FittedMap`s, which also name their mode and say how far they
are from the identity."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class StateMap(Protocol):
    """An invertible map of readout inputs, such as
    `dcp_lens.protocol.calibration.AffineCalibration`."""

    def __call__(self, h: Tensor) -> Tensor: ...

    def inverse(self) -> StateMap: ...


@runtime_checkable
class FittedMap(StateMap, Protocol):
    """A fitted calibration map: a `StateMap` that says how far it is from the identity (the null
    control) and names its ``mode`` (a fitted mode other than the one asked for is recorded as a
    fallback)."""

    @property
    def mode(self) -> str: ...

    def identity_deviation(self) -> dict[str, float]: ...
