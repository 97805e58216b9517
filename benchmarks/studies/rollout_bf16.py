"""Why the bf16-mixed rollout samples from a bf16 copy of the policy: against sampling from the fp32 policy under
autocast (what it did before), on the default job's rollout, side by side in one run; result:
benchmarks/results/rollout_bf16.md.

    python -m benchmarks.studies.rollout_bf16 [--rounds 5] [--out benchmarks/results]

The embedded SmolLM2-135M-Instruct, the default task's first 8 prompts (chat template), 8 samples each in one
generate call (64 rows), temperature 0.7, the default 16 new tokens and 64 new tokens. EOS is switched off
(every row decodes the full length, as benchmarks/executor.py's decode probe does), so both variants do the same
work whatever they sample. Interleaved rounds, the first dropped as warm-up, medians. The bf16 copy's refresh
(build.bf16_weights_of + load, what each update's weight sync costs) is timed too.
"""

from __future__ import annotations

import argparse
import copy
import statistics

from hetrl.bench.harness import interleaved_times, machine, matmul_gflops, revision, spread, utc_now, write_results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()

    import torch

    from hetrl.models import load_model
    from hetrl.trainer import build
    from hetrl.trainer.config import RunConfig
    from hetrl.trainer.precision import decide
    from hetrl.trainer.rollout import RolloutWorker
    from hetrl.trainer.run import build_source

    cfg = RunConfig(precision="bf16-mixed")
    model, tokenizer = load_model("smollm2-135m")
    source = build_source(cfg, tokenizer)      # the default task, as hetrl train reads it
    prompts = [e.prompt_ids for e in source.train_examples(0, 8)[0]]
    copy_bf16 = copy.deepcopy(model).to(torch.bfloat16).eval().requires_grad_(False)
    workers = {"fp32 policy under autocast": RolloutWorker(model, tokenizer, 64, precision=decide(cfg)),
               "bf16 copy": RolloutWorker(copy_bf16, tokenizer, 64, precision=decide(cfg))}
    for w in workers.values():
        w.eos = -1
    res = {"revision": revision(), "date": utc_now(), "machine": machine(),
           "bf16_matmul_gflops": matmul_gflops(torch.bfloat16), "rounds": args.rounds, "cases": {}}
    for new_tokens in (16, 64):
        calls = {k: 0 for k in workers}

        def sample(name, w, new_tokens=new_tokens):
            def call():   # round r (0: the warm-up) samples with seed r in both variants
                torch.manual_seed(calls[name])
                calls[name] += 1
                out = w.generate(prompts, 8, new_tokens, temperature=cfg.temperature)
                assert all(len(s.tokens) == new_tokens for g in out for s in g)
            return call

        times = interleaved_times({k: sample(k, w) for k, w in workers.items()}, args.rounds, warmup=1)
        res["cases"][new_tokens] = {k: {**spread(v), "times": v} for k, v in times.items()}
        print(new_tokens, {k: round(statistics.median(v), 3) for k, v in times.items()}, flush=True)

    def refresh():
        return workers["bf16 copy"].load_weights(build.bf16_weights_of(model.state_dict()))

    res["refresh_s"] = statistics.median(interleaved_times({"refresh": refresh}, args.rounds, warmup=0)["refresh"])

    lines = ["# The bf16-mixed rollout: a bf16 copy of the policy against the fp32 policy under autocast", "",
             f"`python -m benchmarks.studies.rollout_bf16` at {res['revision']}, {res['date']}: "
             f"{res['machine']['model']}, "
             f"{res['machine']['torch_threads']} threads, torch {res['machine']['torch']} (bf16 1024^3 matmul "
             f"{res['bf16_matmul_gflops']:.0f} GFLOP/s in this run). SmolLM2-135M, the default task's 8 prompts x 8 "
             f"samples (64 rows), EOS off; median of {args.rounds} interleaved rounds after one warm-up.", "",
             "| new tokens | fp32 policy under autocast s | bf16 copy s | bf16 copy / autocast |",
             "|---:|---:|---:|---:|"]
    for n, c in res["cases"].items():
        a, b = c["fp32 policy under autocast"]["median_s"], c["bf16 copy"]["median_s"]
        lines.append(f"| {n} | {a:.2f} | {b:.2f} | {b / a:.2f}x |")
    lines += ["", f"Refreshing the copy after an update (cast + load, once per step): {res['refresh_s']:.3f} s."]
    write_results(args.out, "rollout_bf16", res, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
