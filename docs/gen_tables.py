"""Write the docs' tables of measured figures from the JSON the commands wrote.

Every table of results in the docs sits between two markers::

    <!-- BEGIN GENERATED: NAME (python docs/gen_tables.py) -->
    ...
    <!-- END GENERATED: NAME -->

and this script rewrites what is between them from committed JSON (``docs/data/``, whose README
says how each file was produced, and the bundled models' own ``accuracy_table.json``). So a
figure in a page cannot drift from its source: change the source (rerun the command, copy its
JSON here), run ``python docs/gen_tables.py``, commit both. ``--check`` changes nothing and
exits 1 when a page differs from what it would write; ``tests/acceptance/test_docs.py`` runs the
same check. The validation, bench and training tables need only the standard library; the
intervention and coverage blocks import the package for what it already defines (the verdict's
renderer, the quantities `validate --coverage` counts) rather than restating it here.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
DATA = DOCS / "data"
BUNDLED = ROOT / "dcp_lens" / "zoo" / "bundled_models"

MARKER = re.compile(
    r"(<!-- BEGIN GENERATED: (?P<name>[\w-]+) \(python docs/gen_tables.py\) -->\n)"
    r"(?P<body>.*?)"
    r"(<!-- END GENERATED: (?P=name) -->)",
    re.DOTALL,
)


def _read(path: Path) -> Any:
    return json.loads(path.read_text())


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = [_row(head), _row(["---"] * len(head))]
    lines += [_row(cells) for cells in rows]
    return "\n".join(lines) + "\n"


def _num(value: float, digits: int) -> str:
    """``value`` to ``digits`` decimals, with no negative zero ("-0.00" reads as a finding)."""
    return f"{round(float(value), digits) + 0.0:.{digits}f}"


def _sbd(values: dict[str, float]) -> str:
    return " / ".join(_num(values[factor], 2) for factor in ("S", "B", "D"))


def _validation_stem(width: int | None) -> str:
    """The file stem of the validation JSON at ``width`` (None: the models as built)."""
    return "validation" if width is None else f"validation_w{width}"


def _validation_files(width: int | None = None) -> list[tuple[int, Any]]:
    """Every ``docs/data/validation_seed{N}.json`` (at ``width``:
    ``validation_w{width}_seed{N}.json``), by seed; each must record the width it ran at."""
    found = []
    stem = _validation_stem(width)
    for path in DATA.glob(f"{stem}_seed*.json"):
        data = _read(path)
        if data["settings"].get("width") != width:
            raise SystemExit(f"{path} ran at width {data['settings'].get('width')}, not {width}.")
        found.append((int(data["settings"]["seed"]), data))
    if not found:
        raise SystemExit(
            f"no {stem}_seed*.json under {DATA}: run `dcp-lens validate "
            f"{'' if width is None else f'--width {width} '}--out`."
        )
    return sorted(found, key=lambda pair: pair[0])


def _why(row: dict[str, Any]) -> str:
    """pass, or FAIL with the bracket rule's failed tests (docs/validation.md)."""
    if row["passed"]:
        return "pass"
    judgement = row["judgement"]
    why = [f"truth outside {','.join(judgement['outside'])}"] if judgement["outside"] else []
    if row["identifiable"]:
        why += [] if judgement["narrow"] else ["S bracket wide"]
        why += [] if judgement["point_ok"] else ["point off"]
    elif not judgement["flagged_every_k"]:
        why.append(f"unflagged at k={judgement['unflagged_ks']}")
    if judgement.get("confident_wrong"):
        why.append("names a factor the truth lacks")
    return f"FAIL ({'; '.join(why)})"


def _brackets(row: dict[str, Any]) -> str:
    """Each factor's bracket, lower end's interval start to upper end's interval end."""
    bracket = row["bracket"]
    return " / ".join(
        f"[{_num(bracket[f'{f}_lower_lo'], 2)}, {_num(bracket[f'{f}_upper_hi'], 2)}]"
        for f in ("S", "B", "D")
    )


def _alarms(summary: dict[str, Any]) -> str:
    """A metric's false alarms: identifiable k's flagged S not identified, of all, and the rate."""
    rate = _num(100 * summary["false_alarm_rate"], 1)
    return f"{summary['false_alarms']} of {summary['alarm_ks']} ({rate}%)"


def _verdict_cell(row: dict[str, Any]) -> str:
    """The verdict a row's results carry, short: S, B, mixed, inconclusive (``incl.``), or
    ``not affine`` (inconclusive, most of the gap not recovered by an affine map); starred
    where it is confidently wrong."""
    judgement = row["judgement"]
    named = str(judgement.get("verdict", "none"))
    short = {"inconclusive": "incl.", "inconclusive/not_affine": "not affine"}.get(named, named)
    return short + (" (WRONG)" if judgement.get("confident_wrong") else "")


def _rate(count: int, total: int) -> str:
    return f"{count} of {total} ({_num(100 * count / total, 1) if total else '-'}%)"


def _spread(values: list[float]) -> str:
    """Mean and range of per-seed rates, in percent."""
    if not values:
        return "-"
    mean = sum(values) / len(values)
    return f"{_num(100 * mean, 1)}% ({_num(100 * min(values), 1)}-{_num(100 * max(values), 1)}%)"


def _cost(seed: int, data: dict[str, Any]) -> str:
    """A validation run's time and peak memory, and its number of models where it ran only
    some (``settings.models_run``)."""
    settings = data["settings"]
    models = settings.get("models_run")
    return (
        f"seed {seed}: {_num(settings['seconds'] / 60, 1)} min, "
        f"{_num(settings['peak_rss_mib'] / 1024, 1)} GiB peak"
        + (f" ({len(models)} models)" if models else "")
    )


def validation_table(width: int | None = None) -> str:
    """The planted suite at every seed (at ``width``: embedded at that width): per row the
    truth, the first seed's brackets and each seed's verdict and result; per metric and seed
    the rows passed, the flag's false alarms and the verdicts right; per metric the spread of
    the rates over the seeds; the time and peak memory of each seed where recorded."""
    runs = _validation_files(width)
    first_seed, first = runs[0]
    by_seed = [{(r["model"], r["metric"]): r for r in data["rows"]} for _, data in runs]
    seeds = [seed for seed, _ in runs]
    listed = ", ".join(map(str, seeds))
    head = [
        "planted model",
        "metric",
        "identifiable",
        f"truth S / B / D (seed {first_seed})",
        f"seed {first_seed}: S / B / D bracket",
        f"verdict ({listed})",
        f"result ({listed})",
    ]
    rows = []
    for row in first["rows"]:
        key = (row["model"], row["metric"])
        found = [rows_of_seed.get(key) for rows_of_seed in by_seed]
        rows.append(
            [
                row["model"],
                row["metric"],
                "yes" if row["identifiable"] else "no",
                _sbd(row["expected"]),
                _brackets(row),
                "; ".join(_verdict_cell(r) if r is not None else "-" for r in found),
                "; ".join(_why(r) if r is not None else "-" for r in found),
            ]
        )
    seed_head = [
        "metric",
        "seed",
        "rows passed",
        "false alarms (identifiable k's)",
        "verdicts right (identifiable rows)",
        "confidently wrong",
        "passes",
    ]
    per_seed_rows = []
    spread_rows = []
    for metric, record in first["summary"].items():
        alarms, verdicts = [], []
        for seed, data in runs:
            s = data["summary"].get(metric)
            if s is None:
                continue
            alarms.append(s["false_alarm_rate"])
            if s.get("verdicts_judged"):
                verdicts.append(s["verdicts_right"] / s["verdicts_judged"])
            per_seed_rows.append(
                [
                    metric + ("" if record["counted"] else " (not validated)"),
                    str(seed),
                    f"{s['rows_passed']} of {s['rows']}",
                    _alarms(s),
                    _rate(s.get("verdicts_right", 0), s.get("verdicts_judged", 0)),
                    ", ".join(s.get("confidently_wrong", [])) or "none",
                    "yes" if s["passed"] else "no",
                ]
            )
        pooled = [data["summary"][metric] for _, data in runs if metric in data["summary"]]
        spread_rows.append(
            [
                metric + ("" if record["counted"] else " (not validated)"),
                _spread(alarms),
                _rate(sum(s["false_alarms"] for s in pooled), sum(s["alarm_ks"] for s in pooled)),
                _spread(verdicts),
            ]
        )
    spread_head = ["metric", f"false-alarm rate, mean (range) over seeds {listed}",
                   f"false alarms pooled over seeds {listed}",
                   f"verdicts right, mean (range) over seeds {listed}"]  # fmt: skip
    settings = first["settings"]
    stem = _validation_stem(width)
    costs = [_cost(seed, data) for seed, data in runs if "seconds" in data["settings"]]
    note = (
        f"\n*Generated from {', '.join(f'`docs/data/{stem}_seed{s}.json`' for s in seeds)} "
        f"({settings['n_eval']} + {settings['n_calibration']} sequences, "
        f"{settings['n_bootstrap']} bootstrap draws"
        + (f"; the whole suite per seed, one thread: {'; '.join(costs)}" if costs else "")
        + ").*\n"
    )
    return (
        _table(head, rows)
        + "\n"
        + _table(seed_head, per_seed_rows)
        + "\n"
        + _table(spread_head, spread_rows)
        + note
    )


def _accuracy_table(name: str) -> str:
    """A bundled model's held-out accuracy per hop count h and iterations k."""
    table = _read(BUNDLED / name / "accuracy_table.json")
    ks = [int(k) for k in table["k_values"]]
    cells: dict[int, dict[int, float]] = {}
    queries: dict[int, int] = {}
    for row in table["rows"]:
        cells.setdefault(int(row["hops"]), {})[int(row["k"])] = float(row["accuracy"])
        queries[int(row["hops"])] = int(row["queries"])
    rows = [[f"{h} ({queries[h]})", *[_num(cells[h][k], 3) for k in ks]] for h in sorted(cells)]
    overall = {int(entry["k"]): float(entry["accuracy"]) for entry in table["overall"]}
    rows.append(["all", *[_num(overall[k], 3) for k in ks]])
    note = (
        f"\n*Generated from `dcp_lens/zoo/bundled_models/{name}/accuracy_table.json` "
        f"({table['n_programs']} {table['split']} programs; r = {table['full_depth']}).*\n"
    )
    return _table(["h (queries)", *[f"k={k}" for k in ks]], rows) + note


def _bench_runs() -> list[Any]:
    paths = list(DATA.glob("bench_*.json"))
    if not paths:
        raise SystemExit(f"no bench_*.json under {DATA}: run `dcp-lens bench --json`.")
    runs = [(path.name, _read(path)) for path in paths]
    # Threads, then batches (1, 4, 8, 32 rather than the names' 1, 32, 4, 8), then the name.
    return sorted(
        runs, key=lambda run: (run[1].get("threads") or 0, run[1].get("batches") or 1, run[0])
    )


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return _num(value, digits)
    return str(value)


BENCH_COLUMNS: list[tuple[str, str, int]] = [
    ("threads", "threads", 0),
    ("batches", "batches", 0),
    ("forward_seconds", "forward, s", 2),
    ("sweep_seconds", "sweep, s", 2),
    ("sweep_over_forward", "sweep / forward (paired)", 2),
    ("sweep_over_forward_fastest", "fastest / fastest", 2),
    ("irreducible_seconds", "irreducible, s", 2),
    ("sweep_over_irreducible", "sweep / irreducible (paired)", 2),
    ("sweep_floor_over_irreducible", "floor / irreducible (maps, metrics)", 2),
    ("naive_over_sweep", "naive / sweep", 1),
    ("hooks_off_over_plain", "hooks-off / plain", 2),
    ("forward_tokens_per_second", "tokens/s forward", 0),
    ("sweep_tokens_per_second", "tokens/s sweep", 0),
    ("peak_memory_mb", "peak RSS, MB", 0),
    ("sweep_memory_per_batch_token_mb", "sweep MB per batch token", 3),
]


def bench_table() -> str:
    """One row per committed ``dcp-lens bench --json`` output."""
    runs = _bench_runs()
    columns = [c for c in BENCH_COLUMNS if any(c[0] in data for _, data in runs)]
    rows = [
        [f"`{name}`", *(_fmt(data.get(key), digits) for key, _, digits in columns)]
        for name, data in runs
    ]
    head = ["file (docs/data)", *(label for _, label, _ in columns)]
    return _table(head, rows) + "\n*Generated from the `bench_*.json` files of `docs/data`.*\n"


def _k_list(ks: list[int]) -> str:
    return ", ".join(map(str, ks))


def _flags_below_r(run: Any, metric: str) -> str:
    """Where S or B is not identified, over the k below r of one metric's decomposition."""
    rows = [
        row
        for row in run["decomposition"]
        if row["metric"] == metric and int(row["k"]) < int(run["n_iterations"])
    ]
    not_s = [int(row["k"]) for row in rows if not row.get("S_identified", True)]
    not_b = [int(row["k"]) for row in rows if not row.get("B_identified", True)]
    parts = []
    if not_s:
        parts.append(f"S not identified at k = {_k_list(not_s)}")
    if not_b:
        parts.append(f"B not identified at k = {_k_list(not_b)}")
    return "; ".join(parts) or "none"


def run_default_table() -> str:
    """`dcp-lens run` on the bundled pair: each metric's shares with their intervals, flags."""
    runs = _read(DATA / "run_default.json")["runs"]
    rows = []
    for run in runs:
        for metric, shares in run["shares"].items():
            intervals = run["share_intervals"][metric]
            validated = "yes" if run["metrics"][metric].get("validated") else "no"
            cells = [
                f"{_num(shares[f], 3)} [{_num(intervals[f + '_lo'], 3)}, "
                f"{_num(intervals[f + '_hi'], 3)}]"
                for f in ("S", "B", "D")
            ]
            flags = _flags_below_r(run, metric)
            ends = run.get("bracket", {}).get(metric, {})
            brackets = [
                f"[{_num(ends.get(f + '_lower', math.nan), 3)}, "
                f"{_num(ends.get(f + '_upper', math.nan), 3)}]"
                for f in ("S", "D")
            ]
            verdict = shares.get("verdict", "-")
            rows.append(
                [f"`{run['model']}`", f"{metric} ({validated})", *cells, *brackets, verdict, flags]
            )
    meta = runs[0]["metadata"]
    note = (
        f"\n*Generated from `docs/data/run_default.json` (the `results.json` of "
        f"`dcp-lens run --out DIR`: {meta['n_evaluation']} + {meta['n_calibration']} sequences, "
        f"seed {meta['seed']}, calibration `{meta['calibration_mode']}`).*\n"
    )
    head = ["model", "metric (validated)", "S [95%]", "B [95%]", "D [95%]", "S bracket",
            "D bracket", "verdict", "flags below r"]  # fmt: skip
    return _table(head, rows) + note


COVERAGE_QUANTITIES = ("S", "B", "D", "S_bracket", "B_bracket", "D_bracket")


def coverage_table(width: int | None = None) -> str:
    """`dcp-lens validate --coverage N`'s table, from ``validation_coverage.json`` (at ``width``:
    ``validation_coverage_w{width}.json``, which must record that width): per mixture and
    quantity, for every metric, how often the 95% interval covered the replicate's truth and
    (for point quantities) the spread ratio; starred quantities are the ones the command counts
    (`coverage_counted`), on validated metrics only."""
    from dcp_lens.studies.validate import coverage_counted

    stem = "validation_coverage" + ("" if width is None else f"_w{width}")
    document = _read(DATA / f"{stem}.json")
    if document["settings"].get("width") != width:
        raise SystemExit(
            f"{stem}.json ran at width {document['settings'].get('width')}, not {width}."
        )
    table = document["coverage"]
    at_width = "" if width is None else f" --width {width}"
    first_seed = "" if table["seeds"][0] == 0 else f" --seed {table['seeds'][0]}"
    metrics = list(next(iter(table["models"].values())))
    validated = set(table["validated_metrics"])
    head = ["mixture", "quantity"] + [
        f"{m}{'' if m in validated else ' (not validated)'}" for m in metrics
    ]
    rows = []
    for name, per_metric in table["models"].items():
        for quantity in COVERAGE_QUANTITIES:
            counted = quantity in coverage_counted(name)
            cells = []
            for metric in metrics:
                entry = per_metric[metric][quantity]
                cell = f"{entry['covers_truth']:.2f}"
                if "spread_ratio" in entry:
                    cell += f" / {_num(entry['spread_ratio'], 1)}"
                cells.append(cell)
            label = quantity.replace("_bracket", " bracket") + ("*" if counted else "")
            rows.append([f"`{name}`", label, *cells])
    settings = document["settings"]
    note = (
        f"\n*Generated from `docs/data/{stem}.json` (`dcp-lens validate --coverage "
        f"{table['replicates']}{first_seed} --probe none{at_width}`: "
        f"seeds {table['seeds'][0]}-{table['seeds'][-1]}, "
        f"{settings['n_eval']} + {settings['n_calibration']} sequences, "
        f"{settings['n_bootstrap']} draws, {settings['config']['calibration_groups']} calibration "
        "groups). Each cell: the fraction of replicates whose 95% interval holds that "
        "replicate's truth, then, for a point share, the spread ratio (the errors' standard "
        "deviation over replicates against the mean standard error the intervals imply). "
        f"Starred: counted (target {table['target']:.0%} on validated metrics); coverage "
        f"{'passed' if table['passed'] else 'FAILED'}.*\n"
    )
    return _table(head, rows) + note


def memory_table() -> str:
    """The estimated peak memory of a default run at Huginn-0125's shape, by term and stage, from
    ``dcp-lens bench --preset huginn --estimate --json``."""
    data = _read(DATA / "memory_estimate_huginn.json")
    rows = [[f"`{name}`", _num(value, 2)] for name, value in data["terms_gib"].items()]
    rows += [[f"**{stage} stage**", _num(value, 2)] for stage, value in data["stages_gib"].items()]
    note = (
        f"\n*Generated from `docs/data/memory_estimate_huginn.json` (`dcp-lens bench --preset "
        f"huginn --estimate --batch-size {data['batch']} --dtype {data['dtype']} --json`: "
        f"{data['parameters']:,} parameters, batches of {data['batch']} x {data['seq']} tokens, "
        f"k grid {_k_list(data['k_grid'])}, {data['calibration_groups']} calibration groups, "
        f"{data['readout_rows']} readout rows a call). Peak: {data['peak_gib']:.2f} GiB, the "
        f"{data['peak_stage']} stage; host memory beside it: {data['host_total_gib']:.2f} GiB "
        "(the calibration groups parked off the device); one calibration snapshot for --resume: "
        f"{data['calibration_snapshot_gib']:.2f} GiB on disk.*\n"
    )
    return _table(["term", "GiB"], rows) + note


def memory_proxy_table() -> str:
    """Each stage's tensors alive at its peak against its estimate, on the two CPU proxies of
    Huginn-0125's shape with the probe on, at one and four evaluation batches, from
    ``docs/data/memory_proxy_probe.json``."""
    data = _read(DATA / "memory_proxy_probe.json")
    rows = []
    for proxy, sizes in data["runs"].items():
        shape = data["proxies"][proxy]
        name = f"{proxy} (d {shape['d_model']}, vocabulary {shape['d_vocab']})"
        for n, run in sizes.items():
            for stage in data["stages"]:
                measured = run["measured"][stage]
                estimated = run["estimates"][stage] - run["weights"]
                mb = (_num(measured / 2**20, 1), _num(estimated / 2**20, 1))
                rows.append([name, n, stage, *mb, _num(estimated / measured, 2)])
    settings = data["settings"]
    note = (
        f"\n*Generated from `docs/data/memory_proxy_probe.json` ({data['command']}): r = "
        f"{settings['n_iterations']}, sequences of {settings['seq']} tokens, batches of "
        f"{settings['batch_size']}, the {settings['probe']} probe with {settings['probe_points']} "
        "points a subsample, the last evaluation batch made of the jackknife's examples. "
        f"Measured: {data['measure']}; estimated: the stage's estimate less the weights.*\n"
    )
    return (
        _table(
            ["proxy", "evaluation sequences", "stage", "measured, MiB", "estimated, MiB", "ratio"],
            rows,
        )
        + note
    )


def work_table() -> str:
    """Forwards and readouts per token by stage of a default run at Huginn-0125's layout, counted
    by ``dcp-lens bench --preset huginn --count --json``."""
    data = _read(DATA / "work_huginn.json")
    targets = {"calibration pass": "<= 1.2", "evaluation": "<= 2.0"}
    rows = [
        [stage, _num(forwards, 3), _num(data["readouts_per_token"][stage], 2),
         targets.get(stage, "")]
        for stage, forwards in data["forwards_per_token"].items()
    ]  # fmt: skip
    on, at = data["counted_on"], data["weighed_at"]
    note = (
        f"\n*Generated from `docs/data/work_huginn.json` (`dcp-lens bench --preset huginn --count "
        f"--d-model {on['d_model']} --vocab {on['d_vocab']} --seq {on['seq']} --batch-size "
        f"{data['batch']} --probe {data['probe']} --json`: r = {data['n_iterations']}, k grid "
        f"{_k_list(data['k_grid'])}, {data['batches']} calibration and evaluation batches of "
        f"{data['batch']} sequences, {data['calibration_groups']} calibration groups, the "
        f"jackknife on {data['jackknife_examples']} evaluation examples, shift and the "
        f"translators on {data['control_examples']}; weighed at d_model "
        f"{at['d_model']}, vocabulary {at['d_vocab']}). Per token of the stage's split: "
        "calibration for the first three, evaluation for the last two; the evaluation's "
        "readouts are the sweep's and the jackknife's (its forward's own logits are not a "
        "readout).*\n"
    )
    return _table(["stage", "forwards per token", "readouts per token", "target"], rows) + note


def floor_table() -> str:
    """docs/floor_evidence.py's measurements: per seed and width, full depth's nearest tie on
    the block-count positions, and per eigenvalue floor the map's largest logit leak there and
    the (position, k) pairs whose top-1 it changed."""
    document = _read(DATA / "calibration_floor.json")
    floors = document["floors"]
    head = ["seed", "width", "nearest tie", "floor now"] + [
        f"floor {floor}: leak / top-1 changed" for floor in floors
    ]
    rows = []
    for row in document["rows"]:
        cells = [
            f"{row['floors'][floor]['largest_leak']:.4f} / {row['floors'][floor]['top1_changed']}"
            for floor in floors
        ]
        width = f"{row['width']}" + (" (built)" if row["width"] == row["built_width"] else "")
        rows.append(
            [str(row["seed"]), width, f"{row['min_margin']:.3f}", f"{row['floor_now']:.1e}"] + cells
        )
    note = (
        f"\n*Generated from `docs/data/calibration_floor.json` (`python docs/floor_evidence.py`: "
        f"`{document['model']}`, {document['n_eval']} + {document['n_calibration']} sequences, "
        "calibrate(replay(k)) fitted on every position for each k < r). Nearest tie: full "
        "depth's smallest top-two logit margin on the block-count positions. Floor now: "
        "`rounding_floor` of full depth's shrunk covariance. Leak: the largest "
        "change of a logit there relative to the position's mean change, over k; top-1 "
        "changed: (position, k) pairs where the map changes full depth's top-1.*\n"
    )
    return _table(head, rows) + note


GENERATORS: dict[str, Callable[[], str]] = {
    "memory-huginn": memory_table,
    "memory-proxy": memory_proxy_table,
    "work-huginn": work_table,
    "run-default": run_default_table,
    "intervention-default": lambda: _intervention("default"),
    "intervention-lm": lambda: _intervention("lm"),
    "validation": validation_table,
    "accuracy-default": lambda: _accuracy_table("default"),
    "bench": bench_table,
    "coverage": coverage_table,
    "calibration-floor": floor_table,
}


def _intervention(name: str) -> str:
    """The training intervention's table and verdict on its first metric (accuracy), as
    `dcp_lens.studies.intervention_markdown` writes them into ``intervention.md``, from a committed
    ``intervention.json``."""
    from dcp_lens.studies.intervention_markdown import markdown_table, verdict_lines

    document = _read(DATA / f"intervention_{name}.json")
    lines = [*markdown_table(document["regimes"]), "", *verdict_lines(document["verdict"])]
    settings = document["settings"]
    lines.append(
        f"\n*Generated from `docs/data/intervention_{name}.json` (`OUT/intervention.json` of "
        f"`dcp-lens experiment training-intervention --preset {document['preset']}`; metric "
        f"`{document['metric']}`, {settings.get('n_eval', '?')} + "
        f"{settings.get('n_calibration', '?')} sequences).*\n"
    )
    return "\n".join(lines)


def render(text: str) -> str:
    """``text`` with every generated block rewritten; an unknown block name is an error."""

    def replace(match: re.Match[str]) -> str:
        name = match["name"]
        at_width = re.fullmatch(r"(validation|coverage)-w(\d+)", name)
        if at_width:  # embedded at a width: one block per committed width
            table = validation_table if at_width[1] == "validation" else coverage_table
            return match.group(1) + table(int(at_width[2])) + match.group(4)
        if name not in GENERATORS:
            raise SystemExit(f"unknown generated block {name!r}; known: {sorted(GENERATORS)}")
        return match.group(1) + GENERATORS[name]() + match.group(4)

    return MARKER.sub(replace, text)


def pages() -> list[Path]:
    """Every page that holds a generated block."""
    candidates = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    return [path for path in candidates if MARKER.search(path.read_text())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 on a diff")
    args = parser.parse_args(argv)
    stale = []
    for path in pages():
        text = path.read_text()
        new = render(text)
        if new != text:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print("stale generated tables in: " + ", ".join(map(str, stale)), file=sys.stderr)
        print("run `python docs/gen_tables.py` and commit the pages", file=sys.stderr)
        return 1
    for path in stale:
        print(f"rewrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
