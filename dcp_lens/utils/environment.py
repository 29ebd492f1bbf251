"""The versions a run records: Python, the platform and the packages dcp-lens depends on."""

from __future__ import annotations

import platform
from importlib import metadata


def environment() -> dict[str, str | None]:
    """Versions of Python, the platform and the packages a run depends on."""
    versions: dict[str, str | None] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    for package in ("dcp-lens", "torch", "transformer-lens", "numpy", "plotly", "circuitsvis"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions


__all__ = ["environment"]
