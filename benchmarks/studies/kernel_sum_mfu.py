"""What a transformer layer's forward would reach on H100 if priced as the sum of its operator-table kernels (issue 44:
why training and log-prob passes stay on the end-to-end MFU): per layer the attention projections, the MLP's GEMMs
and the per-token kernels (norms, rope, activation, add) at M tokens from the operator tables
(hetrl/planner/optables.py), as a fraction of the GPU's dense bf16 peak. Attention, backward, recompute, optimizer
and communication are left out, so a step priced this way could only be faster than this fraction says.

    python -m benchmarks.studies.kernel_sum_mfu

No timing: a lookup in committed tables (Vidur's H100 GEMM and small-op measurements); results:
benchmarks/results/kernel_sum_mfu.md.
"""

from __future__ import annotations

from hetrl.bench.harness import revision, utc_now, write_results
from hetrl.planner import catalog, optables
from hetrl.planner.spec import PRESETS

ROOT_OUT = "benchmarks/results"
MODELS = ("qwen3-8b", "qwen3-32b")
TOKENS = (2048, 4096, 16384)
TPS = (1, 4)
END_TO_END_MFU = 0.45   # cost.MFU_TRAIN: Megatron-style training steps on A100/H100 (peers_schedulers.md section 6.1)


def layer(gpu, name: str, m: int, tp: int) -> dict:
    p = PRESETS[name]
    h = p.hidden
    o = p.heads * p.head_dim * h
    gemms = (optables.gemm_s(gpu, m, (p.attn_params_per_layer - o) / h / tp, h)
             + optables.gemm_s(gpu, m, h, o / h / tp)
             + optables.gemm_s(gpu, m, 2 * p.intermediate / tp, h)
             + optables.gemm_s(gpu, m, h, p.intermediate / tp))
    small = optables.small_ops_s(gpu, m, h, p.intermediate / tp)
    flops = 2 * m * (p.attn_params_per_layer + 3 * h * p.intermediate) / tp
    return {"model": name, "tokens": m, "tp": tp, "gemm_fraction": flops / gemms / gpu.dense_bf16_flops,
            "kernel_sum_fraction": flops / (gemms + small) / gpu.dense_bf16_flops}


def main() -> None:
    gpu = catalog.gpu("H100")
    rows = [layer(gpu, n, m, tp) for n in MODELS for tp in TPS for m in TOKENS]
    lo, hi = min(r["kernel_sum_fraction"] for r in rows), max(r["kernel_sum_fraction"] for r in rows)
    text = "\n".join([
        "# A layer's forward as a sum of operator-table kernels, H100",
        "",
        f"`python -m benchmarks.studies.kernel_sum_mfu` at {revision()}, {utc_now()}: a lookup in the committed "
        "operator tables (Vidur's H100 GEMMs and per-token kernels), no timing. Fraction = the layer's GEMM FLOPs "
        "over (the kernels' summed seconds x dense bf16 peak); attention, backward, recompute, optimizer and "
        "communication are not in it.",
        "",
        "| model | TP | tokens | GEMMs alone | GEMMs + per-token kernels |",
        "|---|---:|---:|---:|---:|",
        *[f"| {r['model']} | {r['tp']} | {r['tokens']} | {r['gemm_fraction']:.2f} | {r['kernel_sum_fraction']:.2f} |"
          for r in rows],
        "",
        f"The kernel sum reaches {lo:.2f}-{hi:.2f} of peak, above the {END_TO_END_MFU} end-to-end MFU the model "
        "prices training steps at (cost.MFU_TRAIN); a step priced as this sum would be faster still, moving the "
        "update phases that the validation already under-predicts further under.",
    ])
    write_results(ROOT_OUT, "kernel_sum_mfu", {"rows": rows, "end_to_end_mfu": END_TO_END_MFU,
                                               "revision": revision(), "date": utc_now()}, text)
    print(text)


if __name__ == "__main__":
    main()
