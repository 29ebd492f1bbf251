"""The bundled default checkpoints: small variable-binding models that `dcp-lens run` diagnoses
out of the box, one per training regime of the ``default`` preset.

- ``default``: the ``fixed`` regime;
- ``default-every-iteration``: the ``every-iteration`` regime;
- ``default-dense``: the matched ``dense`` model,

each made by ``dcp-lens train --preset default --regime REGIME --seed 0 --out RUN``. Each lives
in ``dcp_lens/zoo/bundled_models/NAME/``: the model as `HookedRecurrentTransformer.save_pretrained`
writes it (``config.json``, ``model.safetensors``, ``task.json``), the run's
``train_config.json`` (every setting and the seed), its held-out ``accuracy_table.json`` (per hop
count h and iteration count k), and ``provenance.json`` (the command, the library and torch
versions). `bundle` copies a finished run there; ``tests/acceptance/test_bundled.py`` checks that
each loaded
checkpoint reproduces its table.

>>> import dcp_lens
>>> model = dcp_lens.load("default")                   # doctest: +SKIP
>>> table = stored_accuracy_table("default")           # doctest: +SKIP
"""

from __future__ import annotations

import json
import platform
import shutil
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from dcp_lens.model.hooked_recurrent_transformer import HookedRecurrentTransformer
from dcp_lens.model.tokenization import VocabularyTokenizer
from dcp_lens.utils.devices import check_dtype

BUNDLED_MODELS = Path(__file__).parent / "bundled_models"
# Bundled name -> the training regime of the default preset it was trained with.
BUNDLED: dict[str, str] = {
    "default": "fixed",
    "default-every-iteration": "every-iteration",
    "default-dense": "dense",
}
MODEL_FILES = ("config.json", "model.safetensors", "task.json")
# Stored precision of the bundled weights (they are computed with in float32).
STORAGE_DTYPE = torch.float16
RUN_FILES = ("train_config.json", "accuracy_table.json")
PROVENANCE_FILE = "provenance.json"
# Everything a bundle folder holds.
BUNDLE_FILES = (*MODEL_FILES, *RUN_FILES, PROVENANCE_FILE)
# The bundled files must stay small enough to ship inside the wheel.
MAX_BYTES = 2_000_000


def bundled_path(name: str) -> Path:
    """The folder of bundled checkpoint ``name`` (one of `BUNDLED`)."""
    if name not in BUNDLED:
        raise ValueError(f"unknown bundled checkpoint {name!r}; bundled: {sorted(BUNDLED)}.")
    folder = BUNDLED_MODELS / name
    if not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the bundled checkpoint {name!r} is missing from {folder}: the package was built "
            "without its data files. Reinstall dcp-lens, or rebuild it with "
            f"`dcp-lens train --preset default --regime {BUNDLED[name]} --seed 0 --out RUN` and "
            "`dcp_lens.zoo.bundled.bundle(RUN, name)`."
        )
    return folder


def load_bundled(name: str, **overrides: Any) -> HookedRecurrentTransformer:
    """Bundled checkpoint ``name`` as a float32 model in eval mode (``overrides`` as in
    `HookedRecurrentTransformer.from_pretrained`); ``model.task_config`` is its task."""
    return load_bundled_from(bundled_path(name), **overrides)


def load_bundled_from(folder: str | Path, **overrides: Any) -> HookedRecurrentTransformer:
    """A bundle folder as a float32 model (or ``dtype=``) in eval mode (the weights are stored in
    float16), with a `VocabularyTokenizer` of its task's symbols attached."""
    from dcp_lens.tasks import get_task

    dtype = overrides.pop("dtype", None)
    model = HookedRecurrentTransformer.from_pretrained(folder, **overrides)
    model = model.to(check_dtype(dtype) if dtype is not None else torch.float32).eval()
    if model.task_config is not None and model.tokenizer is None:
        task = get_task(**model.task_config)
        if not task.uses_model_tokenizer and task.d_vocab <= model.cfg.d_vocab:
            model.tokenizer = VocabularyTokenizer(list(task.vocab), separator=" ")
    return model


def stored_accuracy_table(name: str) -> Any:
    """The held-out accuracy table written beside bundled checkpoint ``name``
    (a `dcp_lens.training.AccuracyTable`)."""
    from dcp_lens.training import AccuracyTable

    return AccuracyTable.from_dict(_read_json(bundled_path(name) / "accuracy_table.json"))


def stored_train_config(name: str) -> dict[str, Any]:
    """The ``train_config.json`` of bundled checkpoint ``name``: every setting and the seed."""
    return _read_json(bundled_path(name) / "train_config.json")


def bundle(run_dir: str | Path, name: str, destination: str | Path = BUNDLED_MODELS) -> Path:
    """Copy the finished training run ``run_dir`` (a `dcp_lens.training.train` folder) into
    ``destination/name`` as bundled checkpoint ``name``, with its provenance.

    The weights are stored in float16 to stay well under `MAX_BYTES` (`load_bundled` computes in
    float32), so the accuracy table written beside them is measured again on the stored weights,
    on the same programs and k as the run's own table; ``provenance.json`` records the largest
    difference between the two.

    Raises ValueError when the run is unfinished, was not trained with the regime ``name``
    stands for, or the bundle would exceed `MAX_BYTES`.
    """
    from safetensors.torch import save_file

    from dcp_lens.tasks import get_task
    from dcp_lens.training import AccuracyTable, evaluate_accuracy

    if name not in BUNDLED:
        raise ValueError(f"unknown bundled checkpoint {name!r}; bundled: {sorted(BUNDLED)}.")
    run = Path(run_dir)
    sources = [run / "model" / file for file in MODEL_FILES] + [run / file for file in RUN_FILES]
    missing = [str(path) for path in sources if not path.is_file()]
    if missing:
        raise ValueError(
            f"{run} is not a finished training run: missing {missing}. Let `dcp-lens train` "
            "finish (it resumes where it stopped)."
        )
    config = _read_json(run / "train_config.json")
    regime = config["regime"]["name"]
    if regime != BUNDLED[name]:
        raise ValueError(
            f"{name!r} is the {BUNDLED[name]!r} model, but {run} was trained with regime "
            f"{regime!r}."
        )
    target = Path(destination) / name
    target.mkdir(parents=True, exist_ok=True)
    for file in ("config.json", "task.json"):
        shutil.copyfile(run / "model" / file, target / file)
    shutil.copyfile(run / "train_config.json", target / "train_config.json")
    trained = HookedRecurrentTransformer.from_pretrained(run / "model")
    tensors = {
        key: value.detach().to(STORAGE_DTYPE).contiguous().cpu()
        for key, value in trained.canonical_state_dict().items()
    }
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "dcp-lens"})

    training_table = AccuracyTable.from_dict(_read_json(run / "accuracy_table.json"))
    model = load_bundled_from(target)
    task = get_task(**_read_json(target / "task.json"))
    table = evaluate_accuracy(
        model,
        task,
        training_table.n_programs,
        training_table.k_values,
        split=training_table.split,  # type: ignore[arg-type]
    )
    (target / "accuracy_table.json").write_text(json.dumps(table.to_dict(), indent=2) + "\n")
    differences = [
        abs(table.at(h, k) - accuracy)
        for h, per_k in training_table.by_hops.items()
        for k, accuracy in per_k.items()
    ] + [abs(table.overall[k] - accuracy) for k, accuracy in training_table.overall.items()]

    size = sum(path.stat().st_size for path in target.iterdir() if path.is_file())
    if size > MAX_BYTES:
        shutil.rmtree(target)
        raise ValueError(f"bundle {name!r} would hold {size} bytes, more than {MAX_BYTES}.")
    history = _read_json(run / "history.json") if (run / "history.json").is_file() else {}
    provenance = {
        "name": name,
        "regime": regime,
        "seed": config["seed"],
        "steps": config["steps"],
        "command": (
            f"dcp-lens train --preset default --regime {regime} --seed {config['seed']} "
            f"--out RUN && python -c \"from dcp_lens.zoo.bundled import bundle; bundle('RUN', "
            f"'{name}')\""
        ),
        "storage_dtype": str(STORAGE_DTYPE).removeprefix("torch."),
        "max_accuracy_difference_from_training_table": max(differences),
        "seconds_per_step": history.get("timing", {}).get("seconds_per_step"),
        "dcp_lens_version": _version("dcp-lens"),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
    }
    (target / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
    return target


def _read_json(path: Path) -> dict[str, Any]:
    with path.open() as handle:
        data: dict[str, Any] = json.load(handle)
    return data


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def bundled_loader(name: str) -> Callable[..., HookedRecurrentTransformer]:
    """``loader(**overrides)`` of the bundled model ``name``, for the bare spec ``name``."""

    def loader(**overrides: Any) -> HookedRecurrentTransformer:
        return load_bundled(name, **overrides)

    return loader
