"""`dcp-lens validate --merge`: one ``validation.json`` from the records of several processes.

At real width a planted model takes minutes to tens of minutes, so the suite is run one model
per process (``--models M``) and a coverage table one mixture or a few seeds per process
(``--coverage N --seed S``), on as many cores or machines as there are. `merge` puts the parts
back together as if one process had run them: the suite's rows concatenated and its summary
recomputed, the coverage draws gathered by model, metric and seed and the coverage recomputed
from them. Parts must agree on every setting that changes a number (everything but the seed of
a coverage part, the memory budget, the time and the peak memory); a model run twice at one
seed is refused rather than counted twice.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dcp_lens.protocol.results import decode_json
from dcp_lens.studies.validate import coverage_table, rows_from_json, save
from dcp_lens.studies.validation_rules import ValidationRow, suite_passed
from dcp_lens.utils.errors import ConfigError

# Settings that may differ between parts without changing a validated number: the memory budget
# only sets chunk sizes, and the time and peak memory are each part's own.
_FREE_SETTINGS = frozenset({"seconds", "peak_rss_mib", "models_run", "replicates_from"})
_FREE_CONFIG = frozenset({"memory_budget"})


def read_part(path: str | Path) -> dict[str, Any]:
    """The ``validation.json`` document at ``path`` (the file, or the folder `save` wrote)."""
    path = Path(path)
    file = path / "validation.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(
            f"{path} holds no validation.json; pass folders that `dcp-lens validate --out` "
            "wrote, or their validation.json files."
        )
    try:
        document = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{file} is not JSON ({error}); rerun the part that wrote it.") from None
    if not isinstance(document, dict) or "settings" not in document or "rows" not in document:
        raise ConfigError(f"{file} is not a validation.json (no settings or rows).")
    return document


def merge(
    documents: Sequence[Mapping[str, Any]], names: Sequence[str] | None = None
) -> tuple[list[ValidationRow], dict[str, Any], dict[str, Any] | None]:
    """The rows, settings and coverage table of ``documents`` (parsed ``validation.json``
    records, all of the suite or all of coverage; ``names`` label them in errors), merged as
    `save` takes them.

    The suite: rows in the parts' order, every part at one seed, no (model, metric) twice; the
    settings' ``models_run`` lists the models. Coverage: each part's draws paired with its
    seeds, gathered per model and metric in seed order, no (model, seed) twice; the settings'
    ``seed`` is the smallest, ``replicates_from`` says which part gave which seeds; a metric
    counts as validated where every part says so. Either way ``seconds`` is the parts' sum (the
    CPU-bound time of processes that may have run side by side) and ``peak_rss_mib`` the
    largest.

    Raises:
        ConfigError: fewer than two parts, suite parts mixed with coverage parts, settings that
            differ, or a model (and seed) in two parts.
    """
    labels = list(names) if names is not None else [f"part {i}" for i in range(len(documents))]
    if len(documents) < 2:
        raise ConfigError(f"--merge needs at least two parts, got {len(documents)}.")
    kinds = {"coverage" in document for document in documents}
    if len(kinds) > 1:
        raise ConfigError(
            "--merge got suite parts and coverage parts together; merge each kind on its own."
        )
    covering = kinds == {True}
    first = documents[0]["settings"]
    for label, document in zip(labels[1:], documents[1:], strict=True):
        _check_same(first, document["settings"], labels[0], label, ignore_seed=covering)
    settings = {key: value for key, value in first.items() if key not in _FREE_SETTINGS}
    settings["config"] = dict(first["config"])
    settings["seconds"] = round(sum(float(d["settings"].get("seconds", 0)) for d in documents), 1)
    settings["peak_rss_mib"] = max(int(d["settings"].get("peak_rss_mib", 0)) for d in documents)
    if covering:
        table, sources = _merge_coverage(documents, labels)
        settings["seed"] = settings["config"]["seed"] = table["seeds"][0]
        settings["replicates_from"] = sources
        return [], settings, table
    rows: list[ValidationRow] = []
    seen: dict[tuple[str, str], str] = {}
    for label, document in zip(labels, documents, strict=True):
        for row in rows_from_json(document):
            key = (row.model, row.metric)
            if key in seen:
                raise ConfigError(
                    f"{row.model} on {row.metric} is in {seen[key]} and in {label}; "
                    "merge each model once."
                )
            seen[key] = label
            rows.append(row)
    settings["models_run"] = list(dict.fromkeys(row.model for row in rows))
    return rows, settings, None


def run_merge(parts: Sequence[str | Path], out: Path) -> bool:
    """``dcp-lens validate --merge``: merge the ``validation.json`` of ``parts`` (`merge`),
    print the summary line and write ``out/validation.json`` and ``validation.md``. Returns
    whether the merged record passes."""
    for part in parts:
        folder = Path(part) if Path(part).is_dir() else Path(part).parent
        if folder.resolve() == Path(out).resolve():
            raise ConfigError(
                f"--out {out} is one of the parts; write the merged record to a new folder."
            )
    documents = [read_part(part) for part in parts]
    rows, settings, table = merge(documents, [str(part) for part in parts])
    save(rows, out, settings, table)
    passed = bool(table["passed"]) if table is not None else suite_passed(rows)
    kind = "coverage" if table is not None else f"suite of {len(settings['models_run'])} models"
    print(f"merged {len(documents)} parts ({kind}): {'pass' if passed else 'FAIL'}")
    print(f"wrote {out / 'validation.json'} and {out / 'validation.md'}")
    return passed


def _check_same(
    first: Mapping[str, Any],
    other: Mapping[str, Any],
    first_label: str,
    label: str,
    *,
    ignore_seed: bool,
) -> None:
    """Refuse parts whose settings differ where a number could depend on them."""
    skip = set(_FREE_SETTINGS) | ({"seed"} if ignore_seed else set())
    for key in sorted((set(first) | set(other)) - skip - {"config"}):
        if first.get(key) != other.get(key):
            raise ConfigError(
                f"{label} has {key} = {other.get(key)!r} where {first_label} has "
                f"{first.get(key)!r}; merge only parts run with the same settings."
            )
    a, b = first.get("config", {}), other.get("config", {})
    skip_config = set(_FREE_CONFIG) | ({"seed"} if ignore_seed else set())
    for key in sorted((set(a) | set(b)) - skip_config):
        if a.get(key) != b.get(key):
            raise ConfigError(
                f"{label} has config.{key} = {b.get(key)!r} where {first_label} has "
                f"{a.get(key)!r}; merge only parts run with the same settings."
            )


def _merge_coverage(
    documents: Sequence[Mapping[str, Any]], labels: Sequence[str]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The coverage table of the parts' draws, and which part gave which model's seeds."""
    draws: dict[str, dict[str, dict[int, dict[str, float]]]] = {}
    owner: dict[tuple[str, int], str] = {}
    validated: dict[str, bool] = {}
    sources = []
    for label, document in zip(labels, documents, strict=True):
        table = document["coverage"]
        seeds = [int(seed) for seed in table["seeds"]]
        for metric in _metrics(table):
            validated[metric] = validated.get(metric, True) and metric in table.get(
                "validated_metrics", []
            )
        for model, per_metric in decode_json(table["draws"]).items():
            for seed in seeds:
                if (model, seed) in owner:
                    raise ConfigError(
                        f"{model} at seed {seed} is in {owner[model, seed]} and in {label}; "
                        "merge each replicate once."
                    )
                owner[model, seed] = label
            for metric, replicates in per_metric.items():
                if len(replicates) != len(seeds):
                    raise ConfigError(
                        f"{label}: {model} on {metric} has {len(replicates)} draws for "
                        f"{len(seeds)} seeds; the part is damaged, rerun it."
                    )
                mine = draws.setdefault(model, {}).setdefault(metric, {})
                mine.update(zip(seeds, replicates, strict=True))
            sources.append({"part": Path(label).name, "model": model, "seeds": seeds})
    for model, per_metric in draws.items():
        counts = {metric: sorted(by_seed) for metric, by_seed in per_metric.items()}
        if len({tuple(seeds) for seeds in counts.values()}) > 1:
            raise ConfigError(f"{model}: the parts give its metrics different seeds ({counts}).")
    ordered = {
        model: {metric: [by_seed[s] for s in sorted(by_seed)] for metric, by_seed in m.items()}
        for model, m in draws.items()
    }
    seeds = sorted({seed for (_, seed) in owner})
    return coverage_table(ordered, validated, seeds), sources


def _metrics(table: Mapping[str, Any]) -> list[str]:
    """Every metric a coverage part has draws of."""
    return list(
        dict.fromkeys(metric for per_metric in table["draws"].values() for metric in per_metric)
    )
