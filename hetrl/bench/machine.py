"""The machine a benchmark ran on: CPU model and vector flags, threads, and its matmul peaks measured in the run
(what FLOP/s achieved is compared against)."""

from __future__ import annotations

import os
import platform
import time

import torch


def matmul_gflops(dtype: torch.dtype, n: int = 1024, seconds: float = 3.0) -> float:
    """GFLOP/s of an n x n x n matmul in `dtype` on torch's threads, over about `seconds` after one warm-up call."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        calls += 1
    return 2 * n**3 * calls / (time.perf_counter() - t0) / 1e9


def cpu() -> dict:
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
    return {"model": model, "flags": [f for f in wanted if f in flags], "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__}


def copy_bytes_per_s(device: str = "cpu", nbytes: int = 1 << 30, rounds: int = 10) -> float:
    """Bytes per second a large copy moves on `device`, counting bytes read plus bytes written (the memory
    bandwidth a memory-bound pass such as a decode step can reach), median of `rounds` after one warm-up. Random
    data, not zeros."""
    import statistics

    dev = torch.device(device)
    a = torch.randn(nbytes // 4, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(rounds):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        b.copy_(a)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return 2 * a.numel() * 4 / statistics.median(times)
