"""Advantages for tree-shaped sampling (branches=K): each leaf against its task's leaves (GRPO over the leaves) or,
per token, against the leaves of the subtree its segment was sampled in (docs/agents.md)."""

from __future__ import annotations

import torch

from .advantages import advantage

GRPO_EPS = 1e-6   # verl's epsilon in compute_grpo_outcome_advantage (the registry's grpo default)


def tree_advantages(rewards: torch.Tensor, paths: list[tuple[int, ...]], fork_at: list[tuple[int, ...]],
                    lens: list[int], subtree: bool = False, scale: bool = True) -> torch.Tensor:
    """One task's L leaves -> per-token advantages [Σ lens], leaf by leaf, token by token.

    rewards [L]. paths[l]: the leaf's child index at every node it descends through, the first entry its rollout
    (of the task's root), one more per fork; fork_at[l] (len(paths[l]) - 1 entries, increasing): the token where
    each fork happened. Segment d of the leaf, tokens bounds[d] <= t < bounds[d + 1] with bounds = [0, *fork_at[l],
    lens[l]], was sampled below the node paths[l][:d] (d = 0: the task's root).
    subtree off: GRPO over the leaves, every leaf one sample of its task: the registry's grpo on all its
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
    if rewards.numel() == 1:
        return rewards.new_zeros(sum(lens))
    flat = rewards.reshape(-1, 1)
    grpo = advantage("grpo", flat, torch.ones_like(flat), torch.zeros(rewards.numel(), dtype=torch.long),
                     norm_adv_by_std_in_grpo=scale, epsilon=GRPO_EPS)[:, 0]
    if not subtree or rewards.numel() == 1:
        return torch.repeat_interleave(grpo, torch.tensor(lens, dtype=torch.long))
    denom = rewards.std() + GRPO_EPS if scale else rewards.new_tensor(1.0)
    parts = []
    for leaf, (path, cuts, n) in enumerate(zip(paths, fork_at, lens)):
        bounds = [0, *cuts, n]
        for d in range(len(bounds) - 1):
            below = torch.tensor([p[:d] == path[:d] for p in paths])
            parts.append(((rewards[leaf] - rewards[below].mean()) / denom).expand(bounds[d + 1] - bounds[d]))
    return torch.cat(parts)
