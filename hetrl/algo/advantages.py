"""Group-relative advantages (GRPO): each response is scored against the other responses of its prompt; for
tree-shaped sampling, each leaf against its task's leaves or, per token, against the leaves of its subtree."""

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


def tree_advantages(rewards: torch.Tensor, paths: list[tuple[int, ...]], fork_at: list[tuple[int, ...]],
                    lens: list[int], subtree: bool = False, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """One task's L leaves -> per-token advantages [Σ lens], leaf by leaf, token by token.

    rewards [L]. paths[l]: the leaf's child index at every node it descends through, the first entry its rollout
    (of the task's root), one more per fork; fork_at[l] (len(paths[l]) - 1 entries, increasing): the token where
    each fork happened. Segment d of the leaf, tokens bounds[d] <= t < bounds[d + 1] with bounds = [0, *fork_at[l],
    lens[l]], was sampled below the node paths[l][:d] (d = 0: the task's root).
    subtree off: GRPO over the leaves, every leaf one sample of its task: group_advantages(rewards) on all its
    tokens. subtree on: a token's baseline is the mean reward of the leaves below the node its segment was sampled
    from (the task's leaves before the first fork, the fork's leaves after it), so what comes before a fork is
    credited with how its whole subtree did and what follows with how it beat its siblings. Either way scaled by
    the std of the task's leaves (scale on, as GRPO; with one leaf there is nothing to compare: 0)."""
    if rewards.dim() != 1 or not (rewards.numel() == len(paths) == len(fork_at) == len(lens)):
        raise ValueError(f"rewards [L], paths, fork_at and lens must describe the same leaves, got shape "
                         f"{tuple(rewards.shape)} and {len(paths)}, {len(fork_at)}, {len(lens)}")
    for path, cuts, n in zip(paths, fork_at, lens):
        if len(cuts) != len(path) - 1 or list(cuts) != sorted(cuts) or (cuts and not 0 <= cuts[0] <= cuts[-1] <= n):
            raise ValueError(f"a leaf with path {path} needs {len(path) - 1} increasing fork positions within its "
                             f"{n} tokens, got {cuts}")
    grpo = group_advantages(rewards[None], scale=scale, eps=eps)[0]
    if not subtree or rewards.numel() == 1:
        return torch.repeat_interleave(grpo, torch.tensor(lens, dtype=torch.long))
    denom = rewards.std() + eps if scale else rewards.new_tensor(1.0)
    parts = []
    for l, (path, cuts, n) in enumerate(zip(paths, fork_at, lens)):
        bounds = [0, *cuts, n]
        for d in range(len(bounds) - 1):
            below = torch.tensor([p[:d] == path[:d] for p in paths])
            parts.append(((rewards[l] - rewards[below].mean()) / denom).expand(bounds[d + 1] - bounds[d]))
    return torch.cat(parts)


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
