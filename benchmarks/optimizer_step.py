"""AdamW's step on SmolLM2-135M's parameters: torch's foreach kernel against its fused kernel, side by side.

The default run's optimizer (build.adamw) is the fused kernel where it can be; this measures what that changes
for one optimizer step (two per default-job training step). Random gradients, lr 2e-5, interleaved rounds after
two warm-up steps each (the first step allocates the moments), median.

    python benchmarks/optimizer_step.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

from hetrl.bench.machine import cpu
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
    for opt in opts.values():
        opt.step()
        opt.step()
    times = {k: [] for k in opts}
    for _ in range(args.rounds):
        for k, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    machine = cpu()
    text = "\n".join([
        "# AdamW step: foreach vs fused kernel", "",
        f"Made by `python benchmarks/optimizer_step.py --out benchmarks/results` on {machine['model']}, "
        f"{machine['cores']} cores, {machine['torch_threads']} torch threads, torch {torch.__version__}; SmolLM2-135M "
        f"({numel / 1e6:.1f}M fp32 parameters), {args.rounds} interleaved rounds, median. {args.conditions}", "",
        "| kernel | median s per step | vs foreach |", "|---|---:|---:|",
        *[f"| {k} | {v:.3f} | {med['foreach'] / v:.2f}x |" for k, v in med.items()], ""])
    print(text)
    if args.out:
        out = pathlib.Path(args.out)
        (out / "optimizer_step.json").write_text(json.dumps({"machine": machine, "parameters": numel,
                                                              "times_s": times, "median_s": med}, indent=2))
        (out / "optimizer_step.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
