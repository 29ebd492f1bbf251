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
# # Huginn and Ouro, on their tiny fixtures
#
# `load("huginn:PATH")` and `load("ouro:PATH")` read checkpoints in the Huginn-0125 and Ouro
# layouts into a `HookedRecurrentTransformer` (Ouro: `OuroRecurrentTransformer`, with its early-exit
# gate). The fixtures under `demos/data/fixtures/` are tiny random models in those layouts, checked
# against the reference implementations' outputs (`tests/integration/zoo/test_loaders.py`); a
# real checkpoint folder loads the same way. Random weights know nothing, so read the numbers
# below as what the tools compute, not as findings.

# %%
from pathlib import Path

import torch

import dcp_lens
from dcp_lens.lenses.lens import logit_lens, prediction_trajectory

torch.set_num_threads(1)
# The repository root, whether run as `python demos/x.py` or as a notebook inside demos/.
REPO = Path.cwd() if (Path.cwd() / "demos").is_dir() else Path.cwd().parent
FIXTURES = REPO / "demos" / "data" / "fixtures"
huginn = dcp_lens.load(f"huginn:{FIXTURES / 'huginn_tiny'}")
ouro = dcp_lens.load(f"ouro:{FIXTURES / 'ouro_tiny'}")
for name, model in (("huginn", huginn), ("ouro", ouro)):
    c = model.cfg
    print(
        f"{name}: {c.n_prelude} prelude + {c.n_core} core x r={c.n_iterations} + {c.n_coda} coda,"
    )
    print(f"   d_model {c.d_model}, injection {c.injection}, state init {c.state_init},")
    print(f"   norms {c.normalization_type} {c.norm_placement}, pre-coda norm {c.pre_coda_norm}")

# %% [markdown]
# ## Huginn: every iteration hookable, any number of iterations
#
# Huginn injects the prelude's output e into every iteration through an adapter and starts from
# a random state; its pre-coda norm and two coda blocks are part of the readout, which the lens
# applies to every s_t. Huginn was trained with a random number of iterations, so k > r is just
# another view of the same weights.

# %%
tokens = torch.tensor([list(b"The loop runs")])
logits, cache = huginn.run_with_cache(tokens)
print("states cached:", [k for k in cache.keys() if k.endswith("hook_state")])
lens = logit_lens(huginn, cache)  # [iteration, batch, pos, d_vocab]
kl = (logits.log_softmax(-1).exp() * (logits.log_softmax(-1) - lens.log_softmax(-1))).sum(-1)
print("KL(full || lens at t), mean over positions:")
for t, value in enumerate(kl.mean(dim=(1, 2)).tolist()):
    print(f"  t={t}: {value:.4f}")
with huginn.iterations(8):
    longer = huginn(tokens)
print("8 iterations instead of 4, max |logit change|:", (longer - logits).abs().max().item())

# %% [markdown]
# ## Ouro: the exit gate beside the lens
#
# Ouro reads out after every step and a gate decides when to stop: `exit_probabilities(tokens)`
# is the distribution over steps 1..r, `exit_outputs` the per-step logits with the weighted and
# threshold readouts. `prediction_trajectory` puts the exit probability of each step beside the
# lens's rank and probability of a target (here Ouro's own full-depth prediction).

# %%
tokens = torch.tensor([list(b"early exit")])
exit_pdf = ouro.exit_probabilities(tokens)  # [batch, pos, k]
print("exit distribution at the last position:", exit_pdf[0, -1].round(decimals=3).tolist())
outputs = ouro.exit_outputs(tokens)
weighted = outputs.weighted_logits()
threshold_logits, step = outputs.threshold_exit(0.5)
print("step chosen by threshold 0.5 at each position (0-based):", step[0].tolist())
trajectory = prediction_trajectory(ouro, tokens)
print(trajectory.table(position=-1).round(3).to_string(index=False))
# Per-step logits are the lens at t = 1..r.
assert torch.allclose(logit_lens(ouro, tokens)[1:], outputs.step_logits.movedim(2, 0), atol=1e-5)
