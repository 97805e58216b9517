"""Which recipe the default job ships (issue 45 item 6): held-out accuracy of candidate recipes over 3 seeds, each
at fp32 and at bf16-mixed, so that a user on any CPU gets the README's result within its spread; result:
benchmarks/results/default_recipe.md.

    python -m benchmarks.studies.default_recipe [--seeds 0 1 2] [--work runs/default_recipe]

Runs `hetrl train` (the default job, plus each recipe's overrides, `precision=`, `seed=`) one at a time in a
subprocess; a run whose summary.json exists is read, not rerun, one cut short continues from its last checkpoint
(`hetrl train --resume`, exact; the default job checkpoints at step 8), and its checkpoints are deleted once it
finishes (3 GB each). Each run's numbers are read as
`benchmarks.studies.precision_seeds` reads them, with the commit and CPU it ran on. Rows already in the results
JSON are kept (`--precisions` runs one side on a machine where it is practical: bf16-mixed wants a CPU with bf16
instructions or a GPU; without them a run takes over an hour), so the two sides can come from two machines. The
chosen recipe is the one with the highest mean held-out accuracy on its worse precision (a user does not choose
the CPU); ties go to the simpler recipe (listed first); none is chosen until every side has its seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys

from benchmarks.studies.precision_seeds import read_run, side_summary
from hetrl.bench.harness import machine, revision, write_results

ROOT = pathlib.Path(__file__).resolve().parents[2]
# name -> (overrides, what it is). Each names its KL coefficient, so the study means the same runs whichever one
# the default job ships. The grpo preset is verl's GRPO (low_var_kl to a frozen reference at kl_coef 0.001,
# seq-mean-token-mean). The alternative drops the KL (and so the reference):
# TRL's GRPOConfig default (beta 0.0) and DAPO's / Dr. GRPO's choice.
RECIPES = {
    "grpo-kl0.001": (["kl_coef=0.001"], "the grpo preset: low_var_kl (k3, clamped) at kl_coef 0.001, lr 2e-5"),
    "grpo-nokl": (["kl_coef=0"], "the grpo preset without the KL term (no reference model), lr 2e-5"),
}
PRECISIONS = ("fp32", "bf16-mixed")


def run_one(work: pathlib.Path, recipe: str, precision: str, seed: int) -> pathlib.Path:
    out = work / f"{recipe}-{precision}-s{seed}"
    if (out / "summary.json").exists():
        return out
    if any((out / "checkpoints").glob("step_*")):   # cut short (a session's end): continue from its last checkpoint
        cmd = [sys.executable, "-m", "hetrl.cli", "train", "--resume", f"out_dir={out}"]
    else:
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, "-m", "hetrl.cli", "train", *RECIPES[recipe][0], f"precision={precision}",
               f"seed={seed}", f"out_dir={out}"]
    print(" ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "HETRL_CPU_BF16": "0"})
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return out


def where(m: dict) -> str:
    return f"{m['model']} ({', '.join(m['flags'])}), {m['cpus']} cores, torch {m['torch']}"


def markdown(res: dict) -> str:
    lines = ["# The default job's recipe, chosen by held-out accuracy over seeds at both precisions", "",
             "`python -m benchmarks.studies.default_recipe`: the default job (SmolLM2-135M, GRPO, 16 steps of 8 "
             "prompts x 8 samples, 100 held-out prompts, greedy; each precision evaluates in its own) with each "
             "recipe's overrides. One run at a time; step times compare only within one CPU and between runs that "
             "had it alone (notes).", "", *[f"- {n}" for n in res.get("notes", [])], "",
             "| recipe | what | overrides |", "|---|---|---|"]
    for name, (over, what) in RECIPES.items():
        lines.append(f"| {name} | {what} | `{' '.join(over) or '(none)'}` |")
    lines += ["", "| recipe | precision | seed | held-out before | after | gained / lost | sign-test p | step s | "
              "commit | CPU |", "|---|---|---:|---:|---:|---|---:|---:|---|---|"]
    for r in res["runs"]:
        lines.append(f"| {r['recipe']} | {r['precision']} | {r['seed']} | {r['eval_accuracy_before']:.2f} | "
                     f"{r['eval_accuracy_after']:.2f} | {r['gained']} / {r['lost']} | {r['sign_test_p']:.1e} | "
                     f"{r['median_s']['step_s']:.2f} | {r['commit']} | {where(r['machine'])} |")
    lines += ["", "| recipe | precision | held-out after: mean (min-max) | step s (mean) |", "|---|---|---|---:|"]
    for name, sides in res["sides"].items():
        for p, s in sides.items():
            if s is None:
                got = [r["eval_accuracy_after"] for r in res["runs"] if r["recipe"] == name and r["precision"] == p]
                lines.append(f"| {name} | {p} | " + (f"{len(got)} of {res.get('seeds_asked', 3)} seeds so far: "
                             + ", ".join(f"{a:.2f}" for a in got) if got else "not run yet") + " | |")
                continue
            lines.append(f"| {name} | {p} | {s['accuracy_after_mean']:.3f} ({s['accuracy_after_min']:.2f}-"
                         f"{s['accuracy_after_max']:.2f}) | {s['median_s_mean']['step_s']:.2f} |")
    if res["chosen"]:
        lines += ["", f"Chosen: **{res['chosen']}** (the highest mean held-out accuracy on its worse precision: "
                  + ", ".join(f"{n} {w:.3f}" for n, w in res["worse_precision_mean"].items()) + ")."]
    else:
        lines += ["", "Not chosen yet: a side has fewer seeds than asked (above)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    ap.add_argument("--work", type=pathlib.Path, default=ROOT / "runs" / "default_recipe")
    ap.add_argument("--out", default="benchmarks/results/default_recipe")
    ap.add_argument("--note", default="", help="a sentence on how the runs went (what else ran, commits)")
    ap.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS),
                    help="the sides to run here (rows of the others already in the results are kept)")
    ap.add_argument("--max-runs", type=int, default=None,
                    help="stop after this many new runs and write what is in hand (a slow machine's share of the "
                         "sweep: bf16-mixed without bf16 instructions takes over an hour a run)")
    args = ap.parse_args(argv)
    out = ROOT / args.out
    prior = json.loads(out.with_suffix(".json").read_text())["runs"] if out.with_suffix(".json").exists() else []
    runs = {(r["recipe"], r["precision"], r["seed"]): r for r in prior}
    todo = [(n, p, s) for n in args.recipes for p in args.precisions for s in args.seeds if (n, p, s) not in runs]
    for recipe, precision, seed in todo[:args.max_runs]:
        at = revision()   # the code the run starts on
        run = read_run(run_one(args.work, recipe, precision, seed), precision)
        runs[(recipe, precision, seed)] = {"recipe": recipe, **run, "commit": at, "machine": machine()}
    rows = sorted(runs.values(), key=lambda r: (list(RECIPES).index(r["recipe"]), PRECISIONS.index(r["precision"]),
                                                 r["seed"]))

    def side(n, p):
        got = [r for r in rows if r["recipe"] == n and r["precision"] == p]
        return side_summary(got) if len(got) >= len(args.seeds) else None
    # every candidate is judged, not only the ones this call ran (--recipes limits what runs, not what competes)
    names = list(RECIPES)
    sides = {n: {p: side(n, p) for p in PRECISIONS} for n in names}
    done = all(s is not None for n in sides for s in sides[n].values())
    worse = {n: min(s["accuracy_after_mean"] for s in sides[n].values()) for n in names} if done else {}
    chosen = max(names, key=lambda n: (worse[n], -names.index(n))) if done else None
    notes = (json.loads(out.with_suffix(".json").read_text()).get("notes", []) if prior else []) + \
        ([args.note] if args.note else [])
    res = {"runs": rows, "sides": sides, "worse_precision_mean": worse, "chosen": chosen, "notes": notes,
           "seeds_asked": len(args.seeds)}
    out = ROOT / args.out
    write_results(out.parent, out.name, res, markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
