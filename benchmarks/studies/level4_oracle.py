"""How close the planner's per-group rule (Level 4, `space.configure`: a first fit improved by local search) comes to
the best configuration of a group, on random one-node groups small enough to price every combination of their
tasks' options (`space.every_configuration`, the oracle the tests use on a few fixed groups).

    python -m benchmarks.studies.level4_oracle [--groups 200] [--seed 0] [--name level4_oracle] [--rule-from COMMIT]

`--rule-from COMMIT` scores the rule as it was at that commit (its hetrl/planner/space.py, read with `git show`)
against the same oracle, for a before-and-after comparison.

Groups: 1, 2, 4 or 8 GPUs of one type (A10G, L4, L40S over PCIe; A100-40G, A100-80G, H100 over NVLink), one of six
Qwen3 workloads, two or three placement units of it (at most three tasks), drawn with `--seed`. Everything is the
cost model's prediction (no GPU runs); about 10 minutes on 2 cores. Results: benchmarks/results/level4_oracle.md
(and .json; another --name writes NAME.md, as benchmarks/results/level4_oracle_before.md for the rule before
make_room).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time

from tqdm import tqdm

from hetrl.bench.harness import machine, revision, utc_now, write_results
from hetrl.planner import load_workload, space
from hetrl.planner.spec import cluster_from_dict

ROOT = pathlib.Path(__file__).resolve().parents[2]
GPUS = (("A10G", "pcie"), ("L4", "pcie"), ("L40S", "pcie"), ("A100-40G", "nvlink"), ("A100-80G", "nvlink"),
        ("H100", "nvlink"))
WORKLOADS = ("qwen3-4b-grpo-sync", "qwen3-4b-ppo-sync", "qwen3-8b-grpo-sync", "qwen3-8b-ppo-sync",
             "qwen3-14b-grpo-sync", "qwen3-14b-ppo-async")
MAX_TASKS = 3


def cases(n: int, seed: int) -> list[tuple[str, int, str, str, tuple[str, ...]]]:
    """n distinct (gpu, count, link, workload, tasks) groups, drawn in a fixed order."""
    rng, out, seen = random.Random(seed), [], set()
    workloads = {wl: load_workload(str(ROOT / "examples" / "workloads" / f"{wl}.yaml")) for wl in WORKLOADS}
    for _ in range(100 * n):
        if len(out) == n:
            break
        gpu, link = rng.choice(GPUS)
        count, wl = rng.choice((1, 2, 4, 8)), rng.choice(WORKLOADS)
        units = space.units(workloads[wl])
        tasks = tuple(t for u in rng.sample(units, min(rng.choice((2, 2, 3)), len(units))) for t in u)
        key = (gpu, count, link, wl, tuple(sorted(tasks)))
        if len(tasks) <= MAX_TASKS and key not in seen:
            seen.add(key)
            out.append((gpu, count, link, wl, tasks))
    return out


def rule_at(commit: str):
    """`configure` as hetrl/planner/space.py at `commit` defined it (loaded into hetrl.planner, so its relative
    imports resolve to today's cost model)."""
    text = subprocess.run(["git", "show", f"{commit}:hetrl/planner/space.py"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("hetrl.planner._space_then", f.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="level4_oracle")
    ap.add_argument("--rule-from", metavar="COMMIT", help="score the rule of this commit's space.py")
    args = ap.parse_args()
    rule = rule_at(args.rule_from) if args.rule_from else space
    rows, rule_s = [], 0.0
    for gpu, count, link, wl, tasks in tqdm(cases(args.groups, args.seed), desc="groups"):
        cluster = cluster_from_dict({"name": f"{count}x{gpu}", "nodes": [
            {"name": "n0", "region": "r", "gpu": gpu, "count": count, "intra_node": link}]})
        w = load_workload(str(ROOT / "examples" / "workloads" / f"{wl}.yaml"))
        for m in {space, rule}:   # each rule's search timed from cold caches (`configure` was the cached one)
            for name in ("configure", "configurations", "_ranked"):
                if hasattr(f := getattr(m, name, None), "cache_clear"):
                    f.cache_clear()
        t0 = time.perf_counter()
        found = rule.configure(cluster, w, tasks, (count,))
        rule_s += time.perf_counter() - t0
        best = space.every_configuration(cluster, w, tasks, (count,))
        got = space.group_seconds(found) if found else math.inf
        want = space.group_seconds(best) if best else math.inf
        rows.append({"gpus": f"{count}x {gpu}", "workload": wl, "tasks": list(tasks),
                     "rule_s": None if math.isinf(got) else got, "best_s": None if math.isinf(want) else want,
                     "excess": (0.0 if got == want else math.inf if math.isinf(got) else got / want - 1)
                     if math.isfinite(want) else None})
    fits = [r for r in rows if r["best_s"] is not None]
    missed = [r for r in fits if r["excess"] > 1e-9]
    excess = [r["excess"] for r in missed if math.isfinite(r["excess"])]
    summary = {"groups": len(rows), "fit": len(fits), "missed": len(missed),
               "missed_no_configuration": sum(math.isinf(r["excess"]) for r in missed),
               "excess_median": statistics.median(excess) if excess else None,
               "excess_max": max(excess) if excess else None, "rule_seconds_total": rule_s}
    res = {"when": utc_now(), "revision": revision(), "rule_from": args.rule_from, "machine": machine(),
           "seed": args.seed, "summary": summary, "rows": rows}
    command = (f"python -m benchmarks.studies.level4_oracle --groups {args.groups} --seed {args.seed} --name "
               f"{args.name}" + (f" --rule-from {args.rule_from}" if args.rule_from else ""))
    lines = [f"# Level 4: the per-group rule against every configuration ({args.name})", "",
             f"{utc_now()}, revision {revision()}; `{command}`"
             + (f" (the rule as commit {args.rule_from} had it)" if args.rule_from else "")
             + ". Cost-model predictions only (no GPU runs).", "",
             f"- groups: {len(rows)}; a configuration fits in {len(fits)}",
             f"- the rule's configuration is the best in {len(fits) - len(missed)}; missed in {len(missed)}"
             + (f" ({summary['missed_no_configuration']} with no configuration found)"
                if summary["missed_no_configuration"] else ""),
             (f"- where it found a worse one: excess median {100 * summary['excess_median']:.2f}%, max "
              f"{100 * summary['excess_max']:.2f}%" if excess else "- no worse configuration found"),
             f"- the rule's time over all groups (caches cleared per group): {rule_s:.2f} s", "",
             "| GPUs | workload | tasks | rule (s) | best (s) | excess |", "|---|---|---|---:|---:|---:|"]
    for r in missed:
        rule = "none" if r["rule_s"] is None else f"{r['rule_s']:.2f}"
        ex = "no fit found" if math.isinf(r["excess"]) else f"{100 * r['excess']:.2f}%"
        lines.append(f"| {r['gpus']} | {r['workload']} | {', '.join(r['tasks'])} | {rule} | {r['best_s']:.2f} | {ex} |")
    if not missed:
        lines.append("| (none) | | | | | |")
    print(write_results(ROOT / "benchmarks" / "results", args.name, res, "\n".join(lines) + "\n"))


if __name__ == "__main__":
    main()
