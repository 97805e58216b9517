"""GPU catalog: dense tensor throughput, memory and memory bandwidth per GPU type, each row with its source.

Numbers are datasheet peaks without sparsity (several public tables quote sparse figures as "BF16";
those are halved here). GPUs without bf16 (V100, T4) list their fp16 tensor peak and are flagged,
so a bf16 workload on them is planned at fp16 speed and said so. Efficiency below peak is the cost
model's business (cost.py), not the catalog's; a type described in a cluster YAML (e.g. a measured CPU core)
may state its own measured `mfu`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hetrl.schema import check, rule

GB = 10**9
TB = 10**12


@dataclass(frozen=True)
class GPUType:
    name: str
    dense_bf16_flops: float = rule(gt=0)     # FLOP/s, dense tensor-core peak (fp16 where bf16 is missing)
    memory_bytes: float = rule(gt=0)
    hbm_bytes_per_s: float = rule(gt=0)
    nvlink_bytes_per_s: float = rule(0.0, ge=0)   # per-GPU NVLink bandwidth, one direction; 0 when it has none
    has_bf16: bool = True
    source: str = ""                        # where the numbers come from (a datasheet, a measurement)
    # Fraction of dense_bf16_flops a model pass reaches on this device, where it was measured (a CPU core
    # running the model's own forward + backward); absent: the cost model's MFU_TRAIN / MFU_INFER / MFU_DECODE,
    # which are GPU figures (Megatron-style runs on A100/H100)
    mfu: float | None = rule(None, gt=0, le=1)
    # Fraction of dense_bf16_flops one decode step reaches at a given number of rows (sequences), as the cost
    # model counts decode FLOPs (2 x active params per row), measured on the model's own decode step where small
    # batches run below the device's pass `mfu` (a CPU core: small-row matmuls); pairs [rows, mfu], rows rising.
    # Between and beyond the measured rows: linear in log(rows), clamped to the ends. Absent: `mfu` or MFU_DECODE
    decode_mfu_by_rows: tuple[tuple[int, float], ...] | None = None
    # Throughput a device keeps when two processes compute on it at the same time (a rollout and a learner
    # colocated in async mode time-share it), against the same work done one after the other; 1 = no loss.
    # Measured on CPU cores (caches and memory bandwidth shared, context switches); absent: 1
    timeshare_efficiency: float | None = rule(None, gt=0, le=1)
    # The catalog GPU whose operator tables (hetrl/planner/optables.py) price this type, scaled by the ratio of
    # peak FLOP/s or HBM bandwidth: a type described in a cluster YAML states it (e.g. "H100" for a Hopper part);
    # absent, such a type is priced by the roofline constants. Catalog GPUs find their own (optables.nearest_measured)
    operator_tables: str | None = None

    def __post_init__(self):
        check(self)
        if self.decode_mfu_by_rows is not None:
            rows = [r for r, _ in self.decode_mfu_by_rows]
            if not rows or rows[0] < 1 or any(b <= a for a, b in zip(rows, rows[1:])):
                raise ValueError(f"GPU type {self.name}: decode_mfu_by_rows needs [rows, mfu] pairs with rows >= 1 "
                                 f"and rising, got {self.decode_mfu_by_rows}")
            if not all(0 < m <= 1 for _, m in self.decode_mfu_by_rows):
                raise ValueError(f"GPU type {self.name}: decode_mfu_by_rows: every mfu must be in (0, 1], got "
                                 f"{self.decode_mfu_by_rows}")
        if not self.source.strip():
            raise ValueError(f"GPU type {self.name}: source is empty; say where its numbers come from "
                             "(a datasheet, or how they were measured)")


_NVIDIA = "NVIDIA datasheet"
GPUS: dict[str, GPUType] = {g.name: g for g in [
    GPUType("H100", 989e12, 80 * GB, 3.35 * TB, 450 * GB, True, f"{_NVIDIA}: H100 SXM5 (1,979 TF sparse / 2)"),
    GPUType("H200", 989e12, 141 * GB, 4.8 * TB, 450 * GB, True, f"{_NVIDIA}: H200 SXM, same die as H100"),
    GPUType("H20", 148e12, 96 * GB, 4.0 * TB, 450 * GB, True,
            "NVIDIA H20 spec sheet as quoted by RollMux/StreamRL-era reports"),
    GPUType("A100-80G", 312e12, 80 * GB, 2.039 * TB, 300 * GB, True, f"{_NVIDIA}: A100 80GB SXM"),
    GPUType("A100-40G", 312e12, 40 * GB, 1.555 * TB, 300 * GB, True, f"{_NVIDIA}: A100 40GB SXM"),
    GPUType("A800-80G", 312e12, 80 * GB, 2.039 * TB, 200 * GB, True,
            f"{_NVIDIA}: A800 80GB SXM (A100 compute and HBM, NVLink 400 GB/s bidirectional: 200 one way)"),
    GPUType("GB200", 2.5e15, 186 * GB, 8 * TB, 900 * GB, True,
            f"{_NVIDIA}: GB200 NVL72 (360 PF FP16/BF16 sparse / 2 / 72 GPUs; 13.4 TB HBM3e and 576 TB/s over 72; "
            "NVLink 5 1.8 TB/s bidirectional per GPU)"),
    GPUType("L40S", 362e12, 48 * GB, 864 * GB, 0, True, f"{_NVIDIA}: L40S (733 TF sparse / 2)"),
    GPUType("L4", 121e12, 24 * GB, 300 * GB, 0, True, f"{_NVIDIA}: L4 (242 TF sparse / 2)"),
    GPUType("A10G", 70e12, 24 * GB, 600 * GB, 0, True,
            "AWS G5 A10G; tensor clocks below the A10's 125 TF (Baseten A10 vs A10G note; unverified)"),
    GPUType("H800", 989e12, 80 * GB, 3.35 * TB, 200 * GB, True,
            f"{_NVIDIA}: H800 SXM5 (H100 compute and HBM3; NVLink 400 GB/s bidirectional: 200 one way)"),
    GPUType("B200", 2.25e15, 180 * GB, 8 * TB, 900 * GB, True,
            f"{_NVIDIA}: HGX B200 at 1,000 W, BF16 4.5 PF sparse / 2 (as tabulated at "
            "glennklockwood.com/garden/processors/B200); 1.44 TB HBM3e / 8 GPUs, 8 TB/s; NVLink 5 1.8 TB/s "
            "bidirectional (docs.vultr.com HGX B200 overview)"),
    GPUType("MI300X", 1307.4e12, 192 * GB, 5.3 * TB, 448 * GB, True,
            "AMD Instinct MI300X datasheet: BF16 1,307.4 TF dense (2,614.9 with sparsity), 192 GB HBM3, 5.3 TB/s; "
            "Infinity Fabric 7 links x 128 GB/s bidirectional: 448 GB/s one way to the 7 peers of an 8-GPU node"),
    GPUType("MI325X", 1307.4e12, 256 * GB, 6.0 * TB, 448 * GB, True,
            "AMD Instinct MI325X (as tabulated at awesomeagents.ai/hardware/amd-mi325x): MI300X compute, 256 GB "
            "HBM3E, 6 TB/s; Infinity Fabric as the MI300X"),
    GPUType("L20", 119.5e12, 48 * GB, 864 * GB, 0, True,
            "NVIDIA L20 (AD102, PCIe): 48 GB GDDR6, 864 GB/s (technical.city, topcpu.net); BF16 tensor 119.5 TF "
            "dense = 239 TF sparse / 2 as vendors quote the spec sheet (tensor figure unverified)"),
    GPUType("V100", 125e12, 32 * GB, 900 * GB, 150 * GB, False, f"{_NVIDIA}: V100 SXM2 32GB, fp16 tensor (no bf16)"),
    GPUType("T4", 65e12, 16 * GB, 320 * GB, 0, False, f"{_NVIDIA}: T4, fp16 tensor (no bf16)"),
]}

ALIASES = {"H100-SXM": "H100", "H100-SXM5": "H100", "H200-SXM": "H200", "H800-SXM": "H800", "A100": "A100-80G",
           "A100-80GB": "A100-80G", "A100-40GB": "A100-40G", "L40": "L40S"}


def spelling(name: str, own: Iterable[str] = ()) -> str:
    """`name` as the catalog, its aliases or a cluster's `own` types spell it, matched without regard to case
    ("h100" -> "H100"); a name none of them has comes back as given."""
    known = [*own, *GPUS, *ALIASES]
    if not isinstance(name, str) or name in known:
        return name
    return next((k for k in known if k.casefold() == name.casefold()), name)


def device_type(device_name: str) -> str | None:
    """The catalog's name for a device as its driver names it (`torch.cuda.get_device_name`: "NVIDIA H100 80GB
    HBM3" -> "H100", "NVIDIA A100-SXM4-40GB" -> "A100-40G"), None when the catalog has no such type. One rule for
    every place that asks which catalog GPU it runs on (a benchmark's MFU peak, the operator tables' file name)."""
    words = device_name.replace("-", " ").split()
    for whole in (True, False):   # "A100-40G" where the name says 40GB, else the type's first entry
        for name in GPUS:
            base, *rest = name.split("-")
            if base in words and (not whole or all(any(w.startswith(r) for w in words) for r in rest)):
                return name
    return None


def gpu(name: str) -> GPUType:
    """Look a GPU type up by name or alias, in any case; unknown names list the known ones."""
    key = ALIASES.get(spelling(name), spelling(name))
    if key not in GPUS:
        raise ValueError(f"unknown GPU type {name!r}; known: {', '.join(GPUS)} "
                         f"(aliases: {', '.join(f'{a}->{b}' for a, b in ALIASES.items())})")
    return GPUS[key]


# ---------------------------------------------------------------------------------------------- operator data
# Efficiencies of single operators, from published operator benchmarks and vendor guides, never from the RL runs
# that judge the cost model (benchmarks/cost_model_validation.py). Each is read only by the terms added for
# MoE, long sequences and engine-specific plans (docs/cost_model.md, "Operator data"); plans that use none of
# those fields keep the constant MFUs.

# Attention kernel throughput by sequence length, as a fraction of the H100 SXM5's 989 TF dense bf16 peak:
# FlashAttention-2 forward, head dim 128, bf16, non-causal, batch x seqlen = 16K tokens, 16 heads of 128.
# Source: Shah et al., "FlashAttention-3" (2024), Figure 'Attention forward speed, head dim 128 (H100 80GB SXM5)':
# FA2 191 / 260 / 298 / 319 / 333 / 335 TFLOPS at 512 / 1k / 2k / 4k / 8k / 16k (FA3: 292 / 423 / 521 / 579 /
# 602 / 616). verl, NeMo-RL and OpenRLHF train with FlashAttention-2, so its column is the one used; the same
# fractions of peak are used on every GPU (measured on H100 only), and for the backward (FA2's backward is
# slower than its forward: not modelled). Between lengths: linear in log(length), the ends held beyond them.
ATTENTION_EFFICIENCY_BY_SEQLEN: tuple[tuple[int, float], ...] = (
    (512, 191 / 989), (1024, 260 / 989), (2048, 298 / 989), (4096, 319 / 989), (8192, 333 / 989),
    (16384, 335 / 989))
ATTENTION_SOURCE = "Shah et al. 2024 (FlashAttention-3), Fig. attention forward speed, hdim 128, H100 SXM5, FA2 column"

# GEMM efficiency by shape (NVIDIA, "Matrix Multiplication Background User's Guide", Deep Learning Performance
# docs): a GEMM of M x K x N is (a) math-bound or memory-bound by its arithmetic intensity M*K*N / (M*K + K*N +
# M*N) FLOPs per bf16 byte against the device's FLOP/s-to-bytes/s ratio, and (b) loses tile quantization:
# cuBLAS / CUTLASS Hopper kernels compute output tiles of GEMM_TILE_M rows, so M rows cost ceil(M / tile) tiles.
# A grouped GEMM (Megatron's TEGroupedMLP, DeepGEMM) runs each expert's tokens as its own M.
GEMM_TILE_M = 128          # CUTLASS 3 / cuBLAS SM90 bf16 tile rows (128x128 and 128x256 CTA tiles)
GEMM_SOURCE = "NVIDIA Matrix Multiplication Background User's Guide (arithmetic intensity, tile quantization)"


# Collective bandwidth over NVLink: NCCL's protocol overhead leaves ~370 GB/s of an H100's 450 GB/s NVLink line rate
# as bus bandwidth for collectives that do not use NVLink SHARP (all-to-all, ring all-gather / reduce-scatter):
# S. Jeaugey (NCCL), NVIDIA/nccl-tests issue #212, 2024-05-06. Read by the all-to-all terms (ep_comm, sp_comm) on
# NVLink paths; the ring all-reduces of TP/DP keep the line rate they had (the bit-identical default).
NVLINK_BUS_EFFICIENCY = 370 / 450
NVLINK_BUS_SOURCE = ("NVIDIA/nccl-tests#212 (NCCL maintainer): ~370 GB/s busbw of 450 GB/s NVLink line rate, "
                     "~20% protocol")


def attention_efficiency(seq_len: float) -> float:
    """Fraction of a GPU's dense peak an attention kernel reaches on sequences of `seq_len` tokens."""
    import math
    xs = [math.log(n) for n, _ in ATTENTION_EFFICIENCY_BY_SEQLEN]
    ys = [e for _, e in ATTENTION_EFFICIENCY_BY_SEQLEN]
    x = math.log(max(seq_len, 1.0))
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    k = next(i for i in range(1, len(xs)) if x <= xs[i])
    return ys[k - 1] + (ys[k] - ys[k - 1]) * (x - xs[k - 1]) / (xs[k] - xs[k - 1])


def gemm_efficiency(m: float, k: float, n: float, flops_per_s: float, bytes_per_s: float) -> float:
    """Fraction of a large GEMM's throughput a bf16 GEMM of M x K x N keeps: tile quantization of its M rows
    times the memory roofline (arithmetic intensity against the device's `flops_per_s` / `bytes_per_s`, both as
    achieved). 1 for large, well-shaped GEMMs; below 1 for an expert that receives few tokens."""
    import math
    if m <= 0:
        return 1.0
    tiles = math.ceil(m / GEMM_TILE_M)
    quantization = m / (tiles * GEMM_TILE_M)
    intensity = m * k * n / (m * k + k * n + m * n)        # FLOPs per byte: 2MKN FLOPs over 2(MK+KN+MN) bytes
    roofline = min(1.0, intensity * bytes_per_s / flops_per_s)
    return quantization * roofline
