"""Old module paths (before the stage packages) as aliases of the new ones, for one release.

``import dcp_lens.hooked_recurrent_transformer`` still works: it returns the module
`dcp_lens.model.hooked_recurrent_transformer` itself (same object, so patching either patches
both) and emits a `DeprecationWarning` naming the new path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

MOVED: dict[str, str] = {
    "dcp_lens.bench": "dcp_lens.studies.bench",
    "dcp_lens.bundled": "dcp_lens.zoo.bundled",
    "dcp_lens.calibration": "dcp_lens.protocol.calibration",
    "dcp_lens.checkpoint": "dcp_lens.utils.snapshots",
    "dcp_lens.components": "dcp_lens.model.components",
    "dcp_lens.components.attention": "dcp_lens.model.components.attention",
    "dcp_lens.components.block": "dcp_lens.model.components.block",
    "dcp_lens.components.embeddings": "dcp_lens.model.components.embeddings",
    "dcp_lens.components.mlp": "dcp_lens.model.components.mlp",
    "dcp_lens.components.norms": "dcp_lens.model.components.norms",
    "dcp_lens.components.rotary": "dcp_lens.model.components.rotary",
    "dcp_lens.conditions": "dcp_lens.protocol.conditions",
    "dcp_lens.config": "dcp_lens.model.config",
    "dcp_lens.decomposition": "dcp_lens.protocol.decomposition",
    "dcp_lens.devices": "dcp_lens.utils.devices",
    "dcp_lens.distributed": "dcp_lens.utils.distributed",
    "dcp_lens.errors": "dcp_lens.utils.errors",
    "dcp_lens.experiment": "dcp_lens.studies.intervention",
    "dcp_lens.figures": "dcp_lens.report.figures",
    "dcp_lens.hooked_recurrent_transformer": "dcp_lens.model.hooked_recurrent_transformer",
    "dcp_lens.incomplete": "dcp_lens.utils.files",
    "dcp_lens.interop": "dcp_lens.lenses.interop",
    "dcp_lens.intervention": "dcp_lens.training.outcomes",
    "dcp_lens.lens": "dcp_lens.lenses.lens",
    "dcp_lens.loading": "dcp_lens.zoo.loaders",
    "dcp_lens.loading.bridge": "dcp_lens.zoo.loaders.bridge",
    "dcp_lens.loading.checkpoint_files": "dcp_lens.model.folder",
    "dcp_lens.loading.hf_tokenizer": "dcp_lens.zoo.loaders.hf_tokenizer",
    "dcp_lens.loading.huginn": "dcp_lens.zoo.loaders.huginn",
    "dcp_lens.loading.llama2c": "dcp_lens.zoo.loaders.llama2c",
    "dcp_lens.loading.llama2c_format": "dcp_lens.zoo.loaders.llama2c_format",
    "dcp_lens.loading.ouro": "dcp_lens.zoo.loaders.ouro",
    "dcp_lens.loading.tokenizer": "dcp_lens.zoo.loaders.tokenizer",
    "dcp_lens.memory": "dcp_lens.utils.memory",
    "dcp_lens.metrics": "dcp_lens.protocol.metrics",
    "dcp_lens.planted": "dcp_lens.zoo.planted",
    "dcp_lens.planted_validation": "dcp_lens.studies.validate",
    "dcp_lens.probe": "dcp_lens.protocol.probe",
    "dcp_lens.registry": "dcp_lens.zoo.registry",
    "dcp_lens.report_data": "dcp_lens.studies.report_extras",
    "dcp_lens.results": "dcp_lens.protocol.results",
    "dcp_lens.retrofit": "dcp_lens.zoo.retrofit",
    "dcp_lens.states": "dcp_lens.protocol.states",
    "dcp_lens.statistics": "dcp_lens.protocol.statistics",
    "dcp_lens.tokenization": "dcp_lens.model.tokenization",
    "dcp_lens.training.checkpoint": "dcp_lens.training.state",
    "dcp_lens.training.validation": "dcp_lens.training.checks",
    "dcp_lens.validation": "dcp_lens.utils.checks",
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.target}; import it from there (the old path goes in the "
            "next release).",
            DeprecationWarning,
            stacklevel=4,
        )
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the target module is already executed


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old dotted names in `MOVED` and loads them as aliases of their new modules."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(MOVED[fullname]))


def install() -> None:
    """Put the finder first on `sys.meta_path`, once: an old name must not be found again as a file
    under its aliased parent package (two copies of one module)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
