"""The default job trained with its rollout on hetrl's decoding loop (`hf`) and on vLLM (`vllm`, with the default
token-level TIS at 2.0, and without correction), same seeds; results: benchmarks/results/rollout_engine_default_job.md.

    python -m benchmarks.rollout_engine_default_job [--seeds 0 1 2] [--runs runs/rollout_engines] [--out ...]

Each variant is `hetrl train` (examples/runs/default.yaml, precision auto) in a process of its own, one at a time;
a run whose summary.json exists is not run again, so an interrupted measurement continues. The page compares the
held-out accuracy before and after (100 prompts, greedy, through the run's own rollout engine), the step time and
its rollout share, the weight sync, and the mismatch between vLLM's log-probs and the trainer's over the run
(metrics.jsonl's mismatch/ and rollout_corr/ columns).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys

from hetrl.bench.harness import machine, revision, utc_now, write_results

VARIANTS = {   # name -> overrides
    "hf": ["rollout_engine=hf"],
    "vllm (TIS 2.0, default)": ["rollout_engine=vllm"],
    "vllm (no correction)": ["rollout_engine=vllm", "rollout_is=null"],
}


def out_dir(name: str, seed: int, runs: pathlib.Path) -> pathlib.Path:
    return runs / f"{name.split()[0]}{'_nocorr' if 'no correction' in name else ''}_seed{seed}"


def run(name: str, seed: int, runs: pathlib.Path) -> pathlib.Path:
    out = out_dir(name, seed, runs)
    if not (out / "summary.json").exists():
        cmd = [sys.executable, "-m", "hetrl.cli", "train", "--config", "examples/runs/default.yaml",
               *VARIANTS[name], f"seed={seed}", f"out_dir={out}"]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env=dict(os.environ, VLLM_LOGGING_LEVEL="WARNING"))
        shutil.rmtree(out / "checkpoints", ignore_errors=True)   # about 3 GB a run; the page needs none of it
    return out


def summarize(out: pathlib.Path) -> dict:
    s = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:] or rows

    def med(key):
        vals = [r[key] for r in later if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    def over_run(key, how=max):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return how(vals) if vals else None

    return {"dir": str(out), "before": s["eval_accuracy_before"], "after": s["eval_accuracy_after"],
            "gained": s["gained"], "lost": s["lost"], "p": s["sign_test_p"], "precision": s["precision"],
            "step_s": med("step_s"), "gen_s": med("gen_s"), "weight_sync_s": med("weight_sync_s"),
            "train_s": s["train_seconds"],
            "mismatch_abs_mean": over_run("mismatch/abs_diff_mean", statistics.mean),
            "mismatch_abs_max": over_run("mismatch/abs_diff_max"),
            "mismatch_kl_k3": over_run("mismatch/kl_k3", statistics.mean),
            "ratio_out_frac": over_run("mismatch/ratio_out_of_range_frac", statistics.mean),
            "is_clipped_frac": over_run("rollout_corr/rollout_is_ratio_fraction_high", statistics.mean)}


def page(res: dict) -> str:
    m = res["machine"]

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = ["# The default job with its rollout on hf and on vLLM", "",
             f"`python -m benchmarks.rollout_engine_default_job --seeds {' '.join(map(str, res['seeds']))}` at "
             f"{res['revision']}: examples/runs/default.yaml (SmolLM2-135M, GRPO, 16 steps of 8 prompts x 8 samples, "
             f"100 held-out prompts, greedy, evaluated through the run's own engine), precision auto. Machine: "
             f"{m['model']} ({', '.join(m['flags'])}), {m['cpus']} cores, torch {m['torch']}; one run at a time. "
             "Step times: the median over steps 2-16. Mismatch: vLLM's log-probs against the trainer's old "
             "log-probs of the same tokens, mean over the run's steps (max: the largest of any step).", "",
             "| variant | seed | before | after | gained / lost | p | step s | rollout s | weight sync s | "
             "mean abs dlogp | max abs dlogp | KL k3 | ratio outside [0.5, 2] | IS weights truncated |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, runs in res["variants"].items():
        for seed, r in zip(res["seeds_of"][name], runs):
            lines.append(f"| {name} | {seed} | {r['before']:.2f} | {r['after']:.2f} | {r['gained']} / {r['lost']} | "
                         f"{r['p']:.1e} | {f(r['step_s'], '.2f')} | {f(r['gen_s'], '.2f')} | "
                         f"{f(r['weight_sync_s'], '.3f')} | {f(r['mismatch_abs_mean'], '.2e')} | "
                         f"{f(r['mismatch_abs_max'], '.2e')} | {f(r['mismatch_kl_k3'], '.1e')} | "
                         f"{f(r['ratio_out_frac'], '.1e')} | {f(r['is_clipped_frac'], '.1e')} |")
    lines += ["", "| variant | seeds | held-out after: mean (min-max) | gained: mean (min-max) | step s (mean) |",
              "|---|---|---|---|---:|"]
    for name, runs in res["variants"].items():
        after = [r["after"] for r in runs]
        gain = [r["after"] - r["before"] for r in runs]
        lines.append(f"| {name} | {', '.join(map(str, res['seeds_of'][name]))} | {statistics.mean(after):.3f} "
                     f"({min(after):.2f}-{max(after):.2f}) | {statistics.mean(gain):+.3f} ({min(gain):+.2f}-"
                     f"{max(gain):+.2f}) | {statistics.mean(r['step_s'] for r in runs):.2f} |")
    base = dict(zip(res["seeds_of"].get("hf", []), res["variants"].get("hf", [])))
    for name, runs in res["variants"].items():
        pairs = [(r["after"] - r["before"]) - (base[seed]["after"] - base[seed]["before"])
                 for seed, r in zip(res["seeds_of"][name], runs) if name != "hf" and seed in base]
        if len(pairs) >= 2:
            se = statistics.stdev(pairs) / len(pairs) ** 0.5
            lines.append(f"\n{name} against hf, seed by seed: held-out gain {statistics.mean(pairs):+.3f} "
                         f"(standard error {se:.3f}, {len(pairs)} seeds; per seed "
                         f"{', '.join(f'{d:+.2f}' for d in pairs)}).")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--runs", default="runs/rollout_engines")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    runs = pathlib.Path(args.runs)
    for name in args.variants:
        for seed in args.seeds:
            run(name, seed, runs)
    # every variant's runs that exist for these seeds (a variant not asked for keeps the seeds it was run with)
    done = {name: [seed for seed in args.seeds if (out_dir(name, seed, runs) / "summary.json").exists()]
            for name in VARIANTS}
    res = {"machine": machine(), "revision": revision(), "when": utc_now(), "seeds": args.seeds,
           "seeds_of": {name: seeds for name, seeds in done.items() if seeds},
           "variants": {name: [summarize(out_dir(name, seed, runs)) for seed in seeds]
                        for name, seeds in done.items() if seeds}}
    path = write_results(args.out, "rollout_engine_default_job", res, page(res))
    print(open(path + ".md").read())


if __name__ == "__main__":
    main()
