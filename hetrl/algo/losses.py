"""Per-token policy and value losses and how they are averaged. Shapes: K = response tokens of a (mini-)batch.

The aggregation is expressed as per-token weights over the whole mini-batch, so a loss summed
over micro-batches (gradient accumulation) equals the loss of the mini-batch in one piece.
"""

from __future__ import annotations

import torch

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


def clipped_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                        clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO/GRPO clipped surrogate, per token. logp, old_logp, advantages: [K].

    Returns (loss [K], clipped [K] as 0/1): loss = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A).
    DAPO's clip-higher is clip_high > clip_low.
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped).to(logp.dtype)


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's value loss per token: 0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2); without `clip`,
    0.5 (V - R)^2. Returns (loss [K], clipped [K] as 0/1: where the clipped term was the larger)."""
    plain = (values - returns) ** 2
    if clip is None:
        return 0.5 * plain, torch.zeros_like(plain)
    if not clip > 0:
        raise ValueError(f"vf_clip must be > 0 (or None for no clipping), got {clip}")
    held = old_values + torch.clamp(values - old_values, -clip, clip)
    capped = (held - returns) ** 2
    return 0.5 * torch.maximum(plain, capped), (capped > plain).to(values.dtype)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π || π_ref) per token: exp(ref - logp) - (ref - logp) - 1 >= 0. [K]."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


def token_weights(response_lens: torch.Tensor, keep: torch.Tensor, mode: str,
                  loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Weights [K] that turn per-token losses into the mini-batch loss by a plain weighted sum.

    response_lens [M] (tokens per response), keep [M] bool (False: response left out, e.g. overlong).
    token-mean: every kept token counts equally (DAPO). seq-mean-token-mean: each kept response's
    token mean, averaged over kept responses (GRPO paper). Left-out responses get weight 0.
    loss_mask [K] bool (multi-turn episodes): False on tokens that are context, not the model's (tool results);
    they get weight 0 and are not counted, so the loss is that of the model's tokens alone.
    """
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss aggregation must be one of {LOSS_AGGREGATIONS}, got {mode!r}")
    if loss_mask is not None:
        owner = torch.repeat_interleave(torch.arange(response_lens.numel()), response_lens)
        counted = torch.zeros(response_lens.numel(), dtype=torch.long).index_add_(0, owner, loss_mask.long())
    else:
        counted = response_lens
    kept = keep & (counted > 0)
    lens = counted.to(torch.float64)
    if mode == "token-mean":
        total = lens[kept].sum()
        per_response = torch.where(kept, 1.0 / total.clamp(min=1.0), 0.0)
    else:
        n = kept.sum().clamp(min=1).to(torch.float64)
        per_response = torch.where(kept, 1.0 / (lens.clamp(min=1.0) * n), 0.0)
    out = torch.repeat_interleave(per_response, response_lens)
    return out if loss_mask is None else out * loss_mask.to(out.dtype)
