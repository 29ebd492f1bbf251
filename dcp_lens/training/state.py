"""Resumable checkpoints of a training run: the run folder's preparation, the safetensors
checkpoint (model, optimizer, RNG) with the trainer's plain state, and atomic JSON writes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import torch
from safetensors.torch import save_file

from dcp_lens.model.hooked_recurrent_transformer import HookedRecurrentTransformer
from dcp_lens.training.config import CHECKPOINT_DIR, RUN_FIELDS, TRAIN_CONFIG_FILE, TrainConfig
from dcp_lens.training.evaluation import AccuracyRecord
from dcp_lens.utils.checks import read_json_object, read_safetensors_file
from dcp_lens.utils.errors import DamagedFileError, DCPLensError
from dcp_lens.utils.files import temporary_folder, write_text_atomically, written_atomically
from dcp_lens.utils.folders import remove_own_files, rename_folder

CHECKPOINT_TENSORS = "state.safetensors"
CHECKPOINT_STATE = "trainer_state.json"
CHECKPOINT_FORMAT = "dcp-lens-checkpoint/1"


class StepRecord(TypedDict):
    """One optimiser step in ``history.json``."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    iterations: int
    max_hops: int | None


class EvaluationRecord(TypedDict):
    """A periodic evaluation in ``history.json``: the accuracy table at that step."""

    step: int
    max_hops: int | None
    accuracy: AccuracyRecord


class CurriculumRecord(TypedDict):
    """A change of the curriculum's max_hops in ``history.json``."""

    step: int
    max_hops: int | None


class History(TypedDict):
    """``history.json`` while a run trains (the finished file adds its timing)."""

    steps: list[StepRecord]
    evaluations: list[EvaluationRecord]
    curriculum: list[CurriculumRecord]


@dataclass
class RunState:
    """The trainer's plain (JSON) state besides tensors, as a checkpoint restores it."""

    step: int
    max_hops: int | None
    history: History


def config_differences(saved_path: Path, config: TrainConfig) -> list[str]:
    """The fields, other than `RUN_FIELDS`, in which the config saved at ``saved_path``
    differs from ``config`` (sorted; empty when the run is a run of ``config``)."""
    saved = TrainConfig.from_json(saved_path).to_dict()
    current = config.to_dict()
    return sorted(k for k in current if k not in RUN_FIELDS and saved.get(k) != current[k])


def prepare_run_folder(config: TrainConfig, out: Path, resume: bool) -> None:
    """Check that a previous run in ``out`` is a run of ``config`` (resume); without resume
    there is nothing to do (`dcp_lens.utils.folders.OutputFolder` removed the run's files)."""
    saved_path = out / TRAIN_CONFIG_FILE
    if not resume:  # the folder's own checkpoints went with its other files (`OutputFolder`)
        return
    if latest_checkpoint(out) is None or not saved_path.is_file():
        return
    differ = config_differences(saved_path, config)
    if differ:
        raise ValueError(
            f"{out} holds a run with a different config (fields {differ} differ); resume it "
            "with the same config, pick another out_dir, or pass resume=False to replace it."
        )


def latest_checkpoint(out: Path) -> Path | None:
    """The latest complete checkpoint folder in ``out``, if any."""
    for name in (CHECKPOINT_DIR, CHECKPOINT_DIR + ".old"):
        folder = out / name
        if (folder / CHECKPOINT_TENSORS).is_file() and (folder / CHECKPOINT_STATE).is_file():
            return folder
    return None


def save_checkpoint(
    out: Path,
    model: HookedRecurrentTransformer,
    optimizer: torch.optim.Optimizer,
    names: list[str],
    sampler: torch.Generator,
    state: RunState,
    config: TrainConfig,
) -> None:
    """Write the checkpoint to a temporary folder, then swap it in (never a half-written one)."""
    tensors = {
        f"model.{k}": v.detach().cpu().contiguous() for k, v in model.canonical_state_dict().items()
    }
    optimizer_state = optimizer.state_dict()
    for index, per_parameter in optimizer_state["state"].items():
        for key, value in per_parameter.items():
            tensors[f"optimizer.{names[index]}.{key}"] = value.detach().cpu().contiguous()
    tensors["rng.sampler"] = sampler.get_state()
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        for i, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = cuda_state
    plain = {
        "format": CHECKPOINT_FORMAT,
        "step": state.step,
        "max_hops": state.max_hops,
        "history": state.history,
        "parameter_names": names,
        "param_groups": optimizer_state["param_groups"],
        "config": config.to_dict(),
    }
    final, old = out / CHECKPOINT_DIR, out / (CHECKPOINT_DIR + ".old")
    tmp = temporary_folder(final)
    with written_atomically(tmp / CHECKPOINT_TENSORS) as partial:
        save_file(tensors, str(partial), metadata={"format": CHECKPOINT_FORMAT})
    write_json(tmp / CHECKPOINT_STATE, plain)
    # The previous checkpoint stays whole under ``old`` until the new one is in place; of
    # either folder only the files the run recorded go, a user's are kept (moved along).
    remove_own_files(out, old)
    parked = old if not old.exists() else temporary_folder(old)  # ``old``: a user's folder
    if final.exists():
        rename_folder(out, final, parked)
    rename_folder(out, tmp, final)
    remove_own_files(out, parked, others_to=final)


def load_checkpoint(
    folder: Path,
    model: HookedRecurrentTransformer,
    optimizer: torch.optim.Optimizer,
    names: list[str],
    sampler: torch.Generator,
) -> RunState:
    """Restore model, optimizer and RNG from ``folder``; return the trainer state."""
    recovery = (
        f"Delete {folder} to resume from the previous checkpoint (if {CHECKPOINT_DIR}.old "
        "exists) or from scratch, or pass resume=False (--no-resume) to start over."
    )
    plain = read_json_object(folder / CHECKPOINT_STATE, error=DamagedFileError, recovery=recovery)
    if plain.get("format") != CHECKPOINT_FORMAT:
        raise DamagedFileError(
            f"{folder} is not a checkpoint of dcp-lens (format {plain.get('format')!r}, expected "
            f"{CHECKPOINT_FORMAT!r}). {recovery}"
        )
    _check_plain_state(plain, folder / CHECKPOINT_STATE, recovery)
    if plain["parameter_names"] != names:
        raise DamagedFileError(
            f"{folder} is a checkpoint of another model (its parameter_names differ). {recovery}"
        )
    tensors = read_safetensors_file(folder / CHECKPOINT_TENSORS, recovery=recovery)
    for key in ("rng.sampler", "rng.torch"):
        if key not in tensors or tensors[key].dtype != torch.uint8 or tensors[key].ndim != 1:
            raise DamagedFileError(
                f"{folder / CHECKPOINT_TENSORS} lacks the random state {key} (a 1-d uint8 "
                f"tensor). {recovery}"
            )
    try:
        model.load_canonical_state_dict(
            {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")},
            source=str(folder),
        )
        per_parameter: dict[int, dict[str, torch.Tensor]] = {}
        for index, name in enumerate(names):
            prefix = f"optimizer.{name}."
            entries = {
                k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)
            }
            if entries:
                per_parameter[index] = entries
        _check_param_groups(plain["param_groups"], optimizer, folder / CHECKPOINT_STATE, recovery)
        groups = [{**g, "betas": tuple(g["betas"])} for g in plain["param_groups"]]
        optimizer.load_state_dict({"state": per_parameter, "param_groups": groups})
        sampler.set_state(tensors["rng.sampler"])
        torch.set_rng_state(tensors["rng.torch"])
    except DCPLensError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as cause:
        text = " ".join(str(cause).split())[:200] or type(cause).__name__
        raise DamagedFileError(
            f"{folder} cannot be restored into this run ({type(cause).__name__}: {text}). "
            f"{recovery}"
        ) from cause
    if torch.cuda.is_available():
        cuda_keys = [f"rng.cuda.{i}" for i in range(torch.cuda.device_count())]
        if all(key in tensors for key in cuda_keys):
            torch.cuda.set_rng_state_all([tensors[key] for key in cuda_keys])
    return RunState(step=plain["step"], max_hops=plain["max_hops"], history=plain["history"])


# The fields of trainer_state.json and their types.
PLAIN_FIELDS: dict[str, type | tuple[type, ...]] = {
    "step": int,
    "max_hops": (int, type(None)),
    "history": dict,
    "parameter_names": list,
    "param_groups": list,
}


def _check_plain_state(plain: dict[str, Any], path: Path, recovery: str) -> None:
    """Refuse a ``trainer_state.json`` whose fields are missing or of the wrong type."""
    for field, kind in PLAIN_FIELDS.items():
        value = plain.get(field)
        if field not in plain or not isinstance(value, kind) or isinstance(value, bool):
            raise DamagedFileError(
                f"{path}: field {field} is missing or not {_kind_name(kind)} (got {value!r:.60}). "
                f"{recovery}"
            )
    names, groups = plain["parameter_names"], plain["param_groups"]
    if not all(isinstance(name, str) for name in names):
        raise DamagedFileError(f"{path}: field parameter_names must list strings. {recovery}")
    if not groups or not all(
        isinstance(g, dict) and isinstance(g.get("betas"), list) for g in groups
    ):
        raise DamagedFileError(
            f"{path}: field param_groups must list the optimizer's groups (objects with betas). "
            f"{recovery}"
        )
    if plain["step"] < 0:
        raise DamagedFileError(f"{path}: field step={plain['step']} must be >= 0. {recovery}")
    _check_history(plain["history"], path, recovery)


def _check_history(history: dict[str, Any], path: Path, recovery: str) -> None:
    """Refuse a history whose records hold a string or a bool where a number belongs."""
    for part, fields in HISTORY_NUMBERS.items():
        records = history.get(part, [])
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            raise DamagedFileError(f"{path}: field history.{part} must list objects. {recovery}")
        for i, record in enumerate(records):
            for field, kind in fields.items():
                where = f"{path}: field history.{part}[{i}].{field}"
                _check_number(record.get(field), kind, where, recovery)


# The numbers of the history's records: "count" a whole number >= 0, "count or null" the same
# or null (no curriculum), "number" any number (NaN and infinities included).
HOPS = {"step": "count", "max_hops": "count or null"}
HISTORY_NUMBERS: dict[str, dict[str, str]] = {
    "steps": {
        **HOPS,
        "iterations": "count",
        "loss": "number",
        "lr": "number",
        "grad_norm": "number",
    },
    "evaluations": HOPS,
    "curriculum": HOPS,
}


def _check_number(value: object, kind: str, where: str, recovery: str) -> None:
    """Refuse ``value`` unless it is of ``kind`` (a string or a bool is no number)."""
    if value is None and kind.endswith("or null"):
        return
    if kind.startswith("count"):
        if isinstance(value, int) and type(value) is not bool and value >= 0:
            return
        expected = "a whole number >= 0" + (" or null" if kind.endswith("or null") else "")
    elif type(value) in (int, float):
        return
    else:
        expected = "a number"
    raise DamagedFileError(f"{where} must be {expected} (got {value!r:.60}). {recovery}")


def _check_param_groups(
    saved: list[dict[str, Any]], optimizer: torch.optim.Optimizer, path: Path, recovery: str
) -> None:
    """Refuse saved optimizer groups (``saved``, as ``trainer_state.json`` holds them) whose
    settings are not of the kind this run's ``optimizer`` holds: a number (lr, eps,
    weight_decay) where it holds one, numbers for betas, true or false for its switches."""
    live = optimizer.param_groups
    if len(saved) != len(live):
        raise DamagedFileError(
            f"{path}: field param_groups lists {len(saved)} groups, this run's optimizer "
            f"{len(live)}. {recovery}"
        )
    for i, (group, current) in enumerate(zip(saved, live, strict=True)):
        for name, value in current.items():
            if name not in group:  # a setting of a later torch: the optimizer gives its default
                continue
            where = f"{path}: field param_groups[{i}].{name}"
            if type(value) is bool:
                if type(group.get(name)) is not bool:
                    raise DamagedFileError(
                        f"{where} must be true or false (got {group.get(name)!r:.60}). {recovery}"
                    )
            elif type(value) in (int, float):
                _check_number(group.get(name), "number", where, recovery)
            elif name == "betas":
                betas = group.get(name)
                if not isinstance(betas, list) or len(betas) != len(value):
                    raise DamagedFileError(
                        f"{where} must list {len(value)} numbers (got {betas!r:.60}). {recovery}"
                    )
                for b, beta in enumerate(betas):
                    _check_number(beta, "number", f"{where}[{b}]", recovery)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


def write_json(path: Path, data: object) -> None:
    write_text_atomically(path, json.dumps(data, indent=1) + "\n")
