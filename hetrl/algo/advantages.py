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


def gae(rewards: torch.Tensor, values: torch.Tensor, response_lens: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (PPO), per token of every response; the episode ends with the response.

    rewards, values: [K] in response order (values[t] = V of the state before token t, as shared_prompt_head
    gives them); response_lens [M] sums to K. delta_t = r_t + gamma V_{t+1} - V_t (V after the last token is 0),
    A_t = delta_t + gamma lam A_{t+1}. Returns (advantages [K], returns [K] = advantages + values).
    """
    if rewards.shape != values.shape or rewards.dim() != 1:
        raise ValueError(f"rewards and values must both be [K], got {tuple(rewards.shape)} and {tuple(values.shape)}")
    lens = response_lens.to(torch.long)
    if int(lens.sum()) != rewards.numel():
        raise ValueError(f"response_lens sum to {int(lens.sum())}, but there are {rewards.numel()} tokens")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")
    m, width = lens.numel(), int(lens.max()) if lens.numel() else 0
    cols = torch.arange(width, device=rewards.device)
    mask = cols[None, :] < lens[:, None]                        # [M, T]
    r = rewards.new_zeros(m, width).masked_scatter_(mask, rewards)
    v = values.new_zeros(m, width).masked_scatter_(mask, values.detach())
    adv = torch.zeros_like(r)
    running = r.new_zeros(m)
    for t in range(width - 1, -1, -1):                          # over the longest response, all responses at once
        next_v = v[:, t + 1] if t + 1 < width else torch.zeros_like(running)
        delta = r[:, t] + gamma * next_v - v[:, t]
        running = torch.where(mask[:, t], delta + gamma * lam * running, torch.zeros_like(running))
        adv[:, t] = running
    adv = adv[mask]
    return adv, adv + values.detach()


def whiten(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the whole batch of tokens (PPO's advantage normalisation); [K] -> [K]."""
    if x.numel() < 2:
        return x - x.mean() if x.numel() else x
    return (x - x.mean()) / (x.std() + eps)


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns): how much of the returns the critic explains (1 perfect, 0 as
    good as a constant, negative worse). NaN when the returns do not vary."""
    var = returns.var() if returns.numel() > 1 else returns.new_tensor(0.0)
    if var.item() == 0:
        return float("nan")
    return float(1.0 - (returns - values).var() / var)
