"""Why `precision=auto` is bf16-mixed on CPUs with bf16 instructions (issue #17: only where it is faster with no loss
of held-out accuracy): fp32 against bf16-mixed on the default job over seeds, from finished `hetrl train` runs;
result: benchmarks/results/precision_seeds.md.

    python -m benchmarks.studies.precision_seeds --fp32 RUN_DIR... --bf16 RUN_DIR...
        [--out benchmarks/results/precision_seeds]

Each RUN_DIR is a finished run's out_dir (summary.json, metrics.jsonl, run_config.yaml), e.g. from
`hetrl train precision=bf16-mixed seed=1 out_dir=...` or `hetrl bench train`'s work directory. The precision a run
computed in is checked against the side it is given on: its summary's `precision` where the run wrote one, else its
config (`auto` then meant fp32 on a CPU). Step times: each run's median over its steps after the first.
Writes OUT.json (every run's numbers, per step) and OUT.md; runs nothing itself.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

from hetrl.bench.harness import write_results

PHASES = ("gen_s", "logprob_s", "update_s", "step_s")


def read_run(run_dir: pathlib.Path, side: str) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    cfg = summary["config"]
    ran = summary.get("precision") or {"auto": "fp32", "fp32": "fp32", "bf16-mixed": "bf16-mixed"}[cfg["precision"]]
    if ran != side:
        sys.exit(f"{run_dir}: this run computed in {ran}, not {side}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "step" in r and "step_s" in r]
    later = steps[1:] or steps
    return {"run_dir": str(run_dir), "precision": ran, "seed": cfg["seed"], "steps": len(steps),
            "eval_accuracy_before": summary["eval_accuracy_before"],
            "eval_accuracy_after": summary["eval_accuracy_after"],
            "gained": summary["gained"], "lost": summary["lost"], "sign_test_p": summary["sign_test_p"],
            "median_s": {k: statistics.median(r[k] for r in later) for k in PHASES if all(k in r for r in later)},
            "per_step_s": [{k: r[k] for k in ("step", *PHASES) if k in r} for r in steps]}


def side_summary(runs: list[dict]) -> dict:
    acc = [r["eval_accuracy_after"] for r in runs]
    return {"seeds": [r["seed"] for r in runs], "accuracy_after_mean": statistics.mean(acc),
            "accuracy_after_min": min(acc), "accuracy_after_max": max(acc),
            "median_s_mean": {k: statistics.mean(r["median_s"][k] for r in runs)
                              for k in PHASES if all(k in r["median_s"] for r in runs)}}


def markdown(result: dict) -> str:
    fp32, bf16 = result["sides"]["fp32"], result["sides"]["bf16-mixed"]
    lines = ["# The default job at fp32 and at bf16-mixed, over seeds", "",
             f"`python -m benchmarks.studies.precision_seeds` over finished `hetrl train` runs of the default job "
             f"(SmolLM2-135M, GRPO, 16 steps of 8 prompts x 8 samples, 100 held-out prompts, greedy; each precision "
             f"evaluates in its own precision). {result['machine']} Step times: each run's median over its steps "
             "after the first; the side's figure is the mean over its seeds.", "",
             "| precision | seed | held-out before | after | gained / lost | sign-test p | rollout s | log-probs s "
             "| update s | step s |", "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in result["runs"]:
        m = r["median_s"]
        lines.append(f"| {r['precision']} | {r['seed']} | {r['eval_accuracy_before']:.2f} | "
                     f"{r['eval_accuracy_after']:.2f} "
                     f"| {r['gained']} / {r['lost']} | {r['sign_test_p']:.1e} | {m.get('gen_s', float('nan')):.2f} "
                     f"| {m['logprob_s']:.2f} | {m['update_s']:.2f} | {m['step_s']:.2f} |")
    lines += ["", "| precision | seeds | held-out after: mean (min-max) | step s (mean) |", "|---|---|---|---:|"]
    for name, s in (("fp32", fp32), ("bf16-mixed", bf16)):
        lines.append(f"| {name} | {', '.join(map(str, s['seeds']))} | {s['accuracy_after_mean']:.3f} "
                     f"({s['accuracy_after_min']:.2f}-{s['accuracy_after_max']:.2f}) | "
                     f"{s['median_s_mean']['step_s']:.2f} |")
    ratio = bf16["median_s_mean"]["step_s"] / fp32["median_s_mean"]["step_s"]
    diff = bf16["accuracy_after_mean"] - fp32["accuracy_after_mean"]
    lines += ["", f"bf16-mixed / fp32 step time: **{ratio:.2f}x**; held-out accuracy after, bf16-mixed minus fp32: "
              f"**{diff:+.3f}** (the larger spread, max - min, is "
              f"{max(s['accuracy_after_max'] - s['accuracy_after_min'] for s in (fp32, bf16)):.2f})."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp32", nargs="+", required=True, type=pathlib.Path)
    ap.add_argument("--bf16", nargs="+", required=True, type=pathlib.Path)
    ap.add_argument("--machine", default="", help="one sentence on the machine and how its CPU was shared")
    ap.add_argument("--out", default="benchmarks/results/precision_seeds")
    args = ap.parse_args(argv)
    runs = [read_run(d, "fp32") for d in args.fp32] + [read_run(d, "bf16-mixed") for d in args.bf16]
    result = {"machine": args.machine, "runs": runs,
              "sides": {p: side_summary([r for r in runs if r["precision"] == p]) for p in ("fp32", "bf16-mixed")}}
    out = pathlib.Path(args.out)
    write_results(out.parent, out.name, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
