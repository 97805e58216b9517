"""A memory estimate made before training starts, so a config that cannot fit is refused up front.

Terms (bytes): policy weights, gradients, AdamW's two moments, a frozen reference copy when
the KL term is on, activations kept for backward for one micro-batch of packed tokens
(~(16·hidden + 4·intermediate) values per token and layer, plus one layer's attention scores
H x T² as a bound), logits of the micro-batch's predicting rows (x3: logits, softmax, grad),
and generation's KV cache plus last-step logits. It is an estimate, meant to catch the
configurations that are off by a wide margin, not to predict the peak to the megabyte.
"""

from __future__ import annotations

import os

GIB = 1024**3


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def estimate(cfg, model, prompt_tokens: int) -> dict[str, int]:
    """-> term -> bytes for training `model` with RunConfig `cfg` on prompts of about `prompt_tokens`."""
    c = model.config.get_text_config()
    b = next(model.parameters()).element_size()
    n = sum(p.numel() for p in model.parameters())
    layers, hidden, inter = c.num_hidden_layers, c.hidden_size, c.intermediate_size
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", heads) or heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    vocab = c.vocab_size
    t = cfg.micro_batch_tokens
    rows = min(t, cfg.prompts_per_step * cfg.responses_per_prompt * cfg.max_new_tokens)
    gen_rows = min(cfg.rollout_batch_size, cfg.prompts_per_step * cfg.responses_per_prompt)
    gen_len = prompt_tokens + cfg.max_new_tokens
    return {
        "weights": n * b,
        "gradients": n * b,
        "adamw_moments": 2 * n * b,
        "reference_model": n * b if cfg.kl_coef > 0 else 0,
        "activations": t * layers * (16 * hidden + 4 * inter) * b + heads * t * t * b,
        "logits": 3 * rows * vocab * max(b, 4),
        "generation_kv_cache": gen_rows * gen_len * layers * 2 * kv_heads * head_dim * b + gen_rows * vocab * 4,
    }


def check_fits(cfg, model, prompt_tokens: int, limit_bytes: int | None = None) -> dict[str, int]:
    terms = estimate(cfg, model, prompt_tokens)
    limit = limit_bytes if limit_bytes is not None else available_bytes()
    total = sum(terms.values())
    if total > limit:
        detail = ", ".join(f"{k} {v / GIB:.2f}" for k, v in terms.items() if v)
        raise ValueError(
            f"this run needs about {total / GIB:.1f} GiB but {limit / GIB:.1f} GiB is available ({detail} GiB). "
            f"Lower micro_batch_tokens (now {cfg.micro_batch_tokens}; activations grow with it), "
            f"rollout_batch_size (now {cfg.rollout_batch_size}) or max_new_tokens (now {cfg.max_new_tokens}); "
            "or set memory_limit_gib if the machine has more than is reported")
    return terms
