"""`load(spec)`: one entry point for every model dcp-lens can diagnose (every registry of dcp-lens,
this one included, adds entries with `dcp_lens.utils.registry.add_entry`). Imports no model code
until a model is loaded.

A spec is ``"KIND:ARGUMENT"`` for a registered kind (``planted:readout_shift``, ``huginn:PATH``, …),
a bundled name (``default``, ``default-dense``, …), or the path of a `save_pretrained` folder.
Keyword arguments override fields of the model's `RecurrentConfig`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dcp_lens.utils.errors import ConfigError, ConfigTypeError
from dcp_lens.utils.registry import add_entry

Loader = Callable[..., Any]
LOADERS: dict[str, Loader] = {}
NAMED: dict[str, Loader] = {}
# kind -> pairing(model_spec, dense_spec): how a dense control's layers line up with a model of
# that kind (a JSON-like record, or None when it cannot tell), recorded with both runs' results.
Pairing = Callable[[str, str], "dict[str, Any] | None"]
PAIRINGS: dict[str, Pairing] = {}


def register_loader(kind: str) -> Callable[[Loader], Loader]:
    """Register ``loader(argument, **overrides)`` for specs ``"kind:argument"``."""

    def decorator(loader: Loader) -> Loader:
        _import_builtin_kinds()  # a built-in kind's name is taken before it is first loaded
        return add_entry(LOADERS, kind, loader, "loader kind")

    return decorator


def register_named(name: str) -> Callable[[Loader], Loader]:
    """Register ``loader(**overrides)`` for the bare spec ``name``."""

    def decorator(loader: Loader) -> Loader:
        _import_builtin_kinds()
        return add_entry(NAMED, name, loader, "named model")

    return decorator


def register_pairing(kind: str) -> Callable[[Pairing], Pairing]:
    """Register ``pairing(model_spec, dense_spec)`` for models of ``kind`` (`layer_pairing`)."""

    def decorator(pairing: Pairing) -> Pairing:
        _import_builtin_kinds()
        return add_entry(PAIRINGS, kind, pairing, "pairing")

    return decorator


def layer_pairing(model: str, dense: str) -> dict[str, Any] | None:
    """How the dense control ``dense`` lines up with ``model`` layer by layer, from the pairing
    registered for ``model``'s kind (a retrofit and its dense parent: which parent layers became
    the prelude, the core and the coda); None when no pairing is registered or it cannot tell."""
    _import_builtin_kinds()
    pairing = PAIRINGS.get(model.partition(":")[0])
    return None if pairing is None else pairing(model, dense)


def load(spec: str, **overrides: Any) -> Any:
    """Load the model a spec names; ``overrides`` replace `RecurrentConfig` fields.

    >>> model = load("planted:readout_shift")            # doctest: +SKIP
    >>> model = load("huginn:/models/huginn-0125", state_init="zeros")  # doctest: +SKIP
    """
    if not isinstance(spec, str):
        raise ConfigTypeError(f"a model spec must be a non-empty string, got {spec!r}.")
    if not spec.strip():
        raise ConfigError(f"a model spec must be a non-empty string, got {spec!r}.")
    from dcp_lens.utils.devices import check_device, check_dtype

    if overrides.get("device") is not None:  # one clear line before any loader's signature
        check_device(overrides["device"])
    if overrides.get("dtype") is not None:
        check_dtype(overrides["dtype"])
    _import_builtin_kinds()
    kind, _, argument = spec.partition(":")
    if argument and kind in LOADERS:
        return _named(LOADERS[kind](argument, **overrides), spec)
    if spec in NAMED:
        return _named(NAMED[spec](**overrides), spec)
    foreign = foreign_checkpoint(spec)
    if foreign is not None:
        kind, what = foreign
        raise ConfigError(
            f"{spec!r} holds {what}, not a dcp-lens model folder; load it with its kind's "
            f"prefix: load({kind + ':' + spec!r})."
        )
    if Path(spec).is_dir():
        from dcp_lens.model.hooked_recurrent_transformer import HookedRecurrentTransformer
        from dcp_lens.tasks import check_task_config

        model = HookedRecurrentTransformer.from_pretrained(spec, **overrides)
        if model.task_config is not None:  # the model stage checks its form, the tasks its fields
            check_task_config(model.task_config, str(Path(spec) / "task.json"))
        return _named(model, spec)
    raise ConfigError(
        f"unknown model spec {spec!r}: expected one of the kinds "
        f"{sorted(k + ':…' for k in LOADERS)}, a bundled name {sorted(NAMED)}, or a folder "
        "written by save_pretrained."
    )


def foreign_checkpoint(path: str) -> tuple[str, str] | None:
    """(loader kind, what it is) when ``path`` is a checkpoint a registered loader reads rather
    than a `save_pretrained` folder: a Huginn, retrofit, Ouro or HRM-Text ``config.json``, or
    llama2.c ``.bin`` files; None otherwise (nothing is read but ``config.json`` and, for a
    RavenConfig, the safetensors headers that tell Huginn-0125 from a retrofit)."""
    import json

    location = Path(path)
    folder = location.parent if location.is_file() else location
    if location.is_file() and location.suffix == ".bin":
        return "llama2c", "a llama2.c checkpoint"
    config = folder / "config.json"
    if not config.is_file():
        bins = sorted(folder.glob("*.bin")) if folder.is_dir() else []
        if bins:
            return "llama2c", f"llama2.c checkpoint files ({', '.join(b.name for b in bins)})"
        return None
    try:
        fields = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(fields, dict):
        return None
    model_type = str(fields.get("model_type", "")).lower()
    if fields.get("architecture_class_name") == "RecurrentGPT" or "huginn" in model_type:
        from dcp_lens.zoo.loaders.raven_retrofit import KIND, folder_family

        family = folder_family(folder)
        if family in ("llama", "olmo"):
            return KIND, f"a retrofitted-recurrence checkpoint ({family} variant, a RavenConfig)"
        return "huginn", "a Huginn checkpoint (config.json is a RavenConfig)"
    if model_type == "hrm_text":
        return "hrm-text", "an HRM-Text checkpoint (config.json has model_type 'hrm_text')"
    if model_type.startswith("ouro"):
        return "ouro", f"an Ouro checkpoint (config.json has model_type {model_type!r})"
    return None


def _named(model: Any, spec: str) -> Any:
    """``model`` with ``model.spec = spec``: results name it by default (`DepthControlProtocol`)."""
    model.spec = spec
    return model


def _import_builtin_kinds() -> None:
    """Register the built-in kinds and bundled names (imported here, on first use, so that
    `import dcp_lens` stays light; the loader modules do not import this registry back)."""
    global _builtins_imported
    if _builtins_imported:
        return
    _builtins_imported = True
    from dcp_lens.zoo.bundled import BUNDLED, bundled_loader
    from dcp_lens.zoo.loaders.bridge import load_bridge
    from dcp_lens.zoo.loaders.hrm_text import HRM_KIND as HRM_TEXT
    from dcp_lens.zoo.loaders.hrm_text import load_hrm_text
    from dcp_lens.zoo.loaders.huginn import load_huginn
    from dcp_lens.zoo.loaders.llama2c import load_llama2c
    from dcp_lens.zoo.loaders.ouro import load_ouro
    from dcp_lens.zoo.loaders.raven_retrofit import KIND as RAVEN_RETROFIT
    from dcp_lens.zoo.loaders.raven_retrofit import load_raven_retrofit, parent_layers_of_specs
    from dcp_lens.zoo.planted import load_planted

    kinds: dict[str, Loader] = {
        "planted": load_planted,
        "huginn": load_huginn,
        "ouro": load_ouro,
        "llama2c": load_llama2c,
        "bridge": load_bridge,
        RAVEN_RETROFIT: load_raven_retrofit,
        HRM_TEXT: load_hrm_text,
    }
    for kind, loader in kinds.items():
        add_entry(LOADERS, kind, loader, "loader kind")
    for name in BUNDLED:
        add_entry(NAMED, name, bundled_loader(name), "named model")
    add_entry(PAIRINGS, RAVEN_RETROFIT, parent_layers_of_specs, "pairing")


_builtins_imported = False
