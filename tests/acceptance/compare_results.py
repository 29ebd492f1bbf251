"""Compare the numbers of two JSON files (``results.json``, ``validation.json``, ...): walk both
trees, pair every number by its path, and print the largest absolute difference.

    python tests/acceptance/compare_results.py BEFORE.json AFTER.json [--ignore KEY ...]

Key order does not matter. Keys named ``metadata`` and ``config`` (what a run records about its
settings and environment) are left out unless ``--ignore`` is given another list. A number on one
side only, a string that differs, or a list of another length is reported as a structural
difference. NaN equals NaN (JSON null stands for NaN in dcp-lens's files). Exit code 0 when the
numbers are identical and the structure matches, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

IGNORED = ("metadata", "config")


def leaves(value: Any, path: str, ignored: Sequence[str]) -> Iterator[tuple[str, Any]]:
    """Every leaf of a JSON tree with its path (dict keys sorted, ``ignored`` keys left out)."""
    if isinstance(value, dict):
        for key in sorted(value):
            if key not in ignored:
                yield from leaves(value[key], f"{path}/{key}", ignored)
    elif isinstance(value, list):
        yield f"{path}#len", len(value)
        for index, item in enumerate(value):
            yield from leaves(item, f"{path}[{index}]", ignored)
    else:
        yield path, value


def compare(
    before: Any,
    after: Any,
    ignored: Sequence[str] = IGNORED,
    allowed: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """``max_abs_diff`` over every number present in both trees (NaN and None equal each other),
    where it is, how many numbers were compared, and every structural difference.

    ``allowed`` maps a key name to the difference its numbers may show before they count: a
    permutation p-value moves in steps of 1 / (1 + permutations) when a float32 score that ties
    another in exact arithmetic rounds the other way on another CPU. A difference beyond the
    allowance counts in full."""
    allowed = allowed or {}
    left, right = dict(leaves(before, "", ignored)), dict(leaves(after, "", ignored))
    worst, where, numbers, structural = 0.0, None, 0, []
    for path in sorted(set(left) | set(right)):
        if path not in left or path not in right:
            structural.append(f"{path}: only in {'after' if path in right else 'before'}")
            continue
        a, b = _number(left[path]), _number(right[path])
        if a is None or b is None:
            if left[path] != right[path]:
                structural.append(f"{path}: {left[path]!r} != {right[path]!r}")
            continue
        numbers += 1
        if math.isnan(a) and math.isnan(b):
            continue
        difference = math.inf if math.isnan(a) or math.isnan(b) else abs(a - b)
        if difference <= allowed.get(path.rsplit("/", 1)[-1], -1.0):
            continue
        if difference > worst:
            worst, where = difference, path
    return {"max_abs_diff": worst, "at": where, "numbers": numbers, "structural": structural}


def _number(value: Any) -> float | None:
    """A JSON number (bools excluded) or null (NaN) as a float; None for anything else."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--ignore", nargs="*", default=list(IGNORED), help="keys left out")
    args = parser.parse_args(argv)
    with open(args.before) as file:
        before = json.load(file)
    with open(args.after) as file:
        after = json.load(file)
    result = compare(before, after, args.ignore)
    print(
        f"{args.after}: {result['numbers']} numbers compared, max abs diff "
        f"{result['max_abs_diff']:g}"
        + (f" at {result['at']}" if result["at"] else "")
        + f", {len(result['structural'])} structural differences (ignoring {args.ignore})"
    )
    for line in result["structural"][:20]:
        print(f"  {line}")
    return 0 if result["max_abs_diff"] == 0 and not result["structural"] else 1


if __name__ == "__main__":
    sys.exit(main())
