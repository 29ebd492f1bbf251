"""Retrofit recurrence into stories260K, then run DCP on the dense original and its retrofit.

stories260K's five blocks become prelude (block 0), core (blocks 1-3, looped r times) and coda
(block 4); the loop is distilled for a few CPU minutes against the original's own next-token
distributions on text the original samples itself, so no corpus is needed. The two models are
saved as a negative-control pair and DCP runs on both::

    python demos/retrofit_stories260k.py --out runs/retrofit_stories260k --steps 300

writes ``OUT/original``, ``OUT/retrofit`` (`save_pretrained` folders, each loadable with
``dcp_lens.load``), ``OUT/pair.json`` (losses, truncation curve, settings) and
``OUT/results.json`` (DCP on both models).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from dcp_lens import DepthControlProtocol, load
from dcp_lens.protocol.dcp import EvaluationSet
from dcp_lens.protocol.results import write_results_json
from dcp_lens.zoo.loaders.llama2c import find_llama2c_files
from dcp_lens.zoo.retrofit import (
    ORIGINAL_DIR,
    RETROFIT_DIR,
    distill,
    retrofit,
    sample_corpus,
    save_pair,
    truncation_curve,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO / "demos" / "data" / "stories260K"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/retrofit_stories260k"))
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="stories260K folder")
    parser.add_argument("--steps", type=int, default=300, help="distillation steps")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--iterations", type=int, default=4, help="r, the core's iterations")
    parser.add_argument("--sequences", type=int, default=1408, help="sampled sequences in all")
    parser.add_argument("--held-out", type=int, default=128, help="held-out sequences")
    parser.add_argument("--length", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--injection", default="add", choices=("add", "concat_adapter"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bootstrap", type=int, default=1000)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    _, tokenizer_file = find_llama2c_files(args.data)
    original = load(f"llama2c:{args.data}")
    r = args.iterations

    started = time.perf_counter()
    corpus = sample_corpus(
        original, args.sequences, args.length, seed=args.seed, held_out=args.held_out
    )
    print(
        f"sampled {args.sequences} x {args.length} tokens in {time.perf_counter() - started:.0f} s"
    )
    model = retrofit(original, 1, 3, 1, n_iterations=r, injection=args.injection)
    before = truncation_curve(model, corpus.held_out)[r]
    report = distill(
        model, original, corpus, args.steps, args.lr, r, seed=args.seed, threads=args.threads
    )

    original_loss = truncation_curve(original, corpus.held_out)[original.n_iterations]
    curve = truncation_curve(model, corpus.held_out, range(1, 2 * r + 1))
    print(
        f"\ndistilled {args.steps} steps in {report.seconds:.0f} s "
        f"(KL {report.kl[0]:.3f} -> {sum(report.kl[-10:]) / 10:.3f})"
    )
    print(f"held-out loss, original (dense, 5 layers): {original_loss:.4f} nats/token")
    print(
        f"held-out loss, retrofit at r={r}: {curve[r]:.4f} (before distillation {before:.4f}; "
        f"difference {curve[r] - original_loss:+.4f})"
    )
    print("truncation curve of the retrofit (k > r: extrapolation):")
    for k, loss in curve.items():
        print(f"  k={k}: {loss:.4f}{'  <- r' if k == r else ''}")
    prompt = "Once upon a time"
    print("greedy, original:", original.generate(prompt, 24))
    print("greedy, retrofit:", model.generate(prompt, 24))

    summary = {
        "seed": args.seed,
        "source": str(args.data),
        "split": {"prelude": [0], "core": [1, 2, 3], "coda": [4]},
        "n_iterations": r,
        "injection": args.injection,
        "state_init": model.cfg.state_init,
        "held_out_loss": {
            "original": original_loss,
            "retrofit": curve[r],
            "difference": curve[r] - original_loss,
            "retrofit_before_distillation": before,
        },
        "truncation_curve": [{"k": k, "cross_entropy": loss} for k, loss in curve.items()],
        "corpus": corpus.settings(),
        "distillation": {
            **report.settings,
            "seconds": report.seconds,
            "kl_first": report.kl[0],
            "kl_last10": sum(report.kl[-10:]) / 10,
        },
    }
    save_pair(args.out, original, model, summary, tokenizer_file=tokenizer_file)

    half = corpus.held_out.shape[0] // 2
    evaluation = EvaluationSet.from_tokens(corpus.held_out[:half])
    calibration = EvaluationSet.from_tokens(corpus.held_out[half:])
    runs = []
    for spec, subject in ((ORIGINAL_DIR, original), (RETROFIT_DIR, model)):
        protocol = DepthControlProtocol(
            subject,
            metrics=("cross_entropy", "kl_to_full"),
            n_bootstrap=args.bootstrap,
            seed=args.seed,
            spec=str(args.out / spec),
            progress=False,
        )
        runs.append(protocol.run(evaluation, calibration))
    path = write_results_json(runs, args.out / "results.json")
    for spec, results in zip((ORIGINAL_DIR, RETROFIT_DIR), runs, strict=True):
        print(f"\nDCP on {spec} ({results.architecture}, r = {results.n_iterations}):")
        print(results.shares().to_string(index=False))
        truncation = results.curves().query("condition == 'truncate'")
        print(truncation.pivot(index="k", columns="metric", values="value").to_string())
    print(f"\nwrote {args.out / 'pair.json'} and {path}")


if __name__ == "__main__":
    main()
