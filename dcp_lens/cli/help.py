"""What each command of the command line is, in words: the help's description, the model
specs it takes, an example per command and the help of options whose words run long. Plain
text, importing nothing, so that help stays instant."""

from __future__ import annotations

# The help of options whose words run long (`dcp_lens.cli.parser` names them).
HELP = {
    "threads": "CPU threads for torch (default 1: the docs' page Command line says why)",
    "dry_run": (
        "print the run's estimated peak memory by stage and the batch size that fits its "
        "budget, then stop (nothing is run or written)"
    ),
    "models": (
        "comma-separated planted models (default: all of planted.BRACKET_PLANTED; with "
        "--coverage, these besides every mixture)"
    ),
    "coverage": (
        "instead of the suite: replicate every mixture (and each model of --models) N times "
        "with seeds seed, seed+1, ... and report how often each 95%% interval covers the truth"
    ),
    "merge": (
        "instead of running: merge the comma-separated folders (or validation.json files) "
        "that validate wrote, one part of the suite or of --coverage each, into --out"
    ),
    "bench_preset": (
        "model shape: small (1 + 2 x 16 + 1, d_model 256, vocabulary 512, batch 16 x 128) "
        "or huginn (Huginn-0125: 2 + 4 x 32 + 2, d_model 5280, vocabulary 65536, batch 4 x 1024; "
        "random weights, for a GPU); the flags below replace its values"
    ),
    "repeats": (
        "timed rounds of forward, plain loop and sweep, alternated (times: the fastest; "
        "sweep / forward: the median of the rounds' paired ratios)"
    ),
    "batches": (
        "calibration and evaluation batches each (default 1); the sweep's fixed costs "
        "(solves, the jackknife's refits) weigh less as it grows, as in a run's 512 + 512 "
        "sequences"
    ),
    "estimate": (
        "print the estimated peak memory of a DCP run at the preset's shape (built on the "
        "meta device: nothing is allocated or timed), by term and stage, and stop"
    ),
    "count": (
        "count the work instead of timing it: forwards and readouts per token of each stage "
        "(calibration pass, refits, confidence matching, evaluation, probe) of a run of "
        "--batches batches (default 32: 512 + 512 sequences at batch 16) on the preset's "
        "layout, weighed at its full width and vocabulary; any device, no timer"
    ),
    "bench_threads": (
        "CPU threads for torch (default: torch's own, so that figures compare with a plain "
        "PyTorch run; --threads 1 is what run uses)"
    ),
}

DESCRIPTION = """\
The Depth Control Protocol for depth-recurrent transformers: split the gap between full depth
and truncated depth into readout shift (S), block applications (B) and distinct computation (D).
Run dcp-lens COMMAND --help for a command's options, their defaults and an example."""

# Kept in step with the registry by tests/acceptance/test_cli.py (listed here so that help does
# not import the loaders).
MODEL_SPECS = """\
model specs (--model, --dense):
  default, default-every-iteration, default-dense
                    the bundled models (recurrent; trained every iteration; the dense control)
  planted:NAME      a planted model whose answer is known; NAME is one of readout_shift,
                    distinct_computation, block_count, readout_shift_by_token_type,
                    readout_shift_by_position, mixture_shift_distinct, mixture_shift_blocks,
                    readout_shift_soft, distinct_computation_soft, block_count_soft,
                    distinct_computation_context, block_count_context, frame_flip,
                    distinct_computation_skewed, mixture_three_way,
                    distinct_computation_smooth, readout_shift_step, frame_flip_gated,
                    frame_warp, readout_shift_walk, nuisance_shift, nuisance_distinct
  huginn:PATH       a local Huginn-0125 checkpoint folder (config.json and safetensors)
  ouro:PATH         a local Ouro checkpoint folder
  raven-retrofit:PATH
                    a local retrofitted-recurrence checkpoint (Llama or OLMo variant); its
                    dense parent (bridge:PATH) is its negative control
  hrm-text:PATH     a local HRM-Text folder of transformers' HrmTextForCausalLM; k counts
                    outer cycles
  llama2c:PATH      a llama2.c checkpoint (.bin, or a folder with it and its tokenizer); dense
  bridge:PATH       a local Hugging Face folder through a TransformerLens TransformerBridge; dense
  PATH              a folder written by save_pretrained (dcp-lens train writes RUN/model)"""

EXAMPLES = {
    "run": "example:\n  dcp-lens run --model planted:readout_shift --out out/planted\n"
    "  dcp-lens run --out out/default   (the bundled default and default-dense)",
    "report": "example:\n  dcp-lens report out/default",
    "train": "example:\n  dcp-lens train --preset tiny --out runs/tiny && "
    "dcp-lens run --model runs/tiny/model --out runs/tiny/dcp",
    "experiment": "example:\n  dcp-lens experiment training-intervention --preset tiny "
    "--seeds 0,1 --out runs/intervention",
    "validate": "example:\n  dcp-lens validate --models readout_shift,block_count "
    "--out out/validate\n  dcp-lens validate --coverage 10 --out out/coverage",
    "bench": "example:\n  dcp-lens bench --d-model 64 --iterations 8 --batch-size 4 --seq 32 "
    "--json",
}


__all__ = ["DESCRIPTION", "EXAMPLES", "HELP", "MODEL_SPECS"]
