"""Reading real checkpoints from local files into a `HookedRecurrentTransformer`.

Shared by every loader (``huginn``, ``ouro``, ``llama2c``):

- `SafetensorsCheckpoint`: one ``.safetensors`` file, or the shards a
  ``model.safetensors.index.json`` lists; shapes come from the headers, tensors are read on demand.
  Pickle files (``.bin``, ``.pt``, ``.pth``, ``.ckpt``) are never opened.
- `check_tensor_shapes`: missing, unexpected and wrong-shaped keys, named in the checkpoint's own
  key names, before any weight is read.
- `split_overrides`: keyword overrides of `RecurrentConfig` fields, plus ``device`` and ``dtype``.
- `build_model`: the model on the meta device, then the loaded tensors assigned in place of its
  parameters, so a 3.5B model is never initialised at random first.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from jaxtyping import Float
from torch import Tensor, nn

from dcp_lens.model.components.rotary import rotary_tables
from dcp_lens.model.config import RecurrentConfig
from dcp_lens.model.tokenization import Tokenizer
from dcp_lens.utils.checks import (
    as_declared_floats,
    check_field_types,
    check_inside,
    naming_file,
    read_json_object,
    weight_dtype,
)
from dcp_lens.utils.devices import check_device, check_dtype
from dcp_lens.utils.errors import ConfigError, ConfigTypeError, MissingFileError, WeightsError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TASK_FILE = "task.json"


@runtime_checkable
class LoadableModel(Protocol):
    """What loading weights calls on a model class (`HookedRecurrentTransformer` has it); methods
    only, so that a class is checked against it at run time."""

    def __init__(self, cfg: RecurrentConfig, tokenizer: Tokenizer | None = None) -> None: ...

    def canonical_state_dict(self) -> dict[str, Tensor]: ...

    def tie_weights(self) -> None: ...

    def sync_cfg_to_weights(self) -> None: ...

    def modules(self) -> Iterator[nn.Module]: ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def named_buffers(self) -> Iterator[tuple[str, Tensor]]: ...

    def register_buffer(
        self, name: str, tensor: Tensor | None, persistent: bool = True
    ) -> None: ...

    def eval(self: _ModelT) -> _ModelT: ...


# The model class hands itself in (`from_pretrained`): this module never imports it back.
_ModelT = TypeVar("_ModelT", bound=LoadableModel)
Shape = tuple[int, ...]


class SafetensorsCheckpoint:
    """The tensors of a local safetensors checkpoint, indexed by key without reading them.

    Args:
        path: a ``.safetensors`` file, or a folder holding ``model.safetensors.index.json`` (a
            sharded checkpoint) or a single ``model.safetensors``.

    Raises:
        MissingFileError: the path, or a shard the index names, does not exist.
        WeightsError: a file is truncated or not safetensors, links outside the folder, holds a
            tensor that is not float16/bfloat16/float32/float64, the index is malformed, or a
            shard does not hold exactly the keys the index assigns to it (named).
    """

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        files = _weight_files(self.path)
        self.source = str(self.path)
        self.file_of: dict[str, Path] = {}
        self.shapes: dict[str, Shape] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        folder = self.path if self.path.is_dir() else self.path.parent
        for file, keys in files.items():
            check_inside(file, folder)
            try:
                with safe_open(str(file), framework="pt") as handle:
                    slices = {key: handle.get_slice(key) for key in handle.keys()}
                    stored = {key: tuple(piece.get_shape()) for key, piece in slices.items()}
                    dtypes = {key: piece.get_dtype() for key, piece in slices.items()}
            except Exception as error:  # safetensors raises its own SafetensorError and OSError
                raise WeightsError(
                    f"{file} is not a readable safetensors file ({error}); the file is truncated "
                    "or corrupt, download or copy it again."
                ) from error
            if keys is not None:
                _check_shard_matches_index(file, set(stored), keys, self.path / INDEX_FILE)
            for key, shape in stored.items():
                self.dtypes[key] = weight_dtype(key, dtypes[key], str(file))
                if key in self.file_of:
                    raise WeightsError(
                        f"key {key!r} is stored twice, in {self.file_of[key]} and {file}; "
                        "remove one copy."
                    )
                self.file_of[key] = file
                self.shapes[key] = shape

    def __contains__(self, key: object) -> bool:
        return key in self.shapes

    def read(
        self,
        keys: Iterable[str] | None = None,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
    ) -> dict[str, Tensor]:
        """The tensors of ``keys`` (default: all), converted to ``dtype`` and moved to ``device``
        one at a time, so peak memory stays near the size of the result."""
        from safetensors import safe_open

        wanted = list(self.shapes) if keys is None else list(keys)
        unknown = [key for key in wanted if key not in self.shapes]
        if unknown:
            raise WeightsError(f"{self.source} holds no key {unknown[0]!r}.")
        by_file: dict[Path, list[str]] = defaultdict(list)
        for key in wanted:
            by_file[self.file_of[key]].append(key)
        tensors: dict[str, Tensor] = {}
        for file, file_keys in by_file.items():
            with safe_open(str(file), framework="pt") as handle:
                for key in file_keys:
                    tensors[key] = handle.get_tensor(key).to(device=device, dtype=dtype)
        return {key: tensors[key] for key in wanted}


class LazyTensors(MutableMapping[str, Tensor]):
    """The tensors of a `SafetensorsCheckpoint` as a mapping that reads each one when it is
    taken (``tensors[key]``, ``tensors.pop(key)``) and forgets it once popped: a loader that
    converts tensor by tensor then never holds the whole checkpoint beside its converted copy."""

    def __init__(self, checkpoint: SafetensorsCheckpoint, dtype: torch.dtype | None = None):
        self._checkpoint, self._dtype = checkpoint, dtype
        self._left = dict.fromkeys(checkpoint.shapes)

    def __getitem__(self, key: str) -> Tensor:
        if key not in self._left:
            raise KeyError(key)
        return self._checkpoint.read([key], dtype=self._dtype)[key]

    def __setitem__(self, key: str, value: Tensor) -> None:
        raise TypeError("LazyTensors reads a checkpoint; it holds no tensors of its own.")

    def __delitem__(self, key: str) -> None:
        del self._left[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._left)

    def __len__(self) -> int:
        return len(self._left)


def _weight_files(path: Path) -> dict[Path, set[str] | None]:
    """Files to read, each with the keys its index assigns to it (None: no index)."""
    if not path.exists():
        raise MissingFileError(f"{path} does not exist; pass a checkpoint folder or file.")
    if path.is_file():
        if path.suffix in PICKLE_SUFFIXES:
            raise WeightsError(pickle_message(path))
        return {path: None}
    index = path / INDEX_FILE
    if index.is_file():
        return _read_index(index)
    single = path / SINGLE_FILE
    if single.is_file():
        return {single: None}
    found = sorted(path.glob("*.safetensors"))
    if len(found) == 1:
        return {found[0]: None}
    if found:
        raise WeightsError(
            f"{path} holds {len(found)} .safetensors files but no {INDEX_FILE}; add the index "
            "(it says which shard holds each key) or pass one file."
        )
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise WeightsError(pickle_message(path / pickles[0]))
    raise MissingFileError(f"{path} holds no {SINGLE_FILE}, {INDEX_FILE} or .safetensors file.")


def pickle_message(path: Path) -> str:
    """Why a pickle checkpoint is refused, and what to do instead."""
    return (
        f"{path} is a pickle-based checkpoint, which dcp-lens never loads (unpickling can run "
        "code). Convert it to safetensors first, e.g. with safetensors.torch.save_file in a "
        "trusted environment."
    )


def _read_index(index: Path) -> dict[Path, set[str] | None]:
    data = read_json(index)
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightsError(f"{index} has no 'weight_map' object mapping keys to shard files.")
    shards: dict[Path, set[str] | None] = {}
    for key, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard:
            raise WeightsError(
                f"{index}: key {key!r} maps to {shard!r}; shard names must be plain file names "
                "in the same folder."
            )
        file = index.parent / shard
        if not file.is_file():
            raise MissingFileError(f"{index} puts key {key!r} in {shard}, which does not exist.")
        keys = shards.setdefault(file, set())
        assert keys is not None
        keys.add(key)
    return shards


def _check_shard_matches_index(file: Path, stored: set[str], listed: set[str], index: Path) -> None:
    absent = sorted(listed - stored)
    if absent:
        raise WeightsError(
            f"{index} puts key {absent[0]!r} in {file.name}, but that shard lacks it."
        )
    extra = sorted(stored - listed)
    if extra:
        raise WeightsError(
            f"{file} holds key {extra[0]!r}, which {index.name} does not list; the index and "
            "the shards do not match."
        )


def read_json(path: str | Path) -> dict[str, Any]:
    """A JSON object from a file; a `ConfigError` naming the file if it is missing, binary, not
    valid JSON or not an object."""
    return read_json_object(path)


def check_tensor_shapes(
    shapes: Mapping[str, Shape],
    expected: Mapping[str, Shape],
    source: str,
    optional: Mapping[str, Shape | None] | None = None,
) -> None:
    """Raise `WeightsError` naming the first missing, unexpected or wrong-shaped key.

    Args:
        shapes: key -> shape of what the checkpoint holds.
        expected: key -> shape every valid checkpoint holds.
        source: the file or folder, for the message.
        optional: keys that may be present (with that shape; None accepts any shape).
    """
    optional = optional or {}
    missing = [key for key in expected if key not in shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightsError(
            f"{source}: missing key {missing[0]!r} (shape {expected[missing[0]]}){more}; the "
            "checkpoint is incomplete or is not this architecture."
        )
    unexpected = sorted(key for key in shapes if key not in expected and key not in optional)
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise WeightsError(
            f"{source}: unexpected key {unexpected[0]!r} (shape {shapes[unexpected[0]]}){more}; "
            "the checkpoint holds weights this architecture has no place for."
        )
    for key, shape in shapes.items():
        wanted = expected.get(key, optional.get(key))
        if wanted is not None and tuple(shape) != tuple(wanted):
            raise WeightsError(
                f"{source}: key {key!r} has shape {tuple(shape)}, expected {tuple(wanted)} from "
                "the config; the config and the weights do not match."
            )


def config_field_names() -> set[str]:
    """`RecurrentConfig` fields a loader accepts as keyword overrides."""
    return {f.name for f in dataclasses.fields(RecurrentConfig) if f.init} - {"n_layers"}


def split_overrides(
    overrides: Mapping[str, Any],
) -> tuple[dict[str, Any], str | torch.device | None, torch.dtype | None]:
    """Separate ``device`` and ``dtype`` from `RecurrentConfig` field overrides.

    Returns:
        (config overrides, device or None, dtype or None); ``dtype`` may be given as a
        ``torch.dtype`` or a name such as ``"bfloat16"``.
    """
    fields = dict(overrides)
    device = fields.pop("device", None)
    dtype = fields.pop("dtype", None)
    # Checked once, here, before any file is read: an unavailable device is one clear line.
    device = None if device is None else check_device(device)
    dtype = None if dtype is None else check_dtype(dtype)
    unknown = sorted(set(fields) - config_field_names())
    if unknown:
        raise ConfigError(
            f"unknown overrides {unknown}: keyword overrides must be RecurrentConfig fields "
            f"({sorted(config_field_names())}), device or dtype."
        )
    check_field_types(RecurrentConfig, fields, "overrides")
    return as_declared_floats(RecurrentConfig, fields), device, dtype


def build_model(
    model_class: type[_ModelT],
    cfg: RecurrentConfig,
    state: Mapping[str, Tensor],
    source: str,
    tokenizer: Tokenizer | None = None,
    device: str | torch.device | None = None,
    model: _ModelT | None = None,
) -> _ModelT:
    """A model of ``cfg`` holding ``state`` (a `canonical_state_dict`), in eval mode.

    The model is built on the meta device (no memory, no random init) and every parameter is then
    replaced by its loaded tensor wherever it appears, so tied copies stay one object.

    Raises:
        WeightsError: ``state`` misses a canonical key, has an extra one, or a wrong shape.
    """
    if model is None:  # a meta model already built for an earlier shape check is reused
        model = meta_model(model_class, cfg, tokenizer)
    placeholders = model.canonical_state_dict()
    check_tensor_shapes(
        {key: tuple(value.shape) for key, value in state.items()},
        {key: tuple(p.shape) for key, p in placeholders.items()},
        f"{source} (converted to dcp-lens names)",
    )
    holders: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
    for module in model.modules():
        for name, parameter in module._parameters.items():
            if parameter is not None:
                holders[id(parameter)].append((module, name))
    for key, placeholder in placeholders.items():
        value = state[key].to(device)
        if _shares_storage(value):
            value = value.clone()  # safetensors refuses to save tensors that share memory
        loaded = nn.Parameter(value, requires_grad=placeholder.requires_grad)
        for module, name in holders[id(placeholder)]:
            module._parameters[name] = loaded
    model.tie_weights()
    _materialise_rotary_tables(model, cfg, device)
    left_on_meta = [name for name, p in model.named_parameters() if p.is_meta]
    left_on_meta += [name for name, b in model.named_buffers() if b.is_meta]
    if left_on_meta:
        raise RuntimeError(
            f"{model_class.__name__}: {left_on_meta[:5]} were not loaded; the loader does not "
            "cover every parameter of this architecture."
        )
    model.sync_cfg_to_weights()  # cfg.dtype and cfg.device as the loaded weights are
    return model.eval()


def _shares_storage(tensor: Tensor) -> bool:
    """True if ``tensor`` is a view into a larger buffer (a slice of a stacked array)."""
    return tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()


def _materialise_rotary_tables(
    model: LoadableModel, cfg: RecurrentConfig, device: str | torch.device | None
) -> None:
    """The rotary cos/sin buffers are built from the config; on meta they hold no values."""
    if cfg.positional_embedding_type == "learned":
        return
    cos, sin = rotary_tables(cfg.n_ctx, cfg.d_head, cfg.rotary_base, cfg.rotary_scaling)
    model.register_buffer("rotary_cos", cos.to(device), persistent=False)
    model.register_buffer("rotary_sin", sin.to(device), persistent=False)


def meta_model(
    model_class: type[_ModelT], cfg: RecurrentConfig, tokenizer: Tokenizer | None = None
) -> _ModelT:
    """The model of ``cfg`` on the meta device: its parameter shapes, no memory, no init."""
    with torch.device("meta"):
        return model_class(cfg, tokenizer=tokenizer)


def load_pretrained_folder(
    model_class: type[_ModelT],
    path: str | Path,
    device: str | torch.device | None = None,
    **overrides: Any,
) -> _ModelT:
    """A folder written by ``save_pretrained`` (config.json, model.safetensors, optional
    task.json), checked before anything is allocated.

    The config is validated, the model is built on the meta device and the weights' shapes and
    dtypes (read from the safetensors header) are checked against it; only then are the weights
    read and assigned. The model takes the checkpoint's dtype and is in eval mode.

    Raises:
        MissingFileError: the folder lacks config.json or model.safetensors.
        ConfigError: config.json or task.json is invalid (the file, field and value are named).
        WeightsError: the weights miss a key, hold an extra one, a wrong shape or dtype, are
            truncated, or link outside the folder.
    """
    folder = Path(path)
    config_path, weights_path = folder / CONFIG_FILE, folder / SINGLE_FILE
    for file in (config_path, weights_path):
        if not file.is_file():
            raise MissingFileError(f"{file} does not exist; expected a save_pretrained folder.")
    target = None if device is None else check_device(device)
    config = read_json_object(config_path)
    unknown = sorted(set(overrides) - set(config))
    if unknown:
        raise ConfigError(f"unknown config overrides {unknown}; known keys: {sorted(config)}.")
    with naming_file(config_path):
        cfg = RecurrentConfig.from_dict({**config, **overrides})
    task_config = None
    if (folder / TASK_FILE).is_file():
        # Only its form here: the task's own fields are checked by the tasks stage
        # (`dcp_lens.tasks.task_of`, and `dcp_lens.load` on a folder).
        task_config = read_json_object(folder / TASK_FILE)
    checkpoint = SafetensorsCheckpoint(weights_path)
    model = meta_model(model_class, cfg)
    expected = {key: tuple(p.shape) for key, p in model.canonical_state_dict().items()}
    check_tensor_shapes(checkpoint.shapes, expected, str(weights_path))
    state = checkpoint.read()
    loaded = build_model(model_class, cfg, state, str(weights_path), device=target, model=model)
    loaded.task_config = task_config  # type: ignore[attr-defined]
    return loaded


def require_values(
    config: Mapping[str, object], supported: Mapping[str, Collection[object]], source: str
) -> None:
    """Raise `ConfigError` if a config switch in ``config`` has a value we do not implement."""
    for key, allowed in supported.items():
        if key in config and not any(_same_value(config[key], value) for value in allowed):
            raise ConfigError(
                f"{source}: {key}={config[key]!r} is not supported (dcp-lens implements "
                f"{sorted(map(repr, allowed))}); this checkpoint is a different architecture."
            )


def required_int(config: Mapping[str, object], key: str, source: str) -> int:
    """``config[key]``, which must be an int >= 0; a `ConfigError` naming the key otherwise."""
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(f"{source}: field {key!r} must be an integer, got {value!r}.")
    if value < 0:
        raise ConfigError(f"{source}: field {key}={value} must be >= 0.")
    return value


def _same_value(value: object, allowed: object) -> bool:
    """Equality that keeps booleans apart from numbers (``False == 0`` in Python)."""
    return isinstance(value, bool) == isinstance(allowed, bool) and value == allowed


def heads_in(
    weight: Float[Tensor, "head_features d_model"], n_heads: int
) -> Float[Tensor, "head d_model d_head"]:
    """An ``nn.Linear`` q/k/v weight [heads * d_head, d_model] (head-major rows) -> W_Q-style
    [head, d_model, d_head], so that ``x @ W[h]`` is head h's projection."""
    return weight.unflatten(0, (n_heads, -1)).transpose(1, 2).contiguous()


def heads_out(
    weight: Float[Tensor, "d_model head_features"], n_heads: int
) -> Float[Tensor, "head d_head d_model"]:
    """An ``nn.Linear`` output weight [d_model, heads * d_head] -> W_O [head, d_head, d_model]."""
    return weight.T.unflatten(0, (n_heads, -1)).contiguous()


def drop_tied_head(
    tensors: MutableMapping[str, Tensor], head: str, embedding: str, source: str
) -> None:
    """Remove the stored copy of a tied unembedding, after checking it equals the embedding
    (the model ties the two itself; a differing copy means an inconsistent checkpoint)."""
    stored = tensors.pop(head, None)
    if stored is not None and not torch.equal(stored, tensors[embedding]):
        raise WeightsError(
            f"{source}: {head!r} differs from {embedding!r}, but the config ties them; the "
            "checkpoint is inconsistent."
        )
