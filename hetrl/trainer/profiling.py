"""`profile_step=N`: training step N under torch.profiler, written beside the metrics.

Where a step's time goes on the device it ran on: `out_dir/profile_step_N.txt` (torch's operator table, the 40
operators with the most self time on the device where there is one, else on the CPU) and `profile_step_N.json` (the
step's wall seconds, the device's busy seconds as the sum of every operator's self device time, the host's, and
the top operators as rows a user can plot). The profiled step's row in metrics.jsonl says `"profiled": true`: the
profiler's own overhead is in its times, so benchmarks leave it out of their medians. Local executor only: on Ray
the step's work runs in other processes, which this process's profiler does not see.

A thin wrapper over torch.profiler (its tables and trace are the tool; this only decides what is written where).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import time

import torch

TOP = 40


def _device_s(event) -> float:
    return getattr(event, "self_device_time_total", 0.0) / 1e6


@contextlib.contextmanager
def profiled(step: int, cfg, run_dir: pathlib.Path):
    """Run the body under torch.profiler when `step` is the run's `profile_step` (else plainly); -> yields whether
    it did."""
    if step != cfg.profile_step:
        yield False
        return
    from torch.profiler import ProfilerActivity, profile

    from hetrl.trainer.precision import driver_device

    cuda = driver_device(cfg).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        yield True
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    write(prof.key_averages(), step, wall, cuda, run_dir)


def write(averages, step: int, wall_s: float, on_device: bool, run_dir: pathlib.Path) -> dict:
    """The operator table and its summary for `step` under run_dir; -> the summary."""
    key = "self_device_time_total" if on_device else "self_cpu_time_total"
    ranked = sorted(averages, key=lambda e: getattr(e, key, 0.0), reverse=True)
    summary = {
        "step": step, "wall_s": wall_s, "on_device": on_device,
        "device_busy_s": sum(_device_s(e) for e in averages) if on_device else None,
        "host_s": sum(e.self_cpu_time_total for e in averages) / 1e6,
        "top": [{"name": e.key, "calls": e.count, "self_cpu_s": e.self_cpu_time_total / 1e6,
                 **({"self_device_s": _device_s(e)} if on_device else {})} for e in ranked[:TOP]],
    }
    run_dir = pathlib.Path(run_dir)
    (run_dir / f"profile_step_{step}.txt").write_text(averages.table(sort_by=key, row_limit=TOP))
    (run_dir / f"profile_step_{step}.json").write_text(json.dumps(summary, indent=1))
    return summary
