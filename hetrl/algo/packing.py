"""The one adapter between the trainer's packed layout and the padded [B, T] layout the estimators and losses
take: per-token tensors [K] hold the responses one after another (response_lens [M] tokens each); padded,
each response is a row, right-padded to the longest. Gradients flow through both directions."""

from __future__ import annotations

import torch

from .losses import per_token_policy_loss


def row_mask(response_lens: torch.Tensor) -> torch.Tensor:
    """[M, T] bool: True on the first response_lens[m] entries of row m (T the longest response)."""
    lens = response_lens.to(torch.long)
    width = int(lens.max()) if lens.numel() else 0
    return torch.arange(width, device=lens.device)[None, :] < lens[:, None]


def to_padded(x: torch.Tensor, response_lens: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Packed [K] -> padded [M, T] (`fill` after each response's end)."""
    mask = row_mask(response_lens).to(x.device)
    if int(mask.sum()) != x.numel():
        raise ValueError(f"response_lens sum to {int(mask.sum())}, but there are {x.numel()} tokens")
    return x.new_full(mask.shape, fill).masked_scatter(mask, x)


def to_packed(x: torch.Tensor, response_lens: torch.Tensor) -> torch.Tensor:
    """Padded [M, T] -> packed [K] (each row's first response_lens[m] entries, row after row)."""
    return x[row_mask(response_lens).to(x.device)]


def packed_policy_loss(name: str, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                       weights: torch.Tensor, response_lens: torch.Tensor,
                       **options) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token policy loss `name` on packed [K] tensors: padded, run through the registry's per-token loss and
    packed back; a token with weight 0 in `weights` [K] (token_weights: a tool result, a left-out response) is
    outside the loss's mask. Per-response sums (GSPO, GMPO) see only their own response's tokens, so a
    micro-batch's loss is that of its responses whatever else is packed with them. -> (loss [K], metrics [K]);
    weighted_sum(loss, weights) is the micro-batch's share of the mini-batch loss."""
    mask = to_padded((weights != 0).to(log_prob.dtype), response_lens)
    padded = [to_padded(x, response_lens) for x in (old_log_prob, log_prob, advantages)]
    loss, metrics = per_token_policy_loss(name, *padded, mask, **options)
    return to_packed(loss, response_lens), {k: to_packed(v, response_lens) for k, v in metrics.items()}
