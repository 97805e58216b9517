"""The one adapter between the trainer's packed layout and the padded [B, T] layout the estimators and losses
take: per-token tensors [K] hold the responses one after another (response_lens [M] tokens each); padded,
each response is a row, right-padded to the longest. Gradients flow through both directions."""

from __future__ import annotations

import torch


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
