"""Why hetrl's CPU training processes keep freed memory (hetrl/trainer/allocator.py): that setting against glibc's
defaults on the `long` case's update pass; result: benchmarks/results/allocator.md.

The pass: SmolLM2-135M fp32, one group of a 505-token prompt and 8 responses of 30-64 tokens,
forward + backward through DualKV, torch's default threads. Each setting runs in its own fresh process (the
setting is per process), alternating, `--processes` of each, `--passes` timed passes after one warm-up; the
report gives every pass, each setting's median and its peak RSS.

    python -m benchmarks.studies.allocator [--processes 3] [--passes 6] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

from hetrl.bench.harness import machine, revision, write_results

ROOT = pathlib.Path(__file__).resolve().parents[1]

WORKER = r"""
import json, resource, sys
import torch
from hetrl.trainer import allocator
kept = allocator.keep_freed_memory() if sys.argv[1] == "kept" else False
from hetrl.models import load_model
from benchmarks.studies.long_case_profile import long_group, update_pass
from hetrl.bench.harness import interleaved_times
model, _ = load_model("smollm2-135m")
model.train()
batch = long_group()
times = interleaved_times({"pass": lambda: update_pass(model, batch)}, int(sys.argv[2]), warmup=1)["pass"]
print(json.dumps({"setting": sys.argv[1], "applied": kept, "threads": torch.get_num_threads(), "pass_s": times,
                  "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--passes", type=int, default=6)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    runs = []
    for _ in range(args.processes):
        for setting in ("kept", "system"):
            out = subprocess.run([sys.executable, "-c", WORKER, setting, str(args.passes)], cwd=ROOT, check=True,
                                 capture_output=True, text=True,
                                 env={**os.environ, "HETRL_MALLOC": "" if setting == "kept" else "system"})
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[-1]), flush=True)
    med = {s: statistics.median(t for r in runs if r["setting"] == s for t in r["pass_s"]) for s in ("kept", "system")}
    rss = {s: max(r["max_rss_mb"] for r in runs if r["setting"] == s) for s in ("kept", "system")}
    result = {"machine": machine(), "revision": revision(), "runs": runs, "median_pass_s": med, "max_rss_mb": rss}
    lines = ["# CPU allocator: freed memory kept in the process vs glibc's defaults", "",
             f"`python -m benchmarks.studies.allocator` at {result['revision']} on {result['machine']['model']}, "
             f"{runs[0]['threads']} torch threads, nothing else running. The `long` case's update pass (SmolLM2-135M "
             "fp32, a 505-token prompt and 8 responses of 30-64 tokens, forward + backward through DualKV); each "
             f"setting in its own fresh process, alternating, {args.processes} processes x {args.passes} passes "
             "after one warm-up. `kept` = hetrl.trainer.allocator (glibc mallopt: no mmap'd chunks, 1 GiB trim "
             "threshold); `system` = glibc's defaults (HETRL_MALLOC=system).", "",
             "| process | setting | pass s | peak RSS MB |", "|---|---|---|---:|"]
    lines += [f"| {i + 1} | {r['setting']} | {', '.join(f'{t:.2f}' for t in r['pass_s'])} | {r['max_rss_mb']:.0f} |"
              for i, r in enumerate(runs)]
    lines += ["", f"Median pass: kept {med['kept']:.2f} s, system {med['system']:.2f} s "
              f"({med['system'] / med['kept']:.2f}x); peak RSS kept {rss['kept']:.0f} MB, "
              f"system {rss['system']:.0f} MB.",
              ""]
    write_results(args.out, "allocator", result, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
