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
# # Hooking into iteration activations
#
# A depth-recurrent model applies one weight-shared core block r times. `HookedRecurrentTransformer`
# unrolls the loop with tied weights, so every iteration has its own TransformerLens hook names:
# `run_with_cache` keeps every iteration, and TransformerLens's own tools (`ActivationCache`,
# `patching`) work unchanged. This notebook uses the bundled `default` model (a 0 prelude +
# 1 core x 4 + 0 coda model trained on variable binding: `a=d d=8 ? a` asks for the value of `a`,
# 2 hops here) and shows:
#
# 1. the cache and the hook names of each iteration;
# 2. the per-iteration lens (`dcp_lens.lenses.lens`): the model's own readout applied to every
# state s_t;
# 3. activation patching across iterations with `transformer_lens.patching`, reshaped to
#    [iteration, layer, position].
#
# `DCP_DEMO_QUICK=1` runs it on fewer examples (the test suite does).

# %%
import os

os.environ.setdefault("TQDM_DISABLE", "1")  # no progress bars in the notebook's outputs
import torch
from transformer_lens import patching

import dcp_lens
from dcp_lens.lenses.interop import split_by_iteration
from dcp_lens.lenses.lens import logit_lens, prediction_trajectory
from dcp_lens.tasks import get_task

QUICK = os.environ.get("DCP_DEMO_QUICK") == "1"
torch.set_num_threads(1)
model = dcp_lens.load("default")  # eval mode, as patching requires
task = get_task(**model.task_config)
model.tokenizer = task  # the task's vocabulary: to_str_tokens and to_tokens read text
print(model.extra_repr())
print(task.describe())

# %% [markdown]
# ## 1. The cache: every iteration under its own name

# %%
batch = task.evaluation(64 if QUICK else 512)
logits, cache = model.run_with_cache(batch.tokens)
print("iterations r =", model.n_iterations, "| blocks in the unrolled view:", model.cfg.n_layers)
for t in range(model.n_iterations + 1):
    print(f"s_{t}: {model.state_hook_name(t):18s}", tuple(cache[model.state_hook_name(t)].shape))
print("core layer 0 at iteration 3:", model.hook_name(3, 0, "attn.hook_pattern"))
print(model.to_str_tokens(batch.tokens[0]))

# %% [markdown]
# ## 2. The lens across iterations
#
# `logit_lens(model, cache)` reads out every state s_t through the model's own readout (pre-coda
# norm, coda, final norm, unembedding), so the lens at t = k is exactly what the model truncated
# to k iterations outputs. Accuracy per hop count h and iteration t:

# %%
lens = logit_lens(model, cache)  # [iteration, batch, pos, d_vocab]
hops = batch.metadata["hops"]
rows = []
for t in range(model.n_iterations + 1):
    correct = batch.correct(lens[t])
    rows.append([t] + [correct[hops == h].float().mean().item() for h in range(1, 5)])
print("t   " + "  ".join(f"h={h}" for h in range(1, 5)))
for row in rows:
    print(f"{row[0]}  " + "  ".join(f"{value:.2f}" for value in row[1:]))
assert torch.allclose(lens[-1], logits, atol=1e-5)  # the lens at t = r is the model's logits

# %% [markdown]
# One query's trajectory: the rank and probability of the right answer at every iteration (a
# 4-hop query needs about 4 iterations: one hop per iteration).

# %%
example, answer = (hops == 4).nonzero()[0].tolist()
position = int(batch.answer_positions[example, answer])
targets = batch.targets.clamp(min=0)  # the answer at scored positions
trajectory = prediction_trajectory(model, cache, targets)
print(task.decode(batch.tokens[example]), "| query at position", position)
print(trajectory.table(example, position).round(3).to_string(index=False))

# %% [markdown]
# ## 3. Activation patching across iterations
#
# Corrupt the program's value for that query (every assignment of its answer digit gets another
# digit), then patch the clean residual stream into the corrupted run at every block and position
# with TransformerLens's `patching.get_act_patch_resid_pre`. Its result is per block
# `[n_layers, pos]`; `split_by_iteration` turns it into `[iteration, layer, pos]`.

# %%
clean = batch.tokens[example : example + 1]
right = int(batch.answers[example, answer])
digits = [piece for piece in task.vocab if piece.isdigit()]
right_digit = task.vocab[right]
wrong_digit = digits[(digits.index(right_digit) + 1) % len(digits)]
corrupted = clean.clone()
for pos, token in enumerate(clean[0].tolist()):
    piece = task.vocab[token]  # an assignment such as "d=8"
    if piece.endswith("=" + right_digit):
        corrupted[0, pos] = task.vocab.index(piece[:-1] + wrong_digit)
wrong = task.vocab.index(wrong_digit)
print("clean:    ", task.decode(clean[0]))
print("corrupted:", task.decode(corrupted[0]))


def logit_difference(logits: torch.Tensor) -> torch.Tensor:
    return logits[0, position, right] - logits[0, position, wrong]


_, clean_cache = model.run_with_cache(clean)
with torch.no_grad():
    print("clean", logit_difference(model(clean)).item())
    print("corrupted", logit_difference(model(corrupted)).item())
result = patching.get_act_patch_resid_pre(model, corrupted, clean_cache, logit_difference)
split = split_by_iteration(model, result)
print("core:", tuple(split.core.shape), "= [iteration, layer, position]")
header = "".join(f"{piece:>6s}" for piece in model.to_str_tokens(clean[0]))
print("      " + header)
for t in range(model.n_iterations):
    print(f"t={t + 1}  " + "".join(f"{value:6.1f}" for value in split.core[t, 0].tolist()))

# %% [markdown]
# Patching the stream entering iteration 1 restores the answer only at the corrupted assignment;
# at later iterations the information has moved along the chain toward the query position.
