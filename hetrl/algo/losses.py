"""Policy losses by verl's names (`loss_mode`), how per-token losses become one loss, KL estimators, value loss.

`policy_loss(name, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, **options)` takes padded
[B, T] tensors and verl's option names and equals verl 0.9.1's `core_algos` loss of that name, loss and gradient
(tests/algo/test_vs_verl.py). Each loss is a per-token function `POLICY_LOSSES[name]` -> ([B, T] loss, per-token
metrics); the aggregation is a per-token weight (`token_weights`), so a loss summed over micro-batches equals
the mini-batch's in one piece and the trainer's packed layout gives the padded layout's loss (hetrl/algo/packing).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .advantages import check_options, lookup, masked_mean

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm")
SEQ_LEN_EPS = 1e-8   # verl's agg_loss divides a response's token sum by (tokens + 1e-8) in seq-mean-token-mean


def token_weights(response_lens: torch.Tensor, keep: torch.Tensor, mode: str, loss_mask: torch.Tensor | None = None,
                  *, loss_scale_factor: float | None = None, seq_len_eps: float = 0.0) -> torch.Tensor:
    """Weights [K] that turn per-token losses into the mini-batch loss by a plain weighted sum.

    response_lens [M] (tokens per response), keep [M] bool (False: response left out, e.g. overlong).
    token-mean: every kept token counts equally (DAPO). seq-mean-token-mean: each kept response's token mean,
    averaged over kept responses (GRPO paper); `seq_len_eps` is added to each response's token count (verl adds
    1e-8; 0 is the exact mean). token-sum: 1 per token. seq-mean-token-sum: each response's token sum, averaged
    over responses; -norm divides that by `loss_scale_factor` too (Dr. GRPO's constant, e.g. the longest
    response allowed). Left-out responses get weight 0.
    loss_mask [K] bool (multi-turn episodes): False on tokens that are context, not the model's (tool results);
    they get weight 0 and are not counted, so the loss is that of the model's tokens alone.
    """
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss aggregation must be one of {LOSS_AGGREGATIONS}, got {mode!r}")
    if mode == "seq-mean-token-sum-norm" and not (loss_scale_factor and loss_scale_factor > 0):
        raise ValueError(f"seq-mean-token-sum-norm divides by loss_scale_factor, which must be > 0, got "
                         f"{loss_scale_factor}")
    if loss_mask is not None:
        owner = torch.repeat_interleave(torch.arange(response_lens.numel()), response_lens)
        counted = torch.zeros(response_lens.numel(), dtype=torch.long).index_add_(0, owner, loss_mask.long())
    else:
        counted = response_lens
    kept = keep & (counted > 0)
    lens = counted.to(torch.float64)
    n = kept.sum().clamp(min=1).to(torch.float64)
    if mode == "token-mean":
        total = lens[kept].sum()
        per_response = torch.where(kept, 1.0 / total.clamp(min=1.0), 0.0)
    elif mode == "seq-mean-token-mean":
        per_response = torch.where(kept, 1.0 / ((lens.clamp(min=1.0) + seq_len_eps) * n), 0.0)
    elif mode == "token-sum":
        per_response = kept.to(torch.float64)
    else:
        scale = n * loss_scale_factor if mode == "seq-mean-token-sum-norm" else n
        per_response = torch.where(kept, 1.0 / scale, 0.0)
    out = torch.repeat_interleave(per_response, response_lens)
    return out if loss_mask is None else out * loss_mask.to(out.dtype)


def weighted_sum(loss: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(weights * loss) over the tokens with a weight (a non-finite loss where the weight is 0 stays out)."""
    w = weights.to(loss.dtype)
    return torch.where(w != 0, w * loss, 0.0).sum()


def padded_weights(response_mask: torch.Tensor, mode: str, loss_scale_factor: float | None = None,
                   seq_len_eps: float = SEQ_LEN_EPS) -> torch.Tensor:
    """token_weights for padded [B, T] rows: each row a response, `response_mask` its tokens. The default
    loss_scale_factor is T (verl's)."""
    b, t = response_mask.shape
    w = token_weights(torch.full((b,), t), torch.ones(b, dtype=torch.bool), mode, response_mask.reshape(-1).bool(),
                      loss_scale_factor=t if loss_scale_factor is None else loss_scale_factor, seq_len_eps=seq_len_eps)
    return w.view(b, t)


def agg_loss(loss_mat: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str,
             loss_scale_factor: float | None = None, seq_len_eps: float = SEQ_LEN_EPS) -> torch.Tensor:
    """A [B, T] per-token loss -> one loss, as verl's agg_loss (one data-parallel rank)."""
    return weighted_sum(loss_mat, padded_weights(response_mask, loss_agg_mode, loss_scale_factor, seq_len_eps))


# --- policy losses: (old_log_prob, log_prob, advantages, response_mask, **options) -> ([B, T] loss, metrics) ------
# Per-token metrics: pg_clipfrac (0/1), pg_clipfrac_lower (0/1), ppo_kl (old - new log-prob); policy_loss averages
# them over the mask as verl does, the trainer by its loss weights.

def _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high) -> tuple[float, float]:
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    return low, high


def _vanilla(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio: float = 0.2,
             clip_ratio_low: float | None = None, clip_ratio_high: float | None = None,
             clip_ratio_c: float | None = 3.0):
    """PPO's clipped surrogate -min(r A, clip(r, 1 - low, 1 + high) A), r = exp(log_prob - old); DAPO's clip-higher
    is high > low. Dual-clip (clip_ratio_c > 1): where A < 0 the loss is at most -A c; None: no dual-clip."""
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip) must be > 1, or None for no dual-clip, got {clip_ratio_c}")
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - low, 1.0 + high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    metrics = {"pg_clipfrac": (clipped < unclipped).to(log_prob.dtype), "ppo_kl": -log_ratio.detach()}
    if clip_ratio_c is not None:
        floor = -advantages * clip_ratio_c
        metrics["pg_clipfrac_lower"] = ((loss > floor) & (advantages < 0)).to(log_prob.dtype)
        loss = torch.where(advantages < 0, torch.minimum(floor, loss), loss)
    return loss, metrics


def _gspo(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio: float = 0.2,
          clip_ratio_low: float | None = None, clip_ratio_high: float | None = None):
    """GSPO: the clipped surrogate on the sequence ratio s = exp(mean_t log(π/π_old)), carried to each token as
    sg[s] π_t / sg[π_t], so its gradient is s times the token's (a per-response sum over tokens)."""
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = log_prob - old_log_prob
    seq = (log_ratio * response_mask).sum(dim=-1) / response_mask.sum(dim=-1).clamp(min=1)
    log_s = torch.clamp(log_prob - log_prob.detach() + seq.detach().unsqueeze(-1), max=10.0)
    s = torch.exp(log_s)
    loss1 = -advantages * s
    loss2 = -advantages * torch.clamp(s, 1 - low, 1 + high)
    return torch.maximum(loss1, loss2), {"pg_clipfrac": (loss2 > loss1).to(log_prob.dtype),
                                         "ppo_kl": -log_ratio.detach()}


def _sapo(old_log_prob, log_prob, advantages, response_mask, *, tau_pos: float = 1.0, tau_neg: float = 1.05):
    """SAPO: a soft gate instead of the clip, -A sigmoid(tau (r - 1)) 4 / tau, tau = tau_pos where A > 0 else
    tau_neg."""
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    like = dict(dtype=advantages.dtype, device=advantages.device)
    taus = torch.where(advantages > 0, torch.as_tensor(tau_pos, **like), torch.as_tensor(tau_neg, **like))
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    return -gates * advantages, {"ppo_kl": -log_ratio.detach()}


def _gpg(old_log_prob, log_prob, advantages, response_mask):
    """GPG: the plain policy gradient -A log π (no ratio, no clip)."""
    return -log_prob * advantages, {}


def _cispo(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio: float = 0.2,
           clip_ratio_low: float | None = None, clip_ratio_high: float | None = None):
    """CISPO: -sg[clip(r, 1 - low, 1 + high)] A log π: the clipped ratio weights the gradient of every token,
    clipped ones included."""
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - low, 1 + high)
    return -clipped.detach() * advantages * log_prob, {"pg_clipfrac": (ratio != clipped).to(log_prob.dtype),
                                                       "ppo_kl": -log_ratio.detach()}


def _clip_cov(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio: float = 0.2,
              clip_ratio_low: float | None = None, clip_ratio_high: float | None = None,
              clip_cov_ratio: float = 0.0002, clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0):
    """Clip-Cov: the clipped surrogate, with the gradient cut from a random `clip_cov_ratio` of the tokens whose
    covariance (A - mean A)(log π - mean log π) lies in (lb, ub) (draws from torch's generator, as verl)."""
    if not clip_cov_ratio > 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    valid = response_mask > 0
    with torch.no_grad():
        cov = (advantages - masked_mean(advantages, response_mask)) * (
            log_prob - masked_mean(log_prob.detach(), response_mask))
        cov[~valid | ((loss2 > loss1) & valid)] = -torch.inf
        n_clip = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
        candidates = torch.nonzero((cov < clip_cov_ub) & (cov > clip_cov_lb) & valid)
        if len(candidates):
            candidates = candidates[torch.randperm(len(candidates))[:min(n_clip, len(candidates))]]
        corr = torch.ones_like(advantages)
        corr[candidates[:, 0], candidates[:, 1]] = 0
    return torch.maximum(loss1, loss2) * corr, {"pg_clipfrac": (corr == 0).to(log_prob.dtype),
                                                "ppo_kl": -log_ratio.detach()}


def _kl_cov(old_log_prob, log_prob, advantages, response_mask, *, kl_cov_ratio: float = 0.0002,
            ppo_kl_coef: float = 0.1):
    """KL-Cov: -r A, plus ppo_kl_coef |log r| on the `kl_cov_ratio` of the tokens with the largest covariance
    (A - mean A)(log π - mean log π) over the batch's tokens."""
    if not kl_cov_ratio > 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    loss = -advantages * ratio
    penalised = -advantages * ratio + ppo_kl_coef * log_ratio.abs()
    valid = (response_mask > 0).reshape(-1)
    if valid.any():
        with torch.no_grad():
            adv, logp = advantages.detach().reshape(-1)[valid], log_prob.detach().reshape(-1)[valid]
            cov = (adv - adv.mean()) * (logp - logp.mean())
            top = torch.topk(cov, max(1, int(len(cov) * kl_cov_ratio)), largest=True).indices
            chosen = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
            chosen[torch.nonzero(valid).squeeze(-1)[top]] = True
        loss = torch.where(chosen.view_as(loss), penalised, loss)
    return loss, {"ppo_kl": log_ratio.detach().abs()}


def _geo_mean(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio: float = 0.2,
              clip_ratio_low: float | None = None, clip_ratio_high: float | None = None):
    """GMPO: -mean_t(A) exp(mean_t of the token-clipped log r) per response (a geometric mean of the ratios),
    averaged over responses. As a [B, T] loss: the response's loss / its tokens on each token (summed back by
    the seq-mean-token-sum aggregation this loss fixes)."""
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    held = sign * torch.minimum(sign * log_ratio, sign * torch.clamp(log_ratio, -low, high))
    n = response_mask.sum(dim=-1)
    ratio = torch.exp((held * response_mask).sum(dim=-1) / (n + 1e-8))
    adv = (advantages * response_mask).sum(dim=-1) / (n + 1e-8)
    per_response = -adv * ratio
    clipped = log_ratio != torch.clamp(log_ratio, -low, high)
    return (per_response / n.clamp(min=1)).unsqueeze(-1) * response_mask, {
        "pg_clipfrac": (clipped & (advantages > 0)).to(log_prob.dtype),
        "pg_clipfrac_lower": (clipped & (advantages < 0)).to(log_prob.dtype), "ppo_kl": -log_ratio.detach()}


@dataclass(frozen=True)
class Loss:
    fn: Callable
    aggregation: str | None = None   # the aggregation the loss defines (then loss_agg_mode must be it or unset)


POLICY_LOSSES: dict[str, Loss] = {
    "vanilla": Loss(_vanilla), "gspo": Loss(_gspo), "sapo": Loss(_sapo, "seq-mean-token-mean"), "gpg": Loss(_gpg),
    "cispo": Loss(_cispo), "clip_cov": Loss(_clip_cov), "kl_cov": Loss(_kl_cov),
    "geo_mean": Loss(_geo_mean, "seq-mean-token-sum"),
}


def loss_aggregation(name: str, loss_agg_mode: str | None) -> str:
    """The aggregation loss `name` runs with: its own where it defines one (SAPO: seq-mean-token-mean; GMPO: the
    mean over responses, as verl, which ignores loss_agg_mode for them), else `loss_agg_mode` (default
    token-mean)."""
    fixed = lookup(POLICY_LOSSES, "loss_mode", name).aggregation
    if fixed is not None and loss_agg_mode not in (None, fixed):
        raise ValueError(f"loss_mode={name} aggregates by {fixed} (its definition, as verl's); loss_agg "
                         f"(verl's loss_agg_mode)={loss_agg_mode} does not apply to it: leave loss_agg unset or set "
                         f"it to {fixed}")
    mode = fixed or loss_agg_mode or "token-mean"
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_agg (verl's loss_agg_mode) must be one of {', '.join(LOSS_AGGREGATIONS)}, got "
                         f"{mode!r}")
    return mode


def per_token_policy_loss(name: str, old_log_prob, log_prob, advantages, response_mask, **options):
    """[B, T] per-token loss and per-token metrics of loss `name` (POLICY_LOSSES), options checked."""
    fn = lookup(POLICY_LOSSES, "loss_mode", name).fn
    check_options("loss_mode", name, fn, options)
    return fn(old_log_prob, log_prob, advantages, response_mask, **options)


def policy_loss(name: str, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, loss_agg_mode: str | None = None, *,
                loss_scale_factor: float | None = None, seq_len_eps: float = SEQ_LEN_EPS,
                **options) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's policy loss `name` on [B, T] tensors -> (loss, metrics). Options are verl's (`clip_ratio`,
    `clip_ratio_low`, `clip_ratio_high`, `clip_ratio_c`, `tau_pos`, `tau_neg`, `clip_cov_ratio`, `clip_cov_lb`,
    `clip_cov_ub`, `kl_cov_ratio`, `ppo_kl_coef`); loss_agg_mode one of LOSS_AGGREGATIONS, None: token-mean, or
    the loss's own (sapo, geo_mean; loss_aggregation); loss_scale_factor for seq-mean-token-sum-norm (default T).
    seq_len_eps: verl's 1e-8 added to a response's token count in seq-mean-token-mean (0: the exact mean, TRL's).
    Metrics: verl's (pg_clipfrac, pg_clipfrac_lower, ppo_kl), averaged over the mask."""
    if not (old_log_prob.shape == log_prob.shape == advantages.shape == response_mask.shape) or log_prob.dim() != 2:
        raise ValueError(f"old_log_prob, log_prob, advantages and response_mask must all be [B, T], got "
                         f"{[tuple(x.shape) for x in (old_log_prob, log_prob, advantages, response_mask)]}")
    mode = loss_aggregation(name, loss_agg_mode)
    loss_mat, per_token = per_token_policy_loss(name, old_log_prob, log_prob, advantages, response_mask, **options)
    loss = agg_loss(loss_mat, response_mask, mode, loss_scale_factor, seq_len_eps)
    return loss, {k: float(masked_mean(v, response_mask)) for k, v in per_token.items()}


# --- KL estimators, entropy, value loss ---------------------------------------------------------------------------

KL_PENALTIES = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "kl+", "abs+", "k3+", "low_var_kl+")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token estimate of KL(π || π_ref) (Schulman's estimators; verl's kl_penalty): k1/kl = log π - log π_ref,
    abs = |k1|, k2/mse = k1² / 2, k3/low_var_kl = exp(-k1) + k1 - 1 (clamped to [-10, 10], its input to ±20).
    A trailing "+" keeps the value and takes k2's gradient (straight-through), which is unbiased for the KL's."""
    if kl_penalty not in KL_PENALTIES:
        raise ValueError(f"unknown kl estimator {kl_penalty!r}; valid: {', '.join(KL_PENALTIES)}")
    base = kl_penalty.rstrip("+")
    diff = logprob - ref_logprob
    if base in ("k1", "kl"):
        value = diff
    elif base == "abs":
        value = diff.abs()
    elif base in ("k2", "mse"):
        value = 0.5 * diff.square()
    else:
        delta = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        value = torch.clamp(torch.exp(delta) - delta - 1, min=-10, max=10)
    if not kl_penalty.endswith("+"):
        return value
    k2 = 0.5 * diff.square()
    return k2 - k2.detach() + value.detach()


class KLController:
    """The coefficient of the KL penalty in the reward (verl's kl_ctrl): fixed, or adaptive (Ziegler et al. 2019):
    after each batch, value *= 1 + clip(kl / target - 1, -0.2, 0.2) n / horizon, n the batch's responses."""

    def __init__(self, kl_coef: float, kind: str = "fixed", target: float = 0.1, horizon: int = 10000):
        if kind not in ("fixed", "adaptive"):
            raise ValueError(f"kl_ctrl must be fixed or adaptive, got {kind!r}")
        if kind == "adaptive" and not (target > 0 and horizon > 0):
            raise ValueError(f"the adaptive KL controller needs kl_target > 0 and horizon > 0, got {target}, {horizon}")
        self.value, self.kind, self.target, self.horizon = kl_coef, kind, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        if self.kind == "adaptive":
            error = min(max(current_kl / self.target - 1, -0.2), 0.2)
            self.value *= 1 + error * n_steps / self.horizon


def kl_in_reward(token_level_scores: torch.Tensor, old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor,
                 response_mask: torch.Tensor, ctrl: KLController,
                 kl_penalty_type: str = "kl") -> tuple[torch.Tensor, float]:
    """verl's apply_kl_penalty on [B, T]: rewards - coef * KL per token (the behaviour policy's log-probs against
    the reference's), then the controller updated on the batch's mean per-response KL. -> (rewards, that KL)."""
    kld = kl_penalty(old_log_prob, ref_log_prob, kl_penalty_type) * response_mask
    rewards = token_level_scores - ctrl.value * kld
    current = float(masked_mean(kld, response_mask, axis=-1).mean())
    ctrl.update(current, n_steps=token_level_scores.shape[0])
    return rewards, current


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy [...] of the categorical distribution of each row of logits [..., V]: logsumexp(z) - sum p z."""
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


def entropy_loss(logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean") -> torch.Tensor:
    """The aggregated entropy of logits [B, T, V] over the mask (verl's compute_entropy_loss); a run's loss
    subtracts entropy_coeff times it."""
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)


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


# --- TRL's names -------------------------------------------------------------------------------------------------

TRL_LOSS_TYPES = {   # TRL GRPOConfig.loss_type -> (loss_mode, loss_agg_mode)
    "grpo": ("vanilla", "seq-mean-token-mean"), "bnpo": ("vanilla", "token-mean"), "dapo": ("vanilla", "token-mean"),
    "dr_grpo": ("vanilla", "seq-mean-token-sum-norm"), "cispo": ("cispo", "token-mean"),
    "sapo": ("sapo", "seq-mean-token-mean"),
}


def from_trl(loss_type: str, importance_sampling_level: str = "token", epsilon: float = 0.2,
             epsilon_high: float | None = None) -> dict:
    """TRL GRPOConfig's loss names -> this registry's: {loss_mode, loss_agg_mode, clip_ratio_low, clip_ratio_high}.
    importance_sampling_level=sequence is GSPO; cispo's epsilon_high is TRL's cap on the ratio (1 + clip_ratio_high,
    no lower clip). luspo and vespo have no verl counterpart and are refused."""
    if loss_type not in TRL_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type} has no counterpart here; valid: {', '.join(TRL_LOSS_TYPES)}")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level must be token or sequence, got {importance_sampling_level!r}")
    mode, agg = TRL_LOSS_TYPES[loss_type]
    high = epsilon if epsilon_high is None else epsilon_high
    if importance_sampling_level == "sequence":
        if mode != "vanilla":
            raise ValueError(f"importance_sampling_level=sequence (GSPO) applies to the clipped losses (loss_type "
                             f"grpo, bnpo, dapo, dr_grpo), not loss_type={loss_type}")
        mode = "gspo"
    if mode == "sapo":   # its temperatures are TRL's sapo_temperature_pos / _neg: tau_pos / tau_neg
        return dict(loss_mode=mode, loss_agg_mode=agg)
    if mode == "cispo":
        return dict(loss_mode=mode, loss_agg_mode=agg, clip_ratio_low=1.0, clip_ratio_high=high - 1.0)
    return dict(loss_mode=mode, loss_agg_mode=agg, clip_ratio_low=epsilon, clip_ratio_high=high)
