"""Advantage estimators by verl's names, on padded [B, T] tensors, plus the critic's helpers (GAE, whitening).

`advantage(name, token_level_rewards, response_mask, index, **options)` takes verl's arguments and option
names (`norm_adv_by_std_in_grpo`, `gamma`, `lam`, ...) and returns [B, T] advantages equal to verl 0.9.1's
`core_algos` estimator of that name (tests/algo/test_vs_verl.py). `index` [B] is the group (prompt) id of
each row. The trainer builds the padded tensors from its packed responses (hetrl/algo/packing.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import numpy as np
import torch

EPS = 1e-8   # verl's guard in its masked means and whitening (verl.utils.torch_functional)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is set, over `axis` (all by default): sum / (count + 1e-8), as verl's."""
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis) / (mask.sum(axis) + EPS)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked entries, var unbiased: verl's masked_whiten."""
    n = mask.sum()
    if n < 2:
        raise ValueError(f"whitening needs at least 2 tokens in the mask, got {int(n)}")
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask) * (n / (n - 1))
    return (values - mean) * torch.rsqrt(var + EPS)


def whiten(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / (std + eps) over a flat [K] batch: the trainer's PPO normalisation (whiten_advantages),
    kept as it was; verl's estimators use masked_whiten (rsqrt(var + eps)), which differs in the last digits."""
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


def gae_returns(token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE without whitening, [B, T] -> (advantages, returns = advantages + values). delta_t = r_t + gamma V_{t+1}
    - V_t, A_t = delta_t + gamma lam A_{t+1}; tokens outside the mask (tool results) are skipped, carrying the
    next value and advantage through them, as verl's compute_gae_advantage_return."""
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")
    values = values.detach()
    mask = response_mask.to(values.dtype)
    next_v = last = values.new_zeros(values.shape[0])
    out = torch.zeros_like(values)
    for t in range(values.shape[1] - 1, -1, -1):   # over the longest response, all rows at once
        delta = token_level_rewards[:, t] + gamma * next_v - values[:, t]
        new = delta + gamma * lam * last
        next_v = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_v
        last = new * mask[:, t] + (1 - mask[:, t]) * last
        out[:, t] = last
    return out, out + values


# --- groups ------------------------------------------------------------------------------------------------------

def _groups(index, n: int) -> torch.Tensor:
    """Group number [B] of each row from `index` (ids of any hashable kind: verl passes uid strings)."""
    if index is None:
        raise ValueError("this estimator compares the responses of a prompt: give index, the group id of each row")
    ids = np.asarray(index.cpu() if isinstance(index, torch.Tensor) else index)
    if ids.shape != (n,):
        raise ValueError(f"index must hold one group id per row ({n}), got shape {ids.shape}")
    return torch.from_numpy(np.unique(ids, return_inverse=True)[1].reshape(-1)).long()


def _rows_by_group(groups: torch.Tensor) -> list[torch.Tensor]:
    """Row numbers of each group, in row order."""
    order = torch.argsort(groups, stable=True)
    return list(torch.split(order, torch.bincount(groups).tolist()))


def _group_mean_std(scores: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row mean and unbiased std of its group's scores [B]; a group of one has mean 0 and std 1 (verl).
    Equal-sized groups reduce as one [G, N] tensor, others one by one (the two round alike up to the last bit)."""
    rows = _rows_by_group(groups)
    mean, std = torch.zeros_like(scores), torch.ones_like(scores)
    sizes = {len(r) for r in rows}
    if len(sizes) == 1 and sizes != {1}:
        order = torch.cat(rows)
        grid = scores[order].view(len(rows), -1)
        mean[order] = grid.mean(dim=1).repeat_interleave(grid.shape[1])
        std[order] = grid.std(dim=1).repeat_interleave(grid.shape[1])
        return mean, std
    for r in rows:
        if len(r) > 1:
            mean[r], std[r] = scores[r].mean(), scores[r].std()
    return mean, std


# --- estimators (verl's names and options) ----------------------------------------------------------------------

def _gae(token_level_rewards, response_mask, index=None, *, values: torch.Tensor, gamma: float = 1.0,
         lam: float = 1.0):
    """PPO: GAE on a critic's `values` [B, T], whitened over the mask."""
    adv, _ = gae_returns(token_level_rewards, values, response_mask, gamma, lam)
    return masked_whiten(adv, response_mask)


def _grpo(token_level_rewards, response_mask, index, *, epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True):
    """GRPO: (r - mean_group) / (std_group + eps); without the std (norm_adv_by_std_in_grpo=False): Dr. GRPO."""
    scores = token_level_rewards.sum(dim=-1)
    mean, std = _group_mean_std(scores, _groups(index, len(scores)))
    adv = (scores - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else scores - mean
    return adv.unsqueeze(-1) * response_mask


def _grpo_passk(token_level_rewards, response_mask, index, *, epsilon: float = 1e-6,
                norm_adv_by_std_in_grpo: bool = True):
    """Pass@k: only each group's best response gets an advantage, r_max - r_second (divided by std + eps)."""
    scores = token_level_rewards.sum(dim=-1)
    adv = torch.zeros_like(scores)
    for rows in _rows_by_group(_groups(index, len(scores))):
        r = scores[rows]
        if r.numel() < 2:
            raise ValueError(f"grpo_passk needs at least 2 responses per group, got a group of {r.numel()}")
        top, at = torch.topk(r, 2)
        a = top[0] - top[1]
        adv[rows[at[0]]] = a / (r.std() + epsilon) if norm_adv_by_std_in_grpo else a
    return adv.unsqueeze(-1) * response_mask


def _rloo(token_level_rewards, response_mask, index):
    """RLOO: r - mean of the group's other responses = (r - mean_group) N / (N - 1)."""
    scores = token_level_rewards.sum(dim=-1)
    groups = _groups(index, len(scores))
    n = torch.bincount(groups)[groups].to(scores.dtype)
    mean, _ = _group_mean_std(scores, groups)
    adv = torch.where(n > 1, scores * n / (n - 1) - mean * n / (n - 1), scores)
    return adv.unsqueeze(-1) * response_mask


def _opo(token_level_rewards, response_mask, index):
    """OPO: r - the group's length-weighted mean reward (sum len * r / sum len)."""
    scores = token_level_rewards.sum(dim=-1)
    lens = response_mask.sum(dim=-1).to(scores.dtype)
    base = torch.zeros_like(scores)
    for rows in _rows_by_group(_groups(index, len(scores))):
        if len(rows) > 1:
            base[rows] = (lens[rows] * scores[rows]).sum() / lens[rows].sum()
    return (scores - base).unsqueeze(-1) * response_mask


def _reinforce_plus_plus(token_level_rewards, response_mask, index=None, *, gamma: float = 1.0):
    """REINFORCE++: discounted return-to-go per token (skipping tokens outside the mask), whitened over the batch."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = token_level_rewards.new_zeros(token_level_rewards.shape[0])
    for t in range(token_level_rewards.shape[1] - 1, -1, -1):
        new = token_level_rewards[:, t] + gamma * running
        returns[:, t] = new * mask[:, t]
        running = new * mask[:, t] + running * (1 - mask[:, t])
    return masked_whiten(returns, response_mask) * response_mask


def _reinforce_plus_plus_baseline(token_level_rewards, response_mask, index):
    """REINFORCE++ with baseline: r - mean_group on every token, whitened over the batch."""
    scores = token_level_rewards.sum(dim=-1)
    mean, _ = _group_mean_std(scores, _groups(index, len(scores)))
    tiled = (scores - mean).unsqueeze(-1).expand_as(token_level_rewards) * response_mask
    return masked_whiten(tiled, response_mask) * response_mask


def _remax(token_level_rewards, response_mask, index=None, *, reward_baselines: torch.Tensor):
    """ReMax: return-to-go minus the reward of the greedy response to the same prompt (`reward_baselines` [B])."""
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return returns - reward_baselines.unsqueeze(-1) * response_mask


def _gpg(token_level_rewards, response_mask, index, *, f_norm: float = 1.0):
    """GPG: (r - mean_group) scaled by B / (responses with a non-zero reward), divided by f_norm."""
    scores = token_level_rewards.sum(dim=-1)
    alpha = len(scores) / torch.count_nonzero(scores).clamp(min=1)
    mean, _ = _group_mean_std(scores, _groups(index, len(scores)))
    return (alpha * (scores - mean) / f_norm).unsqueeze(-1) * response_mask


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {
    "gae": _gae, "grpo": _grpo, "grpo_passk": _grpo_passk, "rloo": _rloo, "opo": _opo,
    "reinforce_plus_plus": _reinforce_plus_plus, "reinforce_plus_plus_baseline": _reinforce_plus_plus_baseline,
    "remax": _remax, "gpg": _gpg,
}
GROUP_ESTIMATORS = ("grpo", "grpo_passk", "rloo", "opo", "reinforce_plus_plus_baseline", "gpg")   # need `index`


def lookup(registry: dict, kind: str, name: str):
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; valid: {', '.join(registry)}")
    return registry[name]


def options_of(fn: Callable) -> tuple[str, ...]:
    """The keyword options an estimator or loss takes."""
    return tuple(p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY)


def check_options(kind: str, name: str, fn: Callable, options: dict) -> None:
    valid = options_of(fn)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"{kind} {name!r} takes no option {', '.join(unknown)}; its options: "
                         f"{', '.join(valid) or 'none'}")


def advantage(name: str, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index=None,
              **options) -> torch.Tensor:
    """Advantages [B, T] by verl's estimator `name` (ADVANTAGE_ESTIMATORS) from token-level rewards [B, T] (an
    outcome reward sits on a response's last token), the response mask [B, T] and the group id of each row
    (`index` [B]; unused by gae, reinforce_plus_plus and remax). Options are verl's: `values` (gae),
    `gamma`, `lam`, `epsilon`, `norm_adv_by_std_in_grpo`, `reward_baselines` (remax), `f_norm` (gpg)."""
    fn = lookup(ADVANTAGE_ESTIMATORS, "advantage estimator", name)
    check_options("advantage estimator", name, fn, options)
    if token_level_rewards.shape != response_mask.shape or token_level_rewards.dim() != 2:
        raise ValueError(f"token_level_rewards and response_mask must both be [B, T], got "
                         f"{tuple(token_level_rewards.shape)} and {tuple(response_mask.shape)}")
    with torch.no_grad():
        return fn(token_level_rewards, response_mask, index, **options)
