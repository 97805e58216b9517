"""Why hetrl decodes with its own loop: the rollout, step by step against transformers' `generate`, side by side in
one run; result: benchmarks/results/rollout.md.

SmolLM2-135M (the default run's model), seeded, temperature 0.7, top-p 1, the two cases of `hetrl bench train`:
`default` (the default job's rollout batch: 8 reasoning-gym arithmetic prompts of ~38 tokens x 8 samples, 16 new
tokens) and `long` (2 prompts behind a shared few-shot block, ~505 tokens, x 8 samples, 64 new tokens). Four
variants, each a change on the one before:

1. `generate`: `generate(num_return_sequences=8)`, which copies each prompt 8 times before the prefill.
2. `prefill once`: each prompt prefilled once, its cache repeated 8 times, `generate` continues (session 10).
3. `own loop`: hetrl's decoding loop on that repeated cache: finished rows leave the batch, one uniform draw
   per row inverts the softmax CDF (torch's CPU multinomial draws one exponential per vocabulary entry).
4. `prompt once in the cache`: RolloutWorker's default, the loop on a SharedPrefixCache (each prompt's keys
   and values stored and read once per group per step, the rows' own tokens written in place).

Rounds interleaved, median seconds. Samples differ between variants (different random streams, and a
sampled length changes the work), so the mean number of new tokens per row is reported beside each time;
a greedy pass of every variant reports how many of its rows are token-identical to `generate`'s.

    python -m benchmarks.studies.rollout --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from hetrl.bench.harness import interleaved_times, machine, write_results
from hetrl.bench.train_vs_trl import CASES, job
from hetrl.data import prompt_ids
from hetrl.models import load_model
from hetrl.trainer.rollout import RolloutWorker, left_padded

N, TEMPERATURE = 8, 0.7


def _padded(worker, prompts):
    return left_padded(prompts, worker.pad)


def _cut(worker, rows):
    return [r[:r.index(worker.eos) + 1] if worker.eos in r else r for r in rows]


def generate(worker, prompts, new, greedy):
    """1: transformers expands every prompt N times, then prefills and decodes all of them."""
    ids, mask = _padded(worker, prompts)
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=TEMPERATURE, top_p=1.0, top_k=0)
    with torch.no_grad():
        out = worker.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                    num_return_sequences=1 if greedy else N, pad_token_id=worker.pad,
                                    eos_token_id=worker.eos, **sampling)
    rows = _cut(worker, out[:, ids.shape[1]:].tolist())
    return [r for r in rows for _ in range(N)] if greedy else rows


def prefill_once(worker, prompts, new, greedy):
    """2: the prompt prefilled once and its cache repeated N times; transformers' generate decodes."""
    ids, mask = _padded(worker, prompts)
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=TEMPERATURE, top_p=1.0, top_k=0)
    with torch.no_grad():
        cache = worker._shared_prefill(ids, mask, N)
        out = worker.model.generate(input_ids=ids.repeat_interleave(N, 0), attention_mask=mask.repeat_interleave(N, 0),
                                    past_key_values=cache, max_new_tokens=new, pad_token_id=worker.pad,
                                    eos_token_id=worker.eos, **sampling)
    return _cut(worker, out[:, ids.shape[1]:].tolist())


def _worker(shared):
    def run(worker, prompts, new, greedy):
        worker.shared_decode = shared
        return [s.tokens for g in worker.generate(prompts, N, new, TEMPERATURE, greedy=greedy) for s in g]
    return run


VARIANTS = {"generate": generate, "prefill once": prefill_once, "own loop": _worker(False),
            "prompt once in the cache": _worker(True)}


def cases(tokenizer):
    from hetrl.data import TaskSource
    from hetrl.trainer.config import DEFAULT_TASK_CONFIG

    task = TaskSource("basic_arithmetic", DEFAULT_TASK_CONFIG, 0, 8, tokenizer)
    cfg, rows, _ = job(CASES["long"], 0, 2, "/tmp/hetrl-rollout-bench")
    long_prompts = [prompt_ids(tokenizer, r["prompt"]) for r in rows[: cfg.prompts_per_step]]
    return {"default": ([e.prompt_ids for e in task.eval_examples], 16),
            "long": (long_prompts, cfg.max_new_tokens)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--case", nargs="+", default=["default", "long"])
    parser.add_argument("--out")
    parser.add_argument("--conditions", default="Nothing else computed while it ran.")
    args = parser.parse_args()
    model, tokenizer = load_model("smollm2-135m")
    worker = RolloutWorker(model.eval(), tokenizer, batch_size=64)
    results = []
    for name, (prompts, new) in cases(tokenizer).items():
        if name not in args.case:
            continue
        greedy = {v: fn(worker, prompts, new, True) for v, fn in VARIANTS.items()}
        lengths = {v: [] for v in VARIANTS}

        def sample(variant, fn):
            def call():   # round r samples with seed r in every variant
                torch.manual_seed(len(lengths[variant]))
                lengths[variant].append(statistics.mean(len(x) for x in fn(worker, prompts, new, False)))
            return call

        times = interleaved_times({v: sample(v, fn) for v, fn in VARIANTS.items()}, args.rounds, warmup=0)
        result = {"case": name, "prompts": len(prompts), "n": N, "max_new_tokens": new,
                  "prompt_tokens_mean": statistics.mean(len(p) for p in prompts),
                  "variants": {v: {"median_s": statistics.median(times[v]), "times_s": times[v],
                                   "new_tokens_mean": statistics.mean(lengths[v]),
                                   "greedy_identical_rows": sum(a == b for a, b in zip(greedy[v], greedy["generate"])),
                                   "rows": len(greedy["generate"])} for v in VARIANTS}}
        results.append(result)
        print(json.dumps(result), flush=True)
    host = machine()
    lines = ["# Rollout: hetrl's decoding against transformers' generate, step by step", "",
             f"Made by `python -m benchmarks.studies.rollout --out benchmarks/results` on {host['model']}, "
             f"{host['cpus']} cores, {host['torch_threads']} torch threads, torch {torch.__version__}; "
             f"SmolLM2-135M fp32, N = {N} samples per prompt, "
             f"temperature {TEMPERATURE}; {args.rounds} interleaved rounds, median. {args.conditions} Variants as "
             "in the script's docstring; each row's speed-up is against `generate`.", ""]
    for r in results:
        lines += [f"## `{r['case']}`: {r['prompts']} prompts of {r['prompt_tokens_mean']:.0f} tokens (mean) x {N}, "
                  f"up to {r['max_new_tokens']} new tokens", "",
                  "| variant | median s | speed-up | new tokens per row (mean) | greedy rows identical to generate's |",
                  "|---|---:|---:|---:|---|"]
        base = r["variants"]["generate"]["median_s"]
        for v, x in r["variants"].items():
            lines.append(f"| {v} | {x['median_s']:.2f} | {base / x['median_s']:.2f}x | {x['new_tokens_mean']:.1f} | "
                         f"{x['greedy_identical_rows']} of {x['rows']} |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_results(args.out, "rollout", {"machine": host, "results": results}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
