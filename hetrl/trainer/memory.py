"""A memory estimate made before training starts, so a config that cannot fit is refused up front.

The planner's rule, not a second one: weights, gradients + optimizer states and the training working set
(activations of one packed micro-batch, logits) come from `hetrl.planner.cost.task_memory` for the run's
workload (`placement.run_workload`, in the run's precision), one data-parallel rank holding everything. Two terms
are the trainer's own because the planner does not charge them to a task: generation's KV cache for one rollout
batch (the planner gives generation whatever memory is left), and one layer's attention scores (heads x T^2),
which SDPA's math path on CPU materialises where GPU flash attention does not. It is an estimate, meant to catch
configurations that are off by a wide margin, not to predict the peak to the megabyte.
"""

from __future__ import annotations

import os

from hetrl.planner.cost import task_memory
from hetrl.planner.plan import Parallelism
from hetrl.planner.spec import TokenLengths

from .build import frozen_bytes
from .placement import model_spec_from_hf, run_workload
from .precision import RunPrecision, samples_in_bf16

GIB = 1024**3


def available_bytes(device=None) -> int:
    """Free memory of a CUDA `device` (torch.cuda.mem_get_info); else MemAvailable from /proc/meminfo (Linux), else
    the physical memory."""
    if device is not None and getattr(device, "type", "cpu") == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def estimate(cfg, model, prompt_tokens: int, precision: RunPrecision) -> dict[str, int]:
    """-> term -> bytes for training `model` with RunConfig `cfg` in `precision` on prompts of about
    `prompt_tokens`."""
    spec = model_spec_from_hf(model.config.get_text_config())
    b = next(model.parameters()).element_size()
    w = run_workload(cfg, spec, TokenLengths(prompt_tokens, float(prompt_tokens)), "bf16" if b == 2 else "fp32")
    scale = b / 4 if b > 4 else 1   # float64 (exactness checks): every fp32 term twice over
    t = cfg.micro_batch_tokens
    train = task_memory(w, "actor_train", Parallelism(1, 1, 1, recompute=cfg.gradient_checkpointing),
                        micro_batch_tokens=t)
    ref = task_memory(w, "ref_infer", Parallelism(), micro_batch_tokens=t) if w.reference else None
    # a bf16-mixed run holds its reference's matmul weights in bf16, the rest fp32 (build.frozen)
    ref_scale = (frozen_bytes(model, precision) / sum(4 * p.numel() for p in model.parameters())
                 if b == 4 and precision.autocast else scale)
    gen_rows = min(cfg.rollout_batch_size, cfg.prompts_per_step * cfg.responses_per_prompt)
    if cfg.branches > 1:   # whole tasks per rollout batch, each growing to its leaves' rows (episodes.py)
        gen_rows = min(cfg.prompts_per_step, max(1, cfg.rollout_batch_size // w.leaves)) * w.leaves
    gen_len = prompt_tokens + cfg.max_new_tokens
    # LoRA: gradients and Adam moments only for the adapter's parameters (the planner's per-parameter bytes, scaled
    # to their count); the reference is the same weights with the adapter off, so no second copy.
    trained = lora_parameters(cfg, model) / sum(p.numel() for p in model.parameters()) if cfg.lora_rank else 1.0
    return {
        "weights": int(train.weights * scale * (1 + (trained if cfg.lora_rank else 0))),
        "gradients_and_optimizer": int(train.states * scale * trained),
        "activations_and_logits": int(train.working * scale),
        # SDPA's math path on CPU materialises one layer's [heads, T, T] scores; CUDA's flex/flash kernels do not
        "attention_scores": spec.heads * t * t * b if next(model.parameters()).device.type == "cpu" else 0,
        "reference_model": int(ref.weights * ref_scale) if ref and not cfg.lora_rank else 0,
        # the local rollout's own bf16 copy of the policy where it samples in bf16 (precision.samples_in_bf16)
        "rollout_model": int(train.weights * scale / 2)
        if cfg.executor == "local" and samples_in_bf16(precision, model, bool(cfg.lora_rank)) else 0,
        "generation_kv_cache": gen_rows * gen_len * spec.kv_bytes_per_token * b // 2 + gen_rows * spec.vocab * 4,
    }


def lora_parameters(cfg, model) -> int:
    """Parameters of the LoRA adapter `cfg` puts on `model`: rank x (in + out) per targeted Linear (peft's
    all-linear: every Linear but the output embedding)."""
    import torch

    head = model.get_output_embeddings()
    targets = cfg.lora_target_modules
    count = 0
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear) or m is head:
            continue
        if targets == "all-linear" or (isinstance(targets, str) and name.endswith(targets)) or \
                (not isinstance(targets, str) and name.rsplit(".", 1)[-1] in targets):
            count += cfg.lora_rank * (m.in_features + m.out_features)
    return count


def _gib(n: float) -> str:
    """Bytes as GiB with the digits that tell small sizes apart (0.0012, 3.7, 24.0)."""
    g = n / GIB
    return f"{g:.1f}" if g >= 0.95 else f"{g:.2g}"


def check_fits(cfg, model, prompt_tokens: int, precision: RunPrecision, limit_bytes: int | None = None
               ) -> dict[str, int]:
    terms = estimate(cfg, model, prompt_tokens, precision)
    limit = limit_bytes if limit_bytes is not None else available_bytes()
    total = sum(terms.values())
    if total > limit:
        detail = ", ".join(f"{k} {_gib(v)}" for k, v in terms.items() if v)
        given = limit_bytes is not None and getattr(cfg, "memory_limit_gib", None)
        raise ValueError(
            f"this run needs about {_gib(total)} GiB but {_gib(limit)} GiB is "
            + (f"allowed (memory_limit_gib={cfg.memory_limit_gib:g})" if given else "available")
            + f" ({detail} GiB). Lower micro_batch_tokens (now {cfg.micro_batch_tokens}; activations grow with it), "
            f"rollout_batch_size (now {cfg.rollout_batch_size}) or max_new_tokens (now {cfg.max_new_tokens}); "
            + ("or raise memory_limit_gib" if given else "or set memory_limit_gib if the machine has more than is "
               "reported"))
    return terms
