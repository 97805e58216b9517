"""A run's precision, decided once (`decide`) where its engine is built, as one frozen value every role carries.

`precision=auto` resolves on the run's device (bf16-mixed on CUDA and on CPUs with bf16 instructions, fp32 on
others), and the weights' dtype says the rest: autocast never casts fp64 values, so a dtype=float64 run is fp64
whatever `precision` says, and dtype=bfloat16 holds bf16 weights. The learner, critic, reference, rollout and the
memory estimate take the value; the planner takes its `planner` name; the run's log line and summary.json its `name`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from dataclasses import dataclass

import torch

from hetrl.schema import InputError

log = logging.getLogger(__name__)

CPU_BF16_ENV = "HETRL_CPU_BF16"   # 1 / 0: say whether the CPU has fast bf16 instead of asking it
NAMES = ("bf16-mixed", "fp32", "fp64", "bf16")


@dataclass(frozen=True)
class RunPrecision:
    """What a run computes in. `name`: bf16-mixed (fp32 master weights, bf16 autocast), fp32, fp64, or bf16 (bf16
    weights); `autocast`: every pass runs under bf16 autocast; `auto`: precision=auto chose it."""

    name: str
    autocast: bool
    auto: bool = False

    def __post_init__(self):
        assert self.name in NAMES, self.name

    @property
    def planner(self) -> str:
        """The planner's name (WorkloadSpec.precision): bf16 for a run under bf16 autocast, whose values the planner
        prices at 2 bytes with fp32 master weights and Adam moments; fp32 otherwise (the planner has no 8-byte
        precision: an fp64 run is priced as fp32)."""
        return "bf16" if self.autocast else "fp32"

    def amp(self, model) -> contextlib.AbstractContextManager:
        """bf16 autocast on `model`'s device where the run autocasts: fp32 weights stay the master copy, the frozen
        reference's bf16 matmul weights are used as they are (build.frozen); else nothing. The log-softmax runs in
        fp32 either way (hetrl.dualkv promotes the logits)."""
        if self.autocast:
            return torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def __str__(self) -> str:
        return self.name + (" (auto)" if self.auto else "")


FP32 = RunPrecision("fp32", autocast=False)   # roles made outside a run (tests, benchmarks) unless told


def device(name: str, check: bool = True) -> torch.device:
    """The device `name` names (RunConfig.device). `auto`: CUDA when torch sees a GPU, else the CPU (logged); an
    explicit device that is not there is an error (`check` off: the device named, wherever this process is, as the
    precision a run would have there is decided)."""
    if name == "auto":
        chosen = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        log.info("device=auto chose %s", chosen)
        return chosen
    if name.startswith("cuda") and check:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(name.partition(":")[2] or 0)
        if index >= count:
            raise InputError(f"device={name}: torch {torch.__version__} sees {count} CUDA device(s) here"
                             + ("" if count else " (a CPU-only build, or no GPU)") + "; use device=cpu or device=auto")
    return torch.device(name)


def driver_device(cfg) -> torch.device:
    """Where the driver computes: a local run's `device`; on Ray the driver only coordinates (the CPU), the actors
    computing on their plan GPUs. A local run on the CPU with impl=flex is refused here, before the model loads:
    its first update would fail, torch having no FlexAttention backward on the CPU."""
    if cfg.executor != "local":
        return torch.device("cpu")
    chosen = device(cfg.device)
    if cfg.impl == "flex" and chosen.type == "cpu":
        said = "" if cfg.device == "cpu" else f" (device={cfg.device} is the CPU here)"
        raise InputError(f"impl=flex cannot train on the CPU{said}: torch has no FlexAttention backward there; use "
                         "impl=auto (sdpa on the CPU, flex on CUDA) or impl=sdpa, or a CUDA device")
    return chosen


def decide(cfg) -> RunPrecision:
    """The precision of the run RunConfig `cfg` describes, on the device it computes on (`device`, auto: CUDA
    where torch sees a GPU; a Ray run's actors: the same)."""
    kind = device(cfg.device, check=False).type
    if cfg.dtype == "float64":
        return RunPrecision("fp64", autocast=False, auto=cfg.precision == "auto")
    mixed = cfg.precision == "bf16-mixed" or (cfg.precision == "auto" and (
        kind == "cuda" or (kind == "cpu" and cpu_has_fast_bf16())))
    if cfg.dtype == "bfloat16":   # bf16 weights; auto's autocast on them keeps its fp32 ops (softmax, norms) fp32
        return RunPrecision("bf16", autocast=mixed, auto=cfg.precision == "auto")
    return RunPrecision("bf16-mixed" if mixed else "fp32", autocast=mixed, auto=cfg.precision == "auto")


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), where bf16-mixed pays off: on such a host
    the bf16 matmul peak measured 2.4x the fp32 one (benchmarks/results/precision_cpu_avx512.md) and the default
    job's step 0.90x of fp32's, its held-out accuracy kept over 3 seeds (precision_seeds.md); without them the bf16
    matmul ran ~100x below fp32's and the update 20x slower (precision_cpu.md). HETRL_CPU_BF16=1 or 0 says it
    instead (the test suite pins 0, so that precision=auto means fp32 on the CPU on every machine it runs on)."""
    said = os.environ.get(CPU_BF16_ENV, "")
    if said:
        if said not in ("0", "1"):
            raise ValueError(f"{CPU_BF16_ENV}={said!r}: use 1 (the CPU has fast bf16) or 0 (it has not), or unset "
                             "it to ask the CPU")
        return said == "1"
    return _cpu_bf16_instructions()


@functools.cache
def _cpu_bf16_instructions() -> bool:
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):   # torch's own CPU capability checks
        try:
            if getattr(torch.cpu, probe)():
                return True
        except (AttributeError, RuntimeError):   # a torch without the probe: the instruction is not assumed
            pass
    return False


def samples_in_bf16(precision: RunPrecision, model, lora: bool) -> bool:
    """Whether the rollout samples from bf16 weights of its own: where the run is bf16-mixed and the policy is fully
    fine-tuned with fp32 weights, as vLLM and SGLang sample from bf16 weights. Autocast already caches its bf16
    casts of the weights for a whole generate call, so what changes is the rest of the decode in bf16 (activations
    and residual stream; measured on the CPU: 0.89-1.02x the autocast rollout's time, within the spread of two
    runs, benchmarks/results/rollout_bf16.md) and, on Ray, weight sync in bf16 (half the bytes). Otherwise (fp32
    runs; LoRA, which samples through its unmerged adapter) the rollout samples from the policy itself."""
    return not lora and next(model.parameters()).dtype == torch.float32 and precision.autocast
