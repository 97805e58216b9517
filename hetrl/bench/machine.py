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
