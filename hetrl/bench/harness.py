"""The one harness every benchmark uses (`hetrl bench ...` and benchmarks/): timing, the machine, the results files.

Timing: warm-up calls, then rounds in which every variant runs once in turn, so a machine whose speed drifts
(a shared VM) slows every variant alike; reported as the median with the spread (min, max). The machine: CPU
model and the vector flags that decide bf16's speed, cores, threads, torch, and, where a result needs them, its
measured matmul peaks and copy bandwidth. Memory: a step's peak RSS increase, in a fresh process per variant.
Results: NAME.json (every number) and NAME.md (the table a reader opens) in one folder, indexed in
benchmarks/README.md. A benchmark script is then the experiment, not its plumbing.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
from tqdm import tqdm

# ------------------------------------------------------------------------------------------------------- timing


def seconds(fn: Callable[[], object], device: torch.device | str | None = None) -> float:
    """Wall seconds of one call of `fn`; on a CUDA device, CUDA events around it (the kernels' time, synchronised)."""
    if device is not None and torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    """What one call of `fn` returns, and its wall seconds (for passes that feed the next one)."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def interleaved_times(fns: dict[str, Callable[[], object]], rounds: int, warmup: int = 1, desc: str | None = None,
                      device: torch.device | str | None = None) -> dict[str, list[float]]:
    """Seconds of each fn in each of `rounds` rounds, the fns taking turns within a round, after `warmup` untimed
    rounds of the same order (a progress bar named `desc`, when given)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in tqdm(range(rounds), desc=desc, unit="round", disable=desc is None):
        for name, fn in fns.items():
            times[name].append(seconds(fn, device))
    return times


def calls_per_s(fn: Callable[[], object], duration_s: float, warmup: int = 1) -> float:
    """How many calls of `fn` run per second, over about `duration_s` of back-to-back calls after `warmup` calls (a
    throughput probe: a matmul's peak, a copy's bandwidth)."""
    for _ in range(warmup):
        fn()
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < duration_s:
        fn()
        calls += 1
    return calls / (time.perf_counter() - t0)


def spread(times: list[float]) -> dict[str, float]:
    """The median of `times` and their spread: {"median_s", "min_s", "max_s"}."""
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def median_times(fns: dict[str, Callable[[], object]], repeats: int, desc: str | None = None) -> dict[str, float]:
    """One warm-up call of each fn, then `repeats` interleaved rounds; the median seconds per fn."""
    return {name: statistics.median(ts) for name, ts in interleaved_times(fns, repeats, 1, desc).items()}


# ------------------------------------------------------------------------------------------------------- memory
# Peak RSS, because tracemalloc cannot see torch's allocations; a fresh process per variant, because a process's
# peak is its own (so `jobs` children side by side change only the wall time). Linux: /proc/self/{status,clear_refs}.


def status_kb(field: str) -> int:
    """A size field of /proc/self/status in kB: "VmRSS" (resident now), "VmHWM" (the peak since the last reset)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> int:
    """Reset this process's peak (VmHWM) to its current RSS (Linux >= 4.0); -> that RSS in kB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_kb("VmRSS")


def peak_rss_increase(fn: Callable[[], object]) -> dict[str, int]:
    """One call of `fn`: {"resident_kb" before it, "peak_kb" during it, "increase_kb" = peak - resident}."""
    before = reset_peak_rss()
    fn()
    peak = status_kb("VmHWM")
    return {"resident_kb": before, "peak_kb": peak, "increase_kb": peak - before}


def child_results(args: dict[str, list[str]], jobs: int = 1) -> dict[str, dict]:
    """Run `python ARGS...` for each variant, `jobs` at once, with torch's thread count of this process (as in the
    timed runs); -> each child's last stdout line that is a JSON object, or {"error": the end of its stderr}."""
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    out = {}
    with ThreadPoolExecutor(jobs) as pool:
        runs = {v: pool.submit(subprocess.run, [sys.executable, *a], capture_output=True, text=True, env=env)
                for v, a in args.items()}
        for v, future in runs.items():
            proc = future.result()
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            out[v] = json.loads(lines[-1]) if proc.returncode == 0 and lines else {"error": proc.stderr.strip()[-300:]}
    return out


# ------------------------------------------------------------------------------------------------------ machine


def machine() -> dict:
    """What the numbers were measured on: the CPU model, the vector flags that decide fp32 and bf16 speed, cores,
    torch's threads, the torch and Python versions, the platform and the GPU (None without CUDA)."""
    model, flags = platform.processor(), set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
    return {"model": model or platform.machine(), "flags": [f for f in wanted if f in flags], "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def matmul_gflops(dtype: torch.dtype, n: int = 1024, duration_s: float = 3.0) -> float:
    """GFLOP/s of an n x n x n matmul in `dtype` on torch's threads, over about `duration_s` after one warm-up call."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 * calls_per_s(lambda: a @ b, duration_s) / 1e9


def copy_bytes_per_s(device: str = "cpu", nbytes: int = 1 << 30, rounds: int = 10) -> float:
    """Bytes per second a large copy moves on `device`, counting bytes read plus bytes written (the memory
    bandwidth a memory-bound pass such as a decode step can reach), median of `rounds` after one warm-up. Random
    data, not zeros."""
    dev = torch.device(device)
    a = torch.randn(nbytes // 4, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    times = interleaved_times({"copy": lambda: b.copy_(a)}, rounds, warmup=0, device=dev)["copy"]
    return 2 * a.numel() * 4 / statistics.median(times)


def revision() -> str | None:
    """The git commit the code runs from (with `+dirty` when the package's files differ from it; results
    written meanwhile do not count), or None outside git."""
    root = pathlib.Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "hetrl"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def utc_now() -> str:
    """The date and minute a result was made, as results pages write it."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


# ------------------------------------------------------------------------------------------------------ results


def _write(path: str, body: str) -> None:
    """Through a temporary name, so a reader never sees half a file."""
    with open(path + ".tmp", "w") as f:
        f.write(body)
    os.replace(path + ".tmp", path)


def write_json(path: str | os.PathLike, res: dict, indent: int = 2) -> None:
    """Every number of a result, for a results page written by hand beside it."""
    _write(os.fspath(path), json.dumps(res, indent=indent))


def write_page(path: str | os.PathLike, text: str) -> None:
    """A results page of a study whose numbers live in another result's JSON."""
    _write(os.fspath(path), text if text.endswith("\n") else text + "\n")


def write_results(out: str | os.PathLike, name: str, res: dict, text: str, indent: int = 2) -> str:
    """Write `res` to out/NAME.json and `text` (the table a reader opens) to out/NAME.md; -> out/NAME."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    write_json(path + ".json", res, indent)
    write_page(path + ".md", text)
    return path
