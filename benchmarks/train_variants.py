"""Variants of the default job (SmolLM2-135M, GRPO, 8 prompts x 8 responses) side by side: LoRA and activation
checkpointing against full fine-tuning (peak memory, step time; results/lora_vs_full.md, checkpointing_vs_full.md),
and the algorithm presets grpo, gspo, dr_grpo, rloo, dapo, reinforce_pp, cispo (held-out accuracy and step time;
algorithms_default_job.md).

Each variant trains in a fresh child process (`hetrl.train`), rounds interleaved (full, lora, full, lora, ...), or
with --parallel the variants of a round at the same time (equal CPU shares: their step times compare with each other,
not with runs alone). Memory: the process's peak RSS while the run trains (evaluation, steps and the final
checkpoint), with the peak reset (/proc/self/clear_refs) after the model is loaded, so loading the GGUF file does not
hide the difference; also the whole process's peak. Step time: the mean `step_s` of metrics.jsonl over steps 2..
(step 1 warms up). Held-out: the run's summary.json (accuracy before/after on the default 100 problems, gained/lost,
sign test); the memory variants evaluate 8 problems only, to finish the run. The machine and how it was shared are
written with the results.

    python -m benchmarks.train_variants --variants full lora --name lora_vs_full --out benchmarks/results
    python -m benchmarks.train_variants --variants full checkpointing --name checkpointing_vs_full --out ...
    (about 15 minutes each on 2 cores)
    python -m benchmarks.train_variants --variants grpo gspo dr_grpo rloo --steps 16 --seeds 0 1 2 --parallel \
        --work runs/algorithms --name algorithms_default_job --out benchmarks/results

`--set KEY=VALUE ...` adds run settings to every variant (`--set precision=fp32`: the comparison at fp32 on a
machine where `precision=auto` is bf16-mixed); the page states them, and a finished run in `--work` made with other
settings is refused rather than read. `--seeds S ...` makes each round one seed (`seed=S` for every variant of it),
for the held-out comparisons that need several; `--work DIR` keeps every run's directory there and reads a run that
already finished (summary.json) instead of running it again, so a long comparison cut short continues where it
stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from hetrl.bench.harness import machine, timed, write_results
from hetrl.trainer.evaluation import paired_comparison, paired_scores

VARIANTS = {
    "full": [],
    "lora": ["lora_rank=16", "lora_alpha=32", "lr=2e-4"],   # all-linear: every Linear but the LM head
    "checkpointing": ["gradient_checkpointing=1"],
    # the algorithm runs keep the default held-out evaluation (100 problems): its accuracy is what they compare
    "grpo": [],                                            # the default job (= full), named for the algorithm runs
    "gspo": ["algorithm=gspo"],
    "dr_grpo": ["algorithm=dr_grpo"],
    "rloo": ["algorithm=rloo"],
    "dapo": ["algorithm=dapo"],
    "reinforce_pp": ["algorithm=reinforce_pp"],
    "cispo": ["algorithm=cispo"],
}
SHORT_EVAL = {"full", "lora", "checkpointing"}   # memory and time only: 8 held-out problems, just to finish the run

CHILD = r"""
import json, sys
import hetrl
from hetrl.bench.harness import reset_peak_rss, status_kb
from hetrl.trainer import loop

def peak_kib():
    return status_kb("VmHWM")

marks = {}
run = loop.run_steps
def measured_run(*args, **kwargs):
    marks["after_load_kib"] = peak_kib()
    reset_peak_rss()                               # from here on, the training run alone
    return run(*args, **kwargs)
loop.run_steps = measured_run
out_dir, steps, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
fields = dict(kv.split("=", 1) for kv in overrides)
def value(v):
    try:
        return float(v) if "." in v or "e-" in v else int(v)
    except ValueError:
        return v                                   # a name (algorithm=gspo)
fields = {k: value(v) for k, v in fields.items()}
fields = {k: bool(v) if k == "gradient_checkpointing" else v for k, v in fields.items()}
hetrl.train(None, out_dir=out_dir, steps=steps, checkpoint_every=0, **fields)
marks["train_peak_kib"] = peak_kib()
import resource
marks["process_peak_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print("MARKS " + json.dumps(marks))
"""


def run_round(names: list[str], steps: int, work: pathlib.Path, round_: int, parallel: bool,
              eval_size: int | None = None, seed: int | None = None, extra: tuple[str, ...] = ()) -> list[dict]:
    """One child per variant, one after another or (`parallel`) all at once, each with an equal share of the CPU
    (only the variants still to run: a finished one in `work` is read)."""
    def one(name):
        return run_variant(name, steps, work, round_, eval_size, seed, extra)
    if not parallel:
        return [one(name) for name in names]
    with ThreadPoolExecutor(len(names)) as pool:
        return list(pool.map(one, names))


def run_variant(name: str, steps: int, work: pathlib.Path, round_: int, eval_size: int | None = None,
                seed: int | None = None, extra: tuple[str, ...] = ()) -> dict:
    """`eval_size`: held-out problems (None: 8 for the memory variants, the run's default for the algorithms);
    `seed`: the run's seed (None: the default); `extra`: KEY=VALUE settings added to the variant's. A run that
    finished in `work` before (summary.json, and the marks its child wrote) is read, not run again, if it was made
    with the same settings (else refused); one cut short starts over."""
    out = work / (f"{name}-{round_}" if seed is None else f"{name}-s{seed}")
    marks_file = out / "variant_marks.json"
    if (out / "summary.json").is_file() and marks_file.is_file():
        done = json.loads(marks_file.read_text())
        if done.get("extra", []) != list(extra):
            raise SystemExit(f"{out} was made with --set {' '.join(done.get('extra', [])) or '(nothing)'}, not "
                             f"{' '.join(extra) or '(nothing)'}: give another --work")
        return row_from_run(name, round_, out, done["wall_s"], done["marks"], seed)
    shutil.rmtree(out, ignore_errors=True)
    if eval_size is None and name in SHORT_EVAL:
        eval_size = 8
    evals = [] if eval_size is None else [f"eval_size={eval_size}"]
    seeds = [] if seed is None else [f"seed={seed}"]
    proc, wall_s = timed(lambda: subprocess.run([sys.executable, "-c", CHILD, str(out), str(steps), *evals, *seeds,
                                                 *VARIANTS[name], *extra],
                                                capture_output=True, text=True))
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    marks = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("MARKS "))[6:])
    marks_file.write_text(json.dumps({"wall_s": wall_s, "marks": marks, "extra": list(extra)}))
    return row_from_run(name, round_, out, wall_s, marks, seed)


def row_from_run(name: str, round_: int, out: pathlib.Path, wall_s: float | None, marks: dict | None,
                 seed: int | None = None) -> dict:
    """One table row from a run's directory (metrics.jsonl, summary.json) and the child's memory marks (None: not
    recorded; the memory columns are left out)."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    score = summary["paired_on"]   # held-out accuracy (or the mean reward where there is no accuracy)
    memory = {} if marks is None else {
        "train_peak_mib": marks["train_peak_kib"] / 1024, "process_peak_mib": marks["process_peak_kib"] / 1024,
        "after_load_mib": marks["after_load_kib"] / 1024,
        "checkpoint_mib": sum(f.stat().st_size for f in pathlib.Path(summary["checkpoint"]).iterdir()) / 2**20}
    final = out / f"eval_step_{summary['steps']}.jsonl"   # each held-out problem's final score, for paired tests
    per_problem = paired_scores([json.loads(x) for x in final.read_text().splitlines()]) if final.is_file() else None
    return {"variant": name, "round": round_, "seed": seed, "wall_s": wall_s, "eval_score": score,
            "precision": summary.get("precision"), "final_per_problem": per_problem,
            "eval_before": summary[f"eval_{score}_before"], "eval_after": summary[f"eval_{score}_after"],
            "gained": summary["gained"], "lost": summary["lost"], "sign_test_p": summary["sign_test_p"],
            "eval_problems": summary["eval_problems"],
            "groups_sampled": sum(r.get("groups_sampled", 0) for r in rows),   # what the run paid for in rollouts
            "sample_tokens": sum(r.get("sample_tokens", 0) for r in rows),
            "step_s_mean": statistics.mean(r["step_s"] for r in rows[1:]),
            "update_s_mean": statistics.mean(r["update_s"] for r in rows[1:]),
            "logprob_s_mean": statistics.mean(r["logprob_s"] for r in rows[1:]),
            "gen_s_mean": statistics.mean(r["gen_s"] for r in rows[1:]), **memory}


def paired_with_base(rows: list[dict], base: str, others: list[str], seeds) -> list[str]:
    """Each variant against the base on the same held-out problems (a seed draws the same problems for every
    variant): problems only it solved, problems only the base solved, and the exact sign test on those, pooled over
    the seeds (runs without per-problem scores, or whose problems differ in number, are left out)."""
    by = {(r["variant"], r["seed"] if seeds else r["round"]): r.get("final_per_problem") for r in rows}
    out = []
    for v in others:
        mine, theirs, runs = [], [], 0
        for (name, key), scores in by.items():
            base_scores = by.get((base, key))
            if name == v and scores and base_scores and len(scores) == len(base_scores):
                mine, theirs, runs = mine + scores, theirs + base_scores, runs + 1
        if runs:
            c = paired_comparison(theirs, mine)
            out.append(f"| {v} | {runs} | {len(mine)} | {c['gained']} | {c['lost']} | {c['sign_test_p']:.2g} |")
    if not out:
        return []
    return ["", f"Each variant against {base} after training, problem by problem on the same held-out problems "
            f"(pooled over the {'seeds' if seeds else 'rounds'}): solved by it and not by {base}, the reverse, and "
            "the exact sign test on those (small p: more than evaluation noise):", "",
            f"| variant | runs paired | problems | only it | only {base} | sign-test p |",
            "|---|---:|---:|---:|---:|---:|", *out]


def markdown(result: dict) -> str:
    rows, names = result["rows"], result["variants"]
    keys = [k for k in ("train_peak_mib", "process_peak_mib", "step_s_mean", "update_s_mean", "logprob_s_mean",
                        "gen_s_mean", "checkpoint_mib") if all(k in r for r in rows)]
    med = {v: {k: statistics.median(r[k] for r in rows if r["variant"] == v) for k in keys} for v in names}
    base, others = names[0], names[1:]
    eval_flag = f" --eval-size {result['eval_size']}" if result.get("eval_size") else ""
    set_flag = f" --set {' '.join(result['extra'])}" if result.get("extra") else ""
    how_precision = ("set by --set" if any(kv.startswith("precision=") for kv in result.get("extra") or ())
                     else "`precision=auto` on this machine")
    seeds = result.get("seeds")
    rounds_flag = f"--seeds {' '.join(map(str, seeds))}" if seeds else f"--rounds {result['rounds']}"
    rounds_said = (f"seeds {', '.join(map(str, seeds))} (one round each)" if seeds else
                   f"{result['rounds']} {'round' if result['rounds'] == 1 else 'interleaved rounds'}")
    lines = [
        f"# {' and '.join(others)} vs {base} on the default job",
        "",
        f"Made by `python -m benchmarks.train_variants --variants {' '.join(names)} --steps {result['steps']} "
        f"{rounds_flag}{' --parallel' if result.get('parallel') else ''}"
        f"{eval_flag}{set_flag}"
        f"{' --work ' + result['work'] if result.get('work') else ''} --name {result['name']} --out "
        f"benchmarks/results` on {result['machine']}; {result['steps']} steps per run (steps 2.. timed), "
        f"{rounds_said}"
        f"{' (the variants of a round at the same time)' if result.get('parallel') else ''}, medians. "
        f"{result['conditions']}"
        + (f" Precision ({how_precision}): {', '.join(sorted(precisions))}."
           if (precisions := {r["precision"] for r in rows if r.get("precision")}) else ""),
        "",
        *[f"- {v}: {' '.join(VARIANTS[v]) or 'the default run settings'}" for v in names],
        *([f"- every variant also: {' '.join(result['extra'])}"] if result.get("extra") else []),
        "",
        f"| | {' | '.join(names)} | {' | '.join(f'{v} / {base}' for v in others)} |",
        "|---|" + "---:|" * (2 * len(names) - 1),
    ]
    for key, label in [("train_peak_mib", "peak RSS while training (MiB)"),
                       ("process_peak_mib", "peak RSS of the process, model loading included (MiB)"),
                       ("step_s_mean", "seconds per step"), ("update_s_mean", "  of which the update"),
                       ("logprob_s_mean", "  old + reference log-probs"), ("gen_s_mean", "  generation"),
                       ("checkpoint_mib", "checkpoint size (MiB)")]:
        if key not in keys:
            continue
        lines.append(f"| {label} | " + " | ".join(f"{med[v][key]:.1f}" for v in names) + " | "
                     + " | ".join(f"{med[v][key] / med[base][key]:.2f}" for v in others) + " |")
    if all(v not in SHORT_EVAL for v in names):   # runs with the default held-out evaluation: its paired result
        lines += ["", f"Held-out {rows[0]['eval_score']} on the same {rows[0]['eval_problems']} problems before and "
                  "after (greedy), the problems gained / lost and the exact sign test on them, per run:", "",
                  f"| variant | {'seed' if seeds else 'round'} | before | after | gained | lost | sign-test p "
                  "| s/step |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['variant']} | {r['seed'] if seeds else r['round']} | {r['eval_before']:.2f} | "
                  f"{r['eval_after']:.2f} | {r['gained']} | {r['lost']} | {r['sign_test_p']:.2g} | "
                  f"{r['step_s_mean']:.1f} |" for r in rows]
        if len(rows) > len(names):   # several runs per variant: the spread a user can expect
            lines += ["", "Per variant over its runs: held-out after, mean (min-max), the gain over before, and what "
                      "a run sampled (groups of responses, and their tokens; DAPO's dynamic sampling draws more):", "",
                      "| variant | runs | after: mean (min-max) | gain: mean (min-max) | groups sampled | sampled "
                      "tokens |", "|---|---:|---|---|---:|---:|"]
            for v in names:
                mine = [r for r in rows if r["variant"] == v]
                after = [r["eval_after"] for r in mine]
                gain = [r["eval_after"] - r["eval_before"] for r in mine]
                lines.append(f"| {v} | {len(after)} | {statistics.mean(after):.3f} ({min(after):.2f}-{max(after):.2f}) "
                             f"| {statistics.mean(gain):+.3f} ({min(gain):+.2f}-{max(gain):+.2f}) | "
                             f"{statistics.mean(r.get('groups_sampled', 0) for r in mine):.0f} | "
                             f"{statistics.mean(r.get('sample_tokens', 0) for r in mine):,.0f} |")
        lines += paired_with_base(rows, base, others, seeds)
    if "train_peak_mib" not in keys:
        return "\n".join(lines) + "\n"
    lines += ["", "Every run:", "", "| variant | round | s/step | update s | peak RSS training MiB | process MiB |",
              "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['variant']} | {r['round']} | {r['step_s_mean']:.2f} | {r['update_s_mean']:.2f} | "
              f"{r['train_peak_mib']:.0f} | {r['process_peak_mib']:.0f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+",
                        help="one round per seed, every variant run with seed=S (replaces --rounds)")
    parser.add_argument("--work", help="keep the runs' directories here; a run that finished there is read, not "
                        "run again (default: a temporary directory)")
    parser.add_argument("--variants", nargs="+", default=["full", "lora"], choices=sorted(VARIANTS),
                        help="the first is the baseline the others are divided by")
    parser.add_argument("--name", default="lora_vs_full", help="results file name (NAME.json, NAME.md)")
    parser.add_argument("--out", help="directory for NAME.json and NAME.md")
    parser.add_argument("--eval-size", type=int, help="held-out problems per evaluation (default: 8 for full, "
                        "lora and checkpointing, which measure memory and time; the run's default for the algorithms)")
    parser.add_argument("--parallel", action="store_true",
                        help="run each round's variants at the same time (equal CPU shares; step times comparable "
                             "to each other, not to runs alone)")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", dest="extra",
                        help="run settings added to every variant (e.g. precision=fp32)")
    parser.add_argument("--conditions", default="The machine was otherwise idle.",
                        help="how the CPU was shared while this ran (written with the results)")
    args = parser.parse_args()
    bad = [kv for kv in args.extra if "=" not in kv or not kv.split("=", 1)[0]]
    if bad:
        parser.error(f"--set takes KEY=VALUE, got {' '.join(bad)}")
    host = machine()
    seeds = args.seeds or [None] * args.rounds
    result = {"machine": f"{host['model']}, {host['cpus']} cores, Python {host['python']}", "steps": args.steps,
              "rounds": len(seeds), "seeds": args.seeds, "conditions": args.conditions, "work": args.work,
              "parallel": args.parallel, "eval_size": args.eval_size, "variants": args.variants, "name": args.name,
              "extra": args.extra, "rows": []}
    with contextlib.ExitStack() as stack:
        work = args.work or stack.enter_context(tempfile.TemporaryDirectory(prefix="hetrl-variants-"))
        pathlib.Path(work).mkdir(parents=True, exist_ok=True)
        for round_, seed in enumerate(seeds):
            for row in run_round(args.variants, args.steps, pathlib.Path(work), round_, args.parallel,
                                 args.eval_size, seed, tuple(args.extra)):
                print(json.dumps(row), flush=True)
                result["rows"].append(row)
    text = markdown(result)
    print(text)
    if args.out:
        write_results(args.out, args.name, result, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
