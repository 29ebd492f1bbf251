"""Write a run's ``results.json`` as a golden file: each run's ``metadata`` (timings,
environment, paths) removed, keys sorted.

    python tests/acceptance/golden/strip.py RESULTS.json GOLDEN.json
"""

import json
import sys

with open(sys.argv[1]) as source:
    results = json.load(source)
for record in results["runs"]:
    record.pop("metadata", None)
with open(sys.argv[2], "w") as target:
    json.dump(results, target, indent=1, sort_keys=True)
    target.write("\n")
