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
# # Four lenses on every iteration of a looped model
#
# A lens reads the state after iteration t, s_t, as if the model stopped there. On the Huginn
# fixture (a tiny random model in the Huginn-0125 layout, `demos/data/fixtures/huginn_tiny`) we
# read every iteration with:
#
# - the **logit lens**: the model's own readout of s_t (pre-coda norm, coda, final norm, unembed),
#   which is exactly `truncate(t)`;
# - the **calibrated lens**: s_t first moved by a label-free affine map fitted on a calibration
#   split (the protocol's `calibrate`);
# - the **tuned lens**: a learned affine translator per iteration, fitted to the full-depth output
#   by KL (an upper bound on a readout shift, since it learns from outputs);
# - the **Jacobian lens**: J_t, the average Jacobian from s_t to the stream entering the final norm,
#   after TransformerLens 4.3's `jacobian_lens.py`, which refuses looped models.
#
# Random weights know nothing: read the numbers as what the tools compute, not as findings. The
# last section reads a model that has learned something: the `lm` preset's character-level model.

# %%
import time
from pathlib import Path

import torch

import dcp_lens
from dcp_lens import HookedRecurrentTransformer
from dcp_lens.lenses.lens import fit_lens_calibrations, logit_lens
from dcp_lens.lenses.tuned import JacobianLens, TunedLens

torch.set_num_threads(1)
started = time.perf_counter()
REPO = Path.cwd() if (Path.cwd() / "demos").is_dir() else Path.cwd().parent
huginn = dcp_lens.load(f"huginn:{REPO / 'demos' / 'data' / 'fixtures' / 'huginn_tiny'}")
r = huginn.n_iterations
generator = torch.Generator().manual_seed(0)
calibration = torch.randint(0, huginn.cfg.d_vocab, (16, 12), generator=generator)
evaluation = torch.randint(0, huginn.cfg.d_vocab, (16, 12), generator=generator)
print(f"Huginn fixture: r = {r} iterations of {huginn.cfg.n_core} core layers")

# %% [markdown]
# ## Fit the three lenses that learn something, on the calibration split

# %%
calibrated = fit_lens_calibrations(huginn, calibration, mode="full")
tuned = TunedLens.fit(huginn, calibration, steps=30, lr=1e-2)
jacobian = JacobianLens.fit(huginn, calibration[:2])
print("tuned translators for t =", sorted(tuned.translators), "(t = r is the identity)")
print("Jacobians for t =", sorted(jacobian.jacobians))

# %% [markdown]
# ## KL from each lens to the full-depth output, per iteration, on held-out sequences
#
# At t = r the logit, tuned and calibrated lenses are the model itself (KL 0); the Jacobian lens
# at r is the linearisation of the coda, so it is not.

# %%
with torch.no_grad():
    full = huginn(evaluation).log_softmax(-1)
    readouts = {
        "logit": logit_lens(huginn, evaluation, range(1, r + 1)),
        "calibrated": logit_lens(huginn, evaluation, range(1, r + 1), calibration=calibrated),
        "tuned": tuned.logits(huginn, evaluation, range(1, r + 1)),
        "jacobian": jacobian.logits(huginn, evaluation, range(1, r + 1)),
    }


def kl_to_full(lens: torch.Tensor) -> list[float]:
    log_q = lens.log_softmax(-1)
    # KL >= 0; max() drops the -0.000 of float noise where a lens is the model itself.
    return [max(float((full.exp() * (full - q)).sum(-1).mean()), 0.0) for q in log_q]


print("t:          " + "".join(f"{t:>8}" for t in range(1, r + 1)))
for name, lens in readouts.items():
    print(f"{name:<11} " + "".join(f"{v:8.3f}" for v in kl_to_full(lens)))

# %% [markdown]
# ## The tuned lens saves and loads as one safetensors file

# %%
path = Path("huginn_tuned_lens.safetensors")
tuned.save(path)
again = TunedLens.load(path)
same = torch.equal(again.logits(huginn, evaluation), tuned.logits(huginn, evaluation))
path.unlink()
print("reloaded lens gives the same logits:", same)

# %% [markdown]
# ## Where the prediction at the last position forms
#
# The top token of each lens at the last position of the first held-out sequence, and the model's.

# %%
top = {name: lens[:, 0, -1].argmax(-1).tolist() for name, lens in readouts.items()}
print("model's top token:", int(full[0, -1].argmax()))
for name, tokens in top.items():
    print(f"{name:<11}", tokens)

# %% [markdown]
# ## The same lenses on a trained model: the `lm` preset
#
# `demos/data/lm_fixed` holds the `lm` preset's fixed-regime model (a 1 prelude + 1 core x 4 +
# 1 coda character-level model of tinyshakespeare, 2000 steps; how it was made:
# `demos/data/lm_fixed/PROVENANCE.md`). Its characters are numbered in code-point order, as the
# preset's `char_lm` task numbers them; we read windows from the end of the text, the preset's
# test region.

# %%
lm = HookedRecurrentTransformer.from_pretrained(REPO / "demos" / "data" / "lm_fixed").eval()
text = (REPO / "demos" / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")
ids = {char: i for i, char in enumerate(sorted(set(text)))}
windows = torch.tensor([ids[char] for char in text[-40 * 64 :]]).view(40, 64)
lm_calibration, lm_evaluation = windows[:24], windows[24:]
r_lm = lm.n_iterations
lm_lenses = {
    "calibrated": fit_lens_calibrations(lm, lm_calibration, mode="full"),
    "tuned": TunedLens.fit(lm, lm_calibration, steps=30, lr=1e-2),
    "jacobian": JacobianLens.fit(lm, lm_calibration[:2]),
}
with torch.no_grad():
    lm_logits = lm(lm_evaluation)
    full = lm_logits.log_softmax(-1)  # kl_to_full reads this
    hits = lm_logits[:, :-1].argmax(-1) == lm_evaluation[:, 1:]
    lm_readouts = {
        "logit": logit_lens(lm, lm_evaluation, range(1, r_lm + 1)),
        "calibrated": logit_lens(
            lm, lm_evaluation, range(1, r_lm + 1), calibration=lm_lenses["calibrated"]
        ),
        "tuned": lm_lenses["tuned"].logits(lm, lm_evaluation, range(1, r_lm + 1)),
        "jacobian": lm_lenses["jacobian"].logits(lm, lm_evaluation, range(1, r_lm + 1)),
    }
print(f"lm: r = {r_lm}, next-character accuracy at full depth {hits.float().mean():.3f}")
print("KL to full depth per iteration t")
print("t:          " + "".join(f"{t:>8}" for t in range(1, r_lm + 1)))
for name, lens in lm_readouts.items():
    print(f"{name:<11} " + "".join(f"{v:8.3f}" for v in kl_to_full(lens)))

# %% [markdown]
# The trained model's early iterations read far from its output through its own readout (the
# logit lens), and much closer once moved by a label-free map (calibrated) or a learned one
# (tuned): part of what the logit lens shows at small t is the readout's frame, which is what the
# Depth Control Protocol's S control measures. The Jacobian lens, like TransformerLens's, reads
# through the final norm and unembedding only, so on a model with a coda block it stays off even
# at t = r.

# %%
print(f"(ran in under a minute: {time.perf_counter() - started < 60})")
