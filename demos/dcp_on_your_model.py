# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The Depth Control Protocol on your own model
#
# Truncating a recurrent model's loop to k < r iterations changes three things at once: block
# applications (B), distinct computation (D) and the readout shift (S, how far the stream entering
# the readout is from what it saw in training). DCP measures each, per k:
# `gap = S + B + D` exactly, with paired bootstrap intervals.
#
# 1. **Sanity check first** on a planted model whose answer is known, so a wrong setup shows.
# 2. Then **your model**: anything `dcp_lens.load` reads, or a `HookedRecurrentTransformer` you
#    built, with an evaluation and a calibration split (disjoint) as `EvaluationSet`s.
# 3. **Reading the results.**
#
# `DCP_DEMO_QUICK=1` uses fewer examples and bootstrap draws (the test suite does).

# %%
import os

os.environ.setdefault("TQDM_DISABLE", "1")
import torch

import dcp_lens
from dcp_lens import DepthControlProtocol, EvaluationSet
from dcp_lens.tasks import get_task

QUICK = os.environ.get("DCP_DEMO_QUICK") == "1"
N = 128 if QUICK else 512
BOOTSTRAP = 100 if QUICK else 1000
PROBE = "none" if QUICK else "trajectory"  # the probe trains a classifier per state: slower
torch.set_num_threads(1)

# %% [markdown]
# ## 1. The planted sanity check
#
# `planted:readout_shift` computes nothing new after its first iteration; a clock in its state
# turns each iteration and the readout is tuned to where the clock stands at r. So its whole
# truncation gap is readout shift: the S share must be near 1, B and D near 0. (`planted:
# distinct_computation` and `planted:block_count` plant D and B.)

# %%
planted = dcp_lens.load("planted:readout_shift")
task = planted.planted_task
results = DepthControlProtocol(planted, n_bootstrap=BOOTSTRAP, probe="none", progress=False).run(
    task.evaluation(N), task.calibration(N)
)
shares = results.shares()
COLUMNS = ["metric", "S", "B", "D", "S_lower", "S_upper", "S_identified", "verdict"]
print(shares[COLUMNS].round(3).to_string(index=False))

# %%
s_share = float(shares.set_index("metric").loc["accuracy", "S"])
assert s_share > 0.8, shares  # the planted factor is found
print("S share of the gap (accuracy):", round(s_share, 3))

# %% [markdown]
# ## 2. Your model
#
# Here: the bundled `default` model (variable binding, r = 4). Any model works the same way:
# `dcp_lens.load("path/to/save_pretrained_folder")`, `load("huginn:PATH")`, or a
# `HookedRecurrentTransformer` in memory. The protocol needs two disjoint splits: `evaluation`
# (what is scored) and `calibration` (where the label-free calibration maps are fitted).
# A task's batches convert with `EvaluationSet.from_task_batch`; plain token sequences (language
# modelling) with `EvaluationSet.from_tokens(tokens)`.

# %%
model = dcp_lens.load("default")
task = get_task(**model.task_config)
evaluation = EvaluationSet.from_task_batch(task.evaluation(N))
calibration = EvaluationSet.from_task_batch(task.calibration(N))
protocol = DepthControlProtocol(
    model, n_bootstrap=BOOTSTRAP, probe=PROBE, spec="default", progress=False
)
results = protocol.run(evaluation, calibration)

# %% [markdown]
# ## 3. Reading the results
#
# - `results.table()`: per metric and k, the gap `Q(full) - Q(truncate(k))` and its parts S, B,
#   D, the interaction I_BS and `shift_gap` (the positive control: full depth pushed into
#   truncate(k)'s frame should lose about S), each with a 95% paired bootstrap interval.
# - `results.shares()`: each factor's share of the gap's area over k. On accuracy the shares
#   lie in [0, 1] up to noise; on cross-entropy they can be negative or above 1, since
#   calibration also changes confidence.
# - The null control (every condition at k = r must equal full depth) and the probe (how far
#   each s_t is from the full-depth readout inputs: relative Mahalanobis, noise floor 1; C2ST
#   AUROC, 0.5 = indistinguishable).
# - S is a bracket: `S_lower` from the label-free calibration (minus what a base-rate control
#   explains), `S_upper` from a paired affine translator fitted on the calibration split.
#   `S_identified` is true where the two agree within 0.1 of the gap; where they do not, the
#   verdict is "inconclusive" with its reason (docs/bracket.md). `results.summary()` prints the
#   verdict per metric, as `dcp-lens run` does.

# %%
table = results.table()
ROW = ["k", "gap", "S", "B", "D", "I_BS", "S_lower", "S_upper", "S_identified", "B_identified"]
print(table[table["metric"] == "accuracy"][ROW].round(3).to_string(index=False))

# %%
print(results.summary())
print("null control, max |logit difference| at k = r:", results.null_control["max_abs_logit_diff"])
for row in results.probe["trajectory"]:  # empty when the probe is off (quick runs)
    t, distance, auroc = row["iteration"], row["mahalanobis"], row["auroc"]
    print(f"probe s_{t}: Mahalanobis {distance:.2f}, AUROC {auroc:.2f}")

# %% [markdown]
# On `default` the gap is all D: one iteration resolves one hop, so a truncated model has not
# done the work; calibrating its readout input does not bring the answers back. The conditions'
# hooks are also usable on their own: `hooks.truncate(2).fwd_hooks(model)`,
# `protocol.condition("calibrate_truncate", 2).fwd_hooks(model)` (after `run`).
