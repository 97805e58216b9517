"""Whether `precision=bf16-mixed` pays on this machine's CPU: the matmul peaks, then each pass of a step at fp32 and
bf16-mixed; results: benchmarks/results/precision_cpu.md (AVX2) and precision_cpu_avx512.md.

    python -m benchmarks.precision_cpu [--out benchmarks/results/precision_cpu.json]

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
import random

import torch

from hetrl.bench.harness import machine, matmul_gflops, timed, write_json
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
        _, rollout_s = timed(lambda: worker.generate([p for p, _ in groups], 8, 16, temperature=0.7))
        logp, logprobs_s = timed(lambda: learner.logprobs(groups))
        _, update_s = timed(lambda: learner.update(groups, advantages, weights, logp, logp))
        out = {"rollout_s": rollout_s, "logprobs_s": logprobs_s, "update_s": update_s}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/precision_cpu.json")
    args = ap.parse_args()
    result = {"machine": machine(), "matmul_gflops": {"fp32": matmul_gflops(torch.float32),
                                                  "bf16": matmul_gflops(torch.bfloat16)},
              "passes_s": {p: passes(p) for p in ("fp32", "bf16-mixed")}}
    write_json(args.out, result)
    m = result["matmul_gflops"]
    print(f"{result['machine']['model']} ({', '.join(result['machine']['flags'])}), "
          f"{result['machine']['torch_threads']} torch threads")
    print(f"matmul 1024^3: fp32 {m['fp32']:.1f} GFLOP/s, bf16 {m['bf16']:.1f} GFLOP/s ({m['bf16'] / m['fp32']:.2f}x)")
    fp32, mixed = result["passes_s"]["fp32"], result["passes_s"]["bf16-mixed"]
    for key in fp32:
        print(f"{key:<12} fp32 {fp32[key]:7.2f} s   bf16-mixed {mixed[key]:7.2f} s   ({mixed[key] / fp32[key]:.2f}x)")


if __name__ == "__main__":
    main()
