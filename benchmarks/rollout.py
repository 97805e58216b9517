"""The rollout's shared-prompt prefill against transformers' `num_return_sequences`, side by side.

SmolLM2-135M (the default run's model), 8 prompts x 8 samples, 16 new tokens, temperature 0.7, seeded: the
default job's rollout batch, once with its own prompts (reasoning-gym arithmetic, ~38 tokens) and once with a
few-shot prefix of solved problems in front of each (~500 tokens, the long prompts of real tasks). `before` is
the previous rollout (`generate(num_return_sequences=8)`, which copies each prompt 8 times before the prefill),
`after` is RolloutWorker.generate (each prompt prefilled once, its cache repeated 8 times). Rounds interleaved,
median. Each round both sample from the same seed; how many of their 64 samples came out token-identical is
reported (the logits agree to fp32 rounding, tests/trainer/test_rollout.py, so a draw that lands within that
rounding of a category boundary can pick the neighbour, and the sample then continues differently).

    python benchmarks/rollout_prefill.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import torch

from hetrl.data import TaskSource, prompt_ids
from hetrl.models import load_model
from hetrl.trainer.config import DEFAULT_TASK_CONFIG
from hetrl.trainer.rollout import RolloutWorker


def before(worker: RolloutWorker, prompts, n, max_new_tokens, temperature):
    """The rollout as it was: transformers expands every prompt n times, then prefills all of them."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), worker.pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    with torch.no_grad():
        out = worker.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                    num_return_sequences=n, do_sample=True, temperature=temperature, top_p=1.0,
                                    top_k=0, pad_token_id=worker.pad, eos_token_id=worker.eos)
    rows = out[:, width:].tolist()
    return [r[:r.index(worker.eos) + 1] if worker.eos in r else r for r in rows]


def after(worker: RolloutWorker, prompts, n, max_new_tokens, temperature):
    return [s.tokens for g in worker.generate(prompts, n, max_new_tokens, temperature) for s in g]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out")
    parser.add_argument("--conditions", default="Nothing else computed while it ran.")
    args = parser.parse_args()
    model, tokenizer = load_model("smollm2-135m")
    worker = RolloutWorker(model.eval(), tokenizer, batch_size=64)
    task = TaskSource("basic_arithmetic", DEFAULT_TASK_CONFIG, 0, 8, tokenizer)
    problems = [e.row for e in task.train_examples(0, 8 + 24)[0]]
    shots = "".join(f"{p['question']} {p['answer']}\n" for p in problems[8:])
    cases = {
        "default prompts": [e.prompt_ids for e in task.eval_examples],
        "few-shot prompts": [prompt_ids(tokenizer, [{"role": "user", "content": shots + p["question"]}])
                             for p in problems[:8]],
    }
    rows = []
    for name, prompts in cases.items():
        times = {"before": [], "after": []}
        identical = []
        for r in range(args.rounds):
            for variant, fn in (("before", before), ("after", after)):
                torch.manual_seed(r)
                t0 = time.perf_counter()
                tokens = fn(worker, prompts, 8, 16, 0.7)
                times[variant].append(time.perf_counter() - t0)
                if variant == "before":
                    want = tokens
                else:
                    identical.append(sum(a == b for a, b in zip(tokens, want)))
        rows.append({"case": name, "prompt_tokens_mean": statistics.mean(len(p) for p in prompts),
                     "before_s": statistics.median(times["before"]), "after_s": statistics.median(times["after"]),
                     "identical_samples": identical, "times": times})
        print(json.dumps(rows[-1]), flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    lines = ["# Rollout: prefill each prompt once vs transformers' num_return_sequences", "",
             f"Made by `python benchmarks/rollout_prefill.py --out benchmarks/results` on {cpu}, {os.cpu_count()} "
             f"cores, torch {torch.__version__}; SmolLM2-135M, 8 prompts x 8 samples, 16 new tokens, temperature 0.7; "
             f"{args.rounds} interleaved rounds, median. {args.conditions}", "",
             "| prompts | prompt tokens (mean) | before s | after s | speed-up | token-identical samples per round (of 64) |",
             "|---|---:|---:|---:|---:|---|"]
    lines += [f"| {r['case']} | {r['prompt_tokens_mean']:.0f} | {r['before_s']:.2f} | {r['after_s']:.2f} | "
              f"{r['before_s'] / r['after_s']:.2f}x | {', '.join(map(str, r['identical_samples']))} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        out = pathlib.Path(args.out)
        (out / "rollout_prefill.json").write_text(json.dumps(rows, indent=2))
        (out / "rollout_prefill.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
