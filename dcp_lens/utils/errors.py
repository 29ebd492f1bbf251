"""The errors dcp-lens raises about its inputs, one family under `DCPLensError`.

Every class subclasses `ValueError` (and `TypeError` or `FileNotFoundError` where that is what
the error is), so ``except ValueError`` written before this family existed still catches them.
A message names the file, the field or tensor, the value, what was expected and how to fix it.
"""

from __future__ import annotations


class DCPLensError(ValueError):
    """Base class: an input, file or setting dcp-lens refuses, with a message saying why."""


class ConfigError(DCPLensError):
    """A config file or field (model, task, training, a loader's source config) is invalid."""


class ConfigTypeError(ConfigError, TypeError):
    """A config field has the wrong type (a string seed, ``"false"`` for a boolean, ...)."""


class InputError(DCPLensError):
    """A tensor or value passed to the Python API is refused (empty, out of range, wrong
    device)."""


class InputTypeError(InputError, TypeError):
    """A tensor or value passed to the Python API has the wrong type."""


class MissingFileError(DCPLensError, FileNotFoundError):
    """A file or folder dcp-lens needs does not exist."""


class WeightsError(DCPLensError):
    """Weights of a kind dcp-lens refuses: wrong dtype, non-finite tables, pickle, links out."""


class DeviceError(DCPLensError):
    """A device or dtype that is unknown or not available on this machine."""


class DamagedFileError(DCPLensError):
    """A file written by dcp-lens (checkpoint, results) is truncated or corrupt."""


class IncompleteRunError(DCPLensError):
    """A run folder is marked incomplete: the run that wrote it did not finish."""


class ResourceLimitError(DCPLensError):
    """A size beyond dcp-lens's bounds, or one that cannot be allocated here."""


class UnsupportedToolError(DCPLensError):
    """A TransformerLens feature or tool this model does not build, with what to use instead."""


__all__ = [
    "ConfigError",
    "ConfigTypeError",
    "DCPLensError",
    "DamagedFileError",
    "DeviceError",
    "IncompleteRunError",
    "InputError",
    "InputTypeError",
    "MissingFileError",
    "ResourceLimitError",
    "UnsupportedToolError",
    "WeightsError",
]
