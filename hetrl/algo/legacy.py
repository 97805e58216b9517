"""The packed-layout names the trainer called before the registry (removed once it calls the registry itself):
thin shells over hetrl.algo's registry functions, no math of their own."""

from __future__ import annotations

import torch

from .advantages import advantage, gae_returns
from .losses import kl_penalty, per_token_policy_loss
from .packing import row_mask, to_packed, to_padded


def group_advantages(rewards: torch.Tensor, scale: bool = True) -> torch.Tensor:
    """rewards [G, N] -> GRPO advantages [G, N] (registry "grpo")."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, responses_per_group], got shape {tuple(rewards.shape)}")
    index = torch.arange(rewards.shape[0]).repeat_interleave(rewards.shape[1])
    flat = rewards.reshape(-1, 1)
    return advantage("grpo", flat, torch.ones_like(flat), index, norm_adv_by_std_in_grpo=scale).view_as(rewards)


def gae(rewards, values, response_lens, gamma, lam):
    """Packed [K] GAE (registry gae_returns through the packing adapter) -> (advantages, returns)."""
    adv, ret = gae_returns(to_padded(rewards, response_lens), to_padded(values, response_lens),
                           row_mask(response_lens), gamma, lam)
    return to_packed(adv, response_lens), to_packed(ret, response_lens)


def clipped_policy_loss(logp, old_logp, advantages, clip_low, clip_high):
    loss, metrics = per_token_policy_loss("vanilla", old_logp, logp, advantages, torch.ones_like(logp),
                                          clip_ratio_low=clip_low, clip_ratio_high=clip_high, clip_ratio_c=None)
    return loss, metrics["pg_clipfrac"]


def kl_k3(logp, ref_logp):
    return kl_penalty(logp, ref_logp, "k3")
