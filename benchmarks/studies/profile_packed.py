"""Why `packed` (verl's layout) slows down faster than its FLOPs grow at P=2048, R=64 on CPU; result:
benchmarks/results/dualkv_cpu_packed_profile.md.

Runs one update step of the bench's `packed` variant at N responses (after a warm-up step) and reports its
wall, user and system CPU seconds and page faults (getrusage around the step), then torch.profiler's top ops
for a second step.

    python -m benchmarks.studies.profile_packed 8 16 > benchmarks/results/dualkv_cpu_packed_profile.md
"""

import resource
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from hetrl.bench.dualkv_grid import Case, build_model, make_group, update_step, variant_logprobs
from hetrl.bench.harness import machine, seconds


def one(n: int, p: int = 2048, r: int = 64) -> str:
    case = Case("qwen3-shaped", n, p, r)
    model = build_model(case.model)
    prompt, responses = make_group(case, model.config.vocab_size)
    fn, adv = variant_logprobs("packed", model, prompt, responses), torch.ones(n * r)
    update_step(fn, adv)
    model.zero_grad(set_to_none=True)
    before = resource.getrusage(resource.RUSAGE_SELF)
    wall = seconds(lambda: update_step(fn, adv))
    after = resource.getrusage(resource.RUSAGE_SELF)
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        update_step(fn, adv)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40)
    return (f"## N={n}, P={p}, R={r}: {n * (p + r)} packed tokens\n\n"
            f"one update step: wall {wall:.1f} s, user {after.ru_utime - before.ru_utime:.1f} s, "
            f"system {after.ru_stime - before.ru_stime:.1f} s, minor page faults "
            f"{after.ru_minflt - before.ru_minflt:,}\n\n```\n{table}```\n")


if __name__ == "__main__":
    print(f"# `packed` update step profile ({machine()})\n")
    for arg in sys.argv[1:] or ["8", "16"]:
        print(one(int(arg)), flush=True)
