"""Quick start: hook every iteration of a recurrent model, then run DCP on a planted model.

Run ``python demos/quickstart.py``; it takes well under a minute on a laptop CPU.
"""

from __future__ import annotations

import torch

from dcp_lens import DepthControlProtocol, HookedRecurrentTransformer, RecurrentConfig, hooks, load

# 1. A depth-recurrent model: 1 prelude block, a 2-block core looped 4 times, 1 coda block.
cfg = RecurrentConfig(
    d_model=64,
    n_heads=4,
    d_head=16,
    d_mlp=256,
    d_vocab=40,
    n_ctx=64,
    n_prelude=1,
    n_core=2,
    n_coda=1,
    n_iterations=4,
    injection="add",
    state_init="zeros",
)
model = HookedRecurrentTransformer(cfg).eval()
tokens = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(0))

with torch.no_grad():
    logits, cache = model.run_with_cache(tokens)  # a transformer_lens ActivationCache
print("state after iteration 2:", cache[model.state_hook_name(2)].shape)
print(
    "attention pattern of core layer 0, iteration 3:",
    cache[model.hook_name(3, 0, "attn.hook_pattern")].shape,
)
with model.iterations(8):  # the same weights, unrolled to 8 iterations
    print("blocks at 8 iterations:", model.cfg.n_layers)

# 2. The interventions are ordinary TransformerLens hooks.
with torch.no_grad():
    linchpin = model.run_with_hooks(tokens, fwd_hooks=hooks.replay(1).fwd_hooks(model))
print("replay(1) changes the output by", float((linchpin - logits).abs().max()))

# 3. DCP on a model whose answer is known: its gap comes from readout shift only.
planted = load("planted:readout_shift")
task = planted.planted_task
results = DepthControlProtocol(planted, n_bootstrap=200, progress=False).run(
    task.evaluation(256), task.calibration(256)
)
print(results.shares().query("metric == 'accuracy'")[["metric", "S", "B", "D"]])
