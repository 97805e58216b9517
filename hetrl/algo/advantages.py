"""Group-relative advantages (GRPO): each response is scored against the other responses of its prompt."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G, N] -> advantages [G, N]: (r - mean_group) / (std_group + eps), or unscaled if `scale` is off.

    std is the unbiased sample std as in GRPO; a group whose rewards are all equal gets 0.
    With N = 1 there is nothing to compare against, so the advantage is 0.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, responses_per_group], got shape {tuple(rewards.shape)}")
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale or rewards.shape[1] == 1:
        return centered
    return centered / (rewards.std(dim=1, keepdim=True) + eps)
