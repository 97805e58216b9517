"""precision=fp32 against precision=bf16-mixed on this machine's CPU: the matmul peaks, then each pass of a step.

    python benchmarks/precision_cpu.py [--out benchmarks/results/precision_cpu.json]

1. Matmul throughput, fp32 and bf16, 1024 x 1024 x 1024 on torch's threads (the bf16 peak is what bf16-mixed can
   gain from; CPUs without AVX512-BF16 or AMX have no fast bf16 matmul).
2. The roles of the default job (examples/runs/default.yaml: embedded SmolLM2-135M, fp32 master weights) on 2
   groups of 8 responses (prompt 40, response 16 random tokens): the rollout (2 prompts x 8 samples of 16
   tokens), the old log-probs, one policy update. Each precision runs every pass twice; the second round is the
   one reported (the first warms up).

Writes the JSON (with the machine: CPU model, flags that matter, torch threads) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from hetrl.bench.machine import cpu, matmul_gflops
from hetrl.models import load_model
from hetrl.trainer import build
from hetrl.trainer.config import load_config
from hetrl.trainer.precision import decide


def passes(precision: str) -> dict:
    torch.manual_seed(0)
    random.seed(0)
    cfg = load_config("examples/runs/default.yaml", [f"precision={precision}"])
    model, tokenizer = load_model(cfg.model)
    pol = build.policy(cfg, model)
    learner = build.learner(cfg, pol, build.optimizer(cfg, pol), decide(cfg))
    worker = build.rollout_worker(cfg, pol.module, tokenizer, decide(cfg))
    groups = [([random.randrange(1000) for _ in range(40)], [[random.randrange(1000) for _ in range(16)]
                                                             for _ in range(8)]) for _ in range(2)]
    k = sum(len(r) for _, rs in groups for r in rs)
    weights = torch.full((k,), 1.0 / k, dtype=torch.float64)
    advantages = torch.randn(k, dtype=torch.float64)
    out = {}
    for _ in range(2):
        t0 = time.perf_counter()
        worker.generate([p for p, _ in groups], 8, 16, temperature=0.7)
        t1 = time.perf_counter()
        logp = learner.logprobs(groups)
        t2 = time.perf_counter()
        learner.update(groups, advantages, weights, logp, logp)
        t3 = time.perf_counter()
        out = {"rollout_s": t1 - t0, "logprobs_s": t2 - t1, "update_s": t3 - t2}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/precision_cpu.json")
    args = ap.parse_args()
    result = {"machine": cpu(), "matmul_gflops": {"fp32": matmul_gflops(torch.float32),
                                                  "bf16": matmul_gflops(torch.bfloat16)},
              "passes_s": {p: passes(p) for p in ("fp32", "bf16-mixed")}}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    m = result["matmul_gflops"]
    print(f"{result['machine']['model']} ({', '.join(result['machine']['flags'])}), "
          f"{result['machine']['torch_threads']} torch threads")
    print(f"matmul 1024^3: fp32 {m['fp32']:.1f} GFLOP/s, bf16 {m['bf16']:.1f} GFLOP/s ({m['bf16'] / m['fp32']:.2f}x)")
    fp32, mixed = result["passes_s"]["fp32"], result["passes_s"]["bf16-mixed"]
    for key in fp32:
        print(f"{key:<12} fp32 {fp32[key]:7.2f} s   bf16-mixed {mixed[key]:7.2f} s   ({mixed[key] / fp32[key]:.2f}x)")


if __name__ == "__main__":
    main()
