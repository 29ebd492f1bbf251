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
# # Readout shift: the probe and the calibration
#
# Reading out an early state s_t through a readout trained on s_r mixes two things: the work not
# yet done and the *readout shift*, how far s_t sits from the states the readout saw in training.
# Two tools measure and repair the shift:
#
# - `ResidualOODProbe` scores states against full-depth readout inputs: relative Mahalanobis
#   distance (noise floor 1) and a classifier two-sample test (held-out AUROC, 0.5 =
#   indistinguishable);
# - the calibration (`dcp_lens.lenses.lens.fit_lens_calibrations`, the protocol's `calibrate`) moves
#   s_t's mean and covariance onto s_r's, label-free and affine; the *calibrated lens* reads the
#   moved state out.
#
# On the bundled `default` model and on stories260K retrofitted into a recurrent model
# (`dcp_lens.zoo.retrofit`, as `demos/retrofit_stories260k.py` does at full size).
# `DCP_DEMO_QUICK=1` uses fewer examples and a shorter distillation (the test suite does).

# %%
import os
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
import torch

import dcp_lens
from dcp_lens import ResidualOODProbe
from dcp_lens.lenses.lens import fit_lens_calibrations, iteration_states, logit_lens
from dcp_lens.tasks import get_task
from dcp_lens.zoo.retrofit import distill, retrofit, sample_corpus

nan = float("nan")
QUICK = os.environ.get("DCP_DEMO_QUICK") == "1"
torch.set_num_threads(1)
REPO = Path.cwd() if (Path.cwd() / "demos").is_dir() else Path.cwd().parent


def probe_table(model, calibration_tokens, evaluation_tokens, positions=None, steps=200):
    """Probe scores of s_t and of the calibrated s_t, every t, against held-out s_r."""
    maps = fit_lens_calibrations(model, calibration_tokens)
    with torch.no_grad():
        reference = iteration_states(model, calibration_tokens, [model.n_iterations])[0]
        states = iteration_states(model, evaluation_tokens)
    if positions is not None:  # the positions that are scored (the task's answers)
        reference = reference[positions[: len(reference)]]
        states = states[:, positions[: len(evaluation_tokens)]]
    flat = reference.reshape(-1, reference.shape[-1]).double()
    probe = ResidualOODProbe(max_points=1000, steps=steps).fit(flat)
    print(" t  Mahalanobis  AUROC | calibrated: Mahalanobis  AUROC")
    for t in range(model.n_iterations + 1):
        state = states[t].reshape(-1, states.shape[-1]).double()
        raw = probe.score(state)
        moved = probe.score(maps[t](state)) if t > 0 else {"mahalanobis": nan, "auroc": nan}
        print(
            f"{t:2d}  {raw['mahalanobis']:11.2f}  {raw['auroc']:5.2f} | "
            f"            {moved['mahalanobis']:11.2f}  {moved['auroc']:5.2f}"
        )
    return maps


# %% [markdown]
# ## The bundled `default` model
#
# States at the answer positions of held-out programs. s_0 is the embedding; the calibration of
# s_t (t >= 1) is fitted on the calibration split and applied to the evaluation split.

# %%
model = dcp_lens.load("default")
task = get_task(**model.task_config)
n = 128 if QUICK else 1024
evaluation, calibration = task.evaluation(n), task.calibration(n)
scored = torch.cat([calibration.scored, evaluation.scored])
maps = probe_table(model, calibration.tokens, evaluation.tokens, scored, 100 if QUICK else 400)

# %% [markdown]
# Read the table above as: the classifier tells early states from full-depth ones almost
# perfectly (AUROC near 1); after calibration it still does at t = 1 and 2, because their shift
# differs between inputs and an affine map fitted on all of them cannot undo it. The
# accuracy of the lens and of the calibrated lens at each iteration: calibration does not bring
# the answers back, since the early states lack the hops not yet resolved. On `default` the
# truncation gap is distinct computation (D), not readout shift (S).

# %%
with torch.no_grad():
    lens = logit_lens(model, evaluation.tokens, iterations=range(1, model.n_iterations + 1))
    calibrated = logit_lens(model, evaluation.tokens, calibration=maps)
for t in range(1, model.n_iterations + 1):
    plain = evaluation.correct(lens[t - 1]).float().mean().item()
    moved = evaluation.correct(calibrated[t]).float().mean().item()
    print(f"t={t}: lens accuracy {plain:.3f}, calibrated lens {moved:.3f}")

# %% [markdown]
# ## stories260K, retrofitted
#
# stories260K (5 dense blocks) becomes block 0 as prelude, blocks 1-3 as a core looped r = 4
# times, block 4 as coda, and is distilled against the dense original on text it samples
# itself. At one iteration the retrofit is the dense model exactly; the loop is what changes.

# %%
original = dcp_lens.load(f"llama2c:{REPO / 'demos' / 'data' / 'stories260K'}")
corpus = sample_corpus(original, 96 if QUICK else 640, 64, seed=0, held_out=32)
student = retrofit(original, 1, 3, 1, n_iterations=4)
report = distill(student, original, corpus, steps=10 if QUICK else 200, progress=False)
student.eval()
print(f"distilled {len(report.loss)} steps; last loss {report.loss[-1]:.3f}")
print(original.to_string(original.generate(original.to_tokens("Once upon a time"), 16)[0]))
print(student.to_string(student.generate(student.to_tokens("Once upon a time"), 16)[0]))

# %% [markdown]
# The probe over iterations (the held-out text, half to fit the calibration, half to read),
# then how far the lens and the calibrated lens are from the full-depth output (KL in nats per
# token). Here calibration does repair part of the gap: the retrofitted loop's early states are
# shifted in a way that an affine map largely undoes (AUROC falls toward 0.5), so part of what
# truncation loses is readout shift.

# %%
half = len(corpus.held_out) // 2
fit_tokens, read_tokens = corpus.held_out[:half], corpus.held_out[half:]
maps = probe_table(student, fit_tokens, read_tokens, steps=100 if QUICK else 400)

# %%
with torch.no_grad():
    full = student(read_tokens).log_softmax(-1)
    lens = logit_lens(student, read_tokens, iterations=range(1, 5)).log_softmax(-1)
    calibrated = logit_lens(student, read_tokens, calibration=maps).log_softmax(-1)
for t in range(1, 5):
    plain = (full.exp() * (full - lens[t - 1])).sum(-1).mean().item()
    moved = (full.exp() * (full - calibrated[t])).sum(-1).mean().item()
    print(f"t={t}: KL(full || lens) {plain:.4f}, KL(full || calibrated lens) {moved:.4f}")
