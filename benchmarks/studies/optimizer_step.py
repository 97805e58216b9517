"""Why the default optimizer is AdamW's fused kernel: its step on SmolLM2-135M's parameters against the foreach
kernel, side by side; result: benchmarks/results/optimizer_step.md.

The default run's optimizer (build.adamw) is the fused kernel where it can be; this measures what that changes
for one optimizer step (two per default-job training step). Random gradients, lr 2e-5, interleaved rounds after
two warm-up steps each (the first step allocates the moments), median.

    python -m benchmarks.studies.optimizer_step --out benchmarks/results
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from hetrl.bench.harness import interleaved_times, machine, write_results
from hetrl.models import load_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out")
    parser.add_argument("--conditions", default="Nothing else computed while it ran.")
    args = parser.parse_args()
    model, _ = load_model("smollm2-135m")
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    torch.manual_seed(0)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opts = {"foreach": torch.optim.AdamW(params, lr=2e-5, foreach=True),
            "fused": torch.optim.AdamW(params, lr=2e-5, fused=True)}
    times = interleaved_times({k: opt.step for k, opt in opts.items()}, args.rounds, warmup=2)
    med = {k: statistics.median(v) for k, v in times.items()}
    host = machine()
    text = "\n".join([
        "# AdamW step: foreach vs fused kernel", "",
        f"Made by `python -m benchmarks.studies.optimizer_step --out benchmarks/results` on {host['model']}, "
        f"{host['cpus']} cores, {host['torch_threads']} torch threads, torch {torch.__version__}; SmolLM2-135M "
        f"({numel / 1e6:.1f}M fp32 parameters), {args.rounds} interleaved rounds, median. {args.conditions}", "",
        "| kernel | median s per step | vs foreach |", "|---|---:|---:|",
        *[f"| {k} | {v:.3f} | {med['foreach'] / v:.2f}x |" for k, v in med.items()], ""])
    print(text)
    if args.out:
        write_results(args.out, "optimizer_step", {"machine": host, "parameters": numel, "times_s": times,
                                                   "median_s": med}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
