"""Rollout correction: the rollout engine (vLLM, bf16 kernels) and the trainer score the same tokens with slightly
different log-probs; importance weights (IS) and rejection masks (RS) correct the loss for it, on padded [B, T].

`rollout_correction` follows verl 0.9.1's `verl/trainer/ppo/rollout_corr_helper.py` semantics and names
(`compute_rollout_correction_and_rejection_mask`: rollout_is, rollout_is_threshold, rollout_is_batch_normalize,
rollout_rs, rollout_rs_threshold and its "rollout_corr/..." metrics); weights and masks equal verl's to 1e-10
(tests/algo/test_rollout_correction.py). `mismatch_metrics` is the diagnostic to log at every step. No I/O.
"""

from __future__ import annotations

import math

import torch

from .advantages import EPS, masked_mean

SAFETY_BOUND = 20.0   # verl clamps log-ratios to [-20, 20] before exp (exp(20) ≈ 4.9e8)
ROLLOUT_IS_LEVELS = ("token", "sequence")
# verl's SUPPORTED_ROLLOUT_RS_OPTIONS: "<level>_<estimator>"; a seq_max of k1 (a log-ratio, signed) is not offered
ROLLOUT_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                      "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
RATIO_RANGE = (0.5, 2.0)   # mismatch_metrics counts the tokens whose ratio π_trainer / π_rollout leaves this range


# --- thresholds, as verl parses them ----------------------------------------------------------------------------

def _numbers(spec: str, what: str, example: str) -> tuple[float | None, float]:
    """'u' -> (None, u); 'l_u' -> (l, u), split at the first '_' as verl does."""
    lower_text, sep, upper_text = spec.strip().partition("_")
    try:
        return (float(lower_text) if sep else None), float(upper_text if sep else lower_text)
    except ValueError:
        raise ValueError(f"{what} {spec!r} is not a number or a 'lower_upper' pair of numbers; write e.g. "
                         f"{example}") from None


def _check_bounds(lower: float | None, upper: float, what: str) -> None:
    # `not x > 0` also refuses NaN, which verl lets through (then every comparison with it is False)
    if not upper > 0:
        raise ValueError(f"{what}: the upper bound must be a positive number, got {upper}")
    if lower is not None and not 0 < lower <= upper:
        raise ValueError(f"{what}: the bounds must satisfy 0 < lower <= upper, got lower={lower}, upper={upper}")


def parse_is_threshold(spec: float | str) -> tuple[float | None, float]:
    """verl's rollout_is_threshold -> (lower, upper). A number, or a string of one (2.0, "2.0"): TIS, the weights
    truncated at upper (lower None). A string "lower_upper" ("0.5_5.0"): IcePop, weights outside [lower, upper]
    set to 0 (the tokens stay in the response mask)."""
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise TypeError(f"rollout_is_threshold must be a number (TIS, e.g. 2.0) or a 'lower_upper' string (IcePop, "
                        f"e.g. '0.5_5.0'), got {spec!r} of type {type(spec).__name__}")
    lower, upper = (None, float(spec)) if not isinstance(spec, str) else _numbers(spec, "rollout_is_threshold",
                                                                                  "2.0 or '0.5_5.0'")
    _check_bounds(lower, upper, f"rollout_is_threshold={spec!r}")
    return lower, upper


def parse_rs_options(rollout_rs: str) -> tuple[str, ...]:
    """verl's rollout_rs: comma-separated options, all of which a token must pass; repeats dropped, order kept."""
    if not isinstance(rollout_rs, str):
        raise TypeError(f"rollout_rs must be a string of comma-separated options, got {rollout_rs!r}")
    options = tuple(dict.fromkeys(part.strip() for part in rollout_rs.split(",") if part.strip()))
    unknown = [o for o in options if o not in ROLLOUT_RS_OPTIONS]
    if unknown or not options:
        problem = f"unknown option(s) {', '.join(unknown)}" if unknown else "no option named"
        raise ValueError(f"rollout_rs={rollout_rs!r}: {problem}; valid: {', '.join(ROLLOUT_RS_OPTIONS)}, "
                         f"comma-separated to combine (e.g. 'token_k1,seq_mean_k3'), or None for no rejection")
    return options


def parse_rs_thresholds(options: tuple[str, ...], spec: float | str) -> dict[str, tuple[float | None, float]]:
    """verl's rollout_rs_threshold -> {option: (lower, upper)}: one entry per option, comma-separated in the order
    of `options`, or one entry shared by all. A k1 option takes a ratio range "lower_upper", or a number u meaning
    [1/u, u]; a k2 / k3 option takes one upper bound (lower None)."""
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise TypeError(f"rollout_rs_threshold must be a number or a string (e.g. '0.5_2.0,0.01'), got {spec!r}")
    parts = [str(spec)] if not isinstance(spec, str) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(parts) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold={spec!r} has {len(parts)} entries for {len(options)} rollout_rs "
                         f"options {list(options)}; give one shared entry or one per option, comma-separated")
    thresholds = {}
    for option, part in zip(options, parts * len(options) if len(parts) == 1 else parts):
        what = f"rollout_rs_threshold {part!r} for {option}"
        if option.endswith("k1"):
            lower, upper = _numbers(part, what, "'0.5_2.0' or 2.0 (meaning 0.5_2.0)")
            if lower is None:
                if not upper >= 1:
                    raise ValueError(f"{what}: one number u means the ratio range [1/u, u], so u must be >= 1, got "
                                     f"{upper}; give a 'lower_upper' range for another one")
                lower = 1.0 / upper
        else:
            if "_" in part:
                raise ValueError(f"{what}: {option} takes one upper bound (a divergence), not a 'lower_upper' "
                                 f"pair; only the k1 options take a ratio range")
            lower, upper = _numbers(part, what, "0.01")
        _check_bounds(lower, upper, what)
        thresholds[option] = (lower, upper)
    return thresholds


# --- the correction ---------------------------------------------------------------------------------------------

def _masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, values, 0.0).sum(-1)


def _mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """verl's masked mean, sum / (count + 1e-8), the count in the values' dtype: a bool mask's integer count would
    add the 1e-8 in float32, i.e. drop it."""
    return masked_mean(values, mask.to(values.dtype), axis)


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def _importance_weights(log_ratio, mask, level, lower, upper):
    """[B, T] weights π_trainer / π_rollout (token) or their product over the response (sequence), truncated at
    upper (TIS) or zeroed outside [lower, upper] (IcePop), 0 off the mask; and verl's metrics of them."""
    log_w = log_ratio if level == "token" else _masked_sum(log_ratio, mask).unsqueeze(-1)
    raw = torch.where(mask, torch.exp(log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio), 0.0)
    in_range = (raw >= lower) & (raw <= upper) if lower is not None else None
    weights = raw.clamp(max=upper) if lower is None else torch.where(in_range, raw, 0.0)

    low = 1.0 / upper if lower is None else lower   # the "fraction low" of TIS is counted against 1 / upper
    m = {"rollout_is_mean": _mean(weights, mask)}
    if level == "token":
        m["rollout_is_max"] = weights[mask].max()
        m["rollout_is_min"] = weights[mask].min()
        m["rollout_is_ratio_fraction_high"] = _mean((raw > upper).to(raw.dtype), mask)
        m["rollout_is_ratio_fraction_low"] = _mean((raw < low).to(raw.dtype), mask)
    else:   # over the responses, on the unclamped log-weights (verl's max is capped at exp(20), its min is not)
        log_seq = log_w.squeeze(-1)[mask.any(-1)]
        m["rollout_is_max"] = torch.exp(log_seq.max().clamp(max=SAFETY_BOUND))
        m["rollout_is_min"] = torch.exp(log_seq.min())
        m["rollout_is_ratio_fraction_high"] = (log_seq > _log(upper)).to(raw.dtype).mean()
        m["rollout_is_ratio_fraction_low"] = (log_seq < _log(low)).to(raw.dtype).mean()
    # weights already lie in [0, upper], so verl's clamp before std and ESS changes nothing
    mean = _mean(weights, mask)
    var = _mean(weights.square(), mask) - mean.square()
    m["rollout_is_std"] = var.clamp(min=0.0).sqrt() if mask.sum() > 1 else 0.0
    second = _mean((weights / (mean + EPS)).square(), mask)
    m["rollout_is_eff_sample_size"] = 1.0 / second if second > 0 else 0.0   # all weights 0 (IcePop): none effective
    if in_range is not None:
        m["rollout_is_oob_ratio"] = _mean((~in_range).to(raw.dtype), mask)
    return weights, m


def _batch_normalize(weights, mask, level):
    """Weights / their batch mean: over tokens (token), over responses, each once (sequence); unchanged where that
    mean is <= 1e-8. verl all-reduces this mean across data-parallel ranks; here it is the batch given."""
    if level == "token":
        mean = _mean(weights, mask)
    else:
        has_tokens = mask.any(-1)
        mean = _mean(weights, mask, axis=-1)[has_tokens].sum() / has_tokens.sum().clamp(min=1)
    if mean > EPS:
        return weights / mean, float(mean)
    return weights, 1.0


def _rejection(log_ratio, mask, option, lower, upper):
    """Keep [B, T] bool of one rollout_rs option, and verl's metrics of its statistic."""
    level, estimator = option.rsplit("_", 1)
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    # KL(π_rollout || π_trainer) per token, for tokens drawn from the rollout: k1 = log π_rollout - log π_trainer
    divergence = {"k1": -lr, "k2": 0.5 * lr.square(), "k3": torch.exp(lr) - 1.0 - lr}[estimator]
    if level == "token":
        stat = divergence
    elif level == "seq_sum":
        stat = _masked_sum(divergence, mask).unsqueeze(-1)
    elif level == "seq_mean":
        stat = _mean(divergence, mask, axis=-1).unsqueeze(-1)
    else:   # seq_max; a response without tokens gets 0
        stat = torch.where(mask, divergence, -torch.inf).max(-1, keepdim=True).values
        stat = torch.where(stat == -torch.inf, 0.0, stat)
    # k1's bounds are on the ratio π_rollout / π_trainer (the exp of its statistic), so they are compared in log space
    keep = (stat >= math.log(lower)) & (stat <= math.log(upper)) if estimator == "k1" else stat <= upper
    keep = keep.expand_as(mask)

    judged = stat[mask] if level == "token" else stat.squeeze(-1)[mask.any(-1)]   # the tokens or the responses
    return keep, {
        f"rollout_rs_{option}_mean": _mean(stat.expand_as(mask), mask),
        f"rollout_rs_{option}_max": judged.max(),
        f"rollout_rs_{option}_min": judged.min(),
        **_rejected_fractions(f"rollout_rs_{option}", keep, mask),
    }


def _rejected_fractions(prefix, keep, mask):
    has_tokens = mask.any(-1)
    return {f"{prefix}_masked_fraction": _mean((~keep).to(torch.float64), mask),
            f"{prefix}_seq_masked_fraction": (mask & ~keep).any(-1)[has_tokens].to(torch.float64).mean()}


def rollout_correction(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                       rollout_is: str | None = None, rollout_is_threshold: float | str = 2.0,
                       rollout_is_batch_normalize: bool = False, rollout_rs: str | None = None,
                       rollout_rs_threshold: float | str | None = None,
                       ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """verl's compute_rollout_correction_and_rejection_mask on [B, T] tensors -> (is_weights [B, T] or None,
    response_mask [B, T] with the rejected tokens cleared, metrics). The log-ratio is log π_trainer - log π_rollout
    (old_log_prob - rollout_log_prob); each log-ratio, or a response's sum of them, is clamped to [-20, 20].

    rollout_is (None: no weights): "token", w_t = π_trainer / π_rollout per token; "sequence", the product over the
    response on each of its tokens. rollout_is_threshold (parse_is_threshold): a number u truncates weights at u
    (TIS); "l_u" sets weights outside [l, u] to 0 (IcePop; the response mask is left as it is). Weights are
    detached and 0 off the mask. rollout_is_batch_normalize divides them by their mean after that (over tokens,
    or over responses for "sequence"), so they may exceed u.
    rollout_rs (None: no rejection): ROLLOUT_RS_OPTIONS, comma-separated, every one must pass: <level>_<k>, level
    token (per token), seq_sum / seq_mean / seq_max (a response's sum / mean / max of the per-token estimate,
    rejecting the whole response), k of KL(π_rollout || π_trainer): k1 = -log-ratio, k2 = log-ratio² / 2,
    k3 = exp(log-ratio) - 1 - log-ratio. rollout_rs_threshold (parse_rs_thresholds): k2 / k3 keep values <= u;
    k1 keeps log(l) <= value <= log(u), i.e. π_rollout / π_trainer in [l, u] (the inverse of the IS ratio).

    Metrics, verl's keys and values, prefixed "rollout_corr/": rollout_is_{mean, max, min, std,
    eff_sample_size, ratio_fraction_high, ratio_fraction_low} (before batch normalization; fraction_high is
    the fraction of tokens, or of responses for "sequence", above u: truncated), rollout_is_oob_ratio (IcePop),
    rollout_is_batch_norm_factor; per rs option
    rollout_rs_<option>_{mean, max, min, masked_fraction, seq_masked_fraction}, and the rejected fractions of
    all together, rollout_rs_masked_fraction (tokens) and rollout_rs_seq_masked_fraction (responses). Statistics
    over responses count the responses with tokens (verl counts empty rows too, as responses with weight 1).
    verl's per-option std / fraction_high / fraction_low and rollout_is_seq_* breakdowns are left out; its
    off-policy metrics (kl, k3_kl, log_ppl_diff, chi2_token) are `mismatch_metrics`'.
    Refused where verl is silent: rollout_is with rollout_is_threshold None (verl skips IS; use float("inf") for
    untruncated weights), rollout_rs_threshold or rollout_is_batch_normalize with nothing to apply them to.
    """
    if not (old_log_prob.shape == rollout_log_prob.shape == response_mask.shape) or old_log_prob.dim() != 2:
        raise ValueError(f"old_log_prob, rollout_log_prob and response_mask must all be [B, T], got "
                         f"{[tuple(x.shape) for x in (old_log_prob, rollout_log_prob, response_mask)]}")
    mask = response_mask.bool()
    if not mask.any():
        raise ValueError("response_mask has no token: there is nothing to correct; skip the call for an empty batch")
    if rollout_is is not None and rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout_is={rollout_is!r} is not a level; valid: {', '.join(ROLLOUT_IS_LEVELS)}, or None "
                         f"for no importance weights")
    if rollout_is is not None and rollout_is_threshold is None:
        raise ValueError(f"rollout_is={rollout_is!r} needs rollout_is_threshold (a number, e.g. 2.0, or 'lower_upper'"
                         f"); for weights without truncation use float('inf'), for none rollout_is=None")
    if rollout_is is None and rollout_is_batch_normalize:
        raise ValueError("rollout_is_batch_normalize=True normalizes importance weights, but rollout_is is None; set "
                         "rollout_is to 'token' or 'sequence', or leave rollout_is_batch_normalize False")
    if rollout_rs is None and rollout_rs_threshold is not None:
        raise ValueError(f"rollout_rs_threshold={rollout_rs_threshold!r} is given but rollout_rs is None, so nothing "
                         f"would be rejected; set rollout_rs (valid: {', '.join(ROLLOUT_RS_OPTIONS)}) or drop it")
    if rollout_rs is not None and rollout_rs_threshold is None:
        raise ValueError(f"rollout_rs={rollout_rs!r} needs rollout_rs_threshold (e.g. '0.5_2.0' for a k1 option, "
                         f"0.01 for k2 / k3)")
    # parsed before any tensor work, so a bad option fails whatever the data
    is_bounds = parse_is_threshold(rollout_is_threshold) if rollout_is is not None else None
    rs_options = parse_rs_options(rollout_rs) if rollout_rs is not None else ()
    rs_bounds = parse_rs_thresholds(rs_options, rollout_rs_threshold) if rs_options else {}

    log_ratio = (old_log_prob - rollout_log_prob).detach()   # weights change the measure, not the objective
    metrics: dict = {}
    weights = None
    if rollout_is is not None:
        weights, metrics = _importance_weights(log_ratio, mask, rollout_is, *is_bounds)
        if rollout_is_batch_normalize:
            weights, metrics["rollout_is_batch_norm_factor"] = _batch_normalize(weights, mask, rollout_is)

    keep = torch.ones_like(mask)
    for option in rs_options:
        kept, option_metrics = _rejection(log_ratio, mask, option, *rs_bounds[option])
        keep &= kept
        metrics.update(option_metrics)
    if rs_options:
        metrics.update(_rejected_fractions("rollout_rs", keep, mask))
    return weights, response_mask.masked_fill(~keep, 0), {f"rollout_corr/{k}": float(v) for k, v in metrics.items()}


# --- the diagnostic ---------------------------------------------------------------------------------------------

def _quantile(sorted_values: torch.Tensor, q: float) -> torch.Tensor:
    """Linear interpolation between order statistics (numpy's default); torch.quantile refuses > 2^24 values."""
    pos = q * (sorted_values.numel() - 1)
    lo, hi = sorted_values[math.floor(pos)], sorted_values[math.ceil(pos)]
    return lo + (hi - lo) * (pos - math.floor(pos))


def mismatch_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                     buckets: tuple[int, ...] = (0, 16, 64, 256, 1024)) -> dict[str, float]:
    """How far the trainer's log-probs (old_log_prob [B, T]) are from the rollout engine's (rollout_log_prob) on the
    tokens of response_mask, in float64. Keys "mismatch/...":
    abs_diff_mean, abs_diff_p99 (linear interpolation), abs_diff_max: |log π_trainer - log π_rollout| per token;
    kl_k1 = mean(log π_rollout - log π_trainer) and kl_k3 = mean(r - log r - 1), r = π_trainer / π_rollout:
      KL(π_rollout || π_trainer) from the rollout's tokens; verl's off-policy metrics "kl" and "k3_kl" (equal);
      kl_k3 is verl's low_var_kl without its clamp to [-10, 10] (kl_penalty), so a large gap shows in full;
    ratio_out_of_range_frac: the tokens whose r leaves [0.5, 2] (RATIO_RANGE);
    log_ppl_diff, log_ppl_abs_diff: the mean over responses of log(ppl_trainer / ppl_rollout) (its absolute
      value), a response's mean log-prob gap; verl's keys of those names (equal; verl's ppl_ratio is the mean of its
      exp); chi2_token = mean(r² - 1) (r from the log-ratio clamped to ±20), verl's to 1e-8 / tokens;
    abs_diff_mean_pos_<lo>_<hi>: abs_diff_mean over the tokens at positions [lo, hi) of the response (the column
      of the padded row, tool tokens included in the count), the last bucket open: pos_1024_inf; a bucket without
      tokens is left out.
    Means over tokens and responses count only the tokens of the mask and the responses with one; with no token
    every key is 0. Identical log-probs give 0 everywhere.
    """
    if not (old_log_prob.shape == rollout_log_prob.shape == response_mask.shape) or old_log_prob.dim() != 2:
        raise ValueError(f"old_log_prob, rollout_log_prob and response_mask must all be [B, T], got "
                         f"{[tuple(x.shape) for x in (old_log_prob, rollout_log_prob, response_mask)]}")
    if not buckets or buckets[0] < 0 or any(b <= a for a, b in zip(buckets, buckets[1:])):
        raise ValueError(f"buckets must be increasing token positions from >= 0 (bucket i is [b_i, b_i+1), the last "
                         f"open), e.g. (0, 16, 64, 256, 1024); got {tuple(buckets)}")
    mask = response_mask.bool()
    log_ratio = torch.where(mask, old_log_prob.detach().double() - rollout_log_prob.detach().double(), 0.0)
    abs_diff = log_ratio.abs()
    diffs = abs_diff[mask].sort().values
    ratio = torch.exp(log_ratio)
    out_of_range = (ratio < RATIO_RANGE[0]) | (ratio > RATIO_RANGE[1])
    has_tokens = mask.any(-1)
    log_ppl_diff = _mean(-log_ratio, mask, axis=-1)[has_tokens]   # = mean log π_rollout - mean log π_trainer
    metrics = {
        "abs_diff_mean": _mean(abs_diff, mask),
        "abs_diff_p99": _quantile(diffs, 0.99) if diffs.numel() else 0.0,
        "abs_diff_max": diffs[-1] if diffs.numel() else 0.0,
        "kl_k1": _mean(-log_ratio, mask),
        "kl_k3": _mean(torch.exp(log_ratio) - log_ratio - 1.0, mask),
        "ratio_out_of_range_frac": _mean(out_of_range.double(), mask),
        "log_ppl_diff": log_ppl_diff.mean() if has_tokens.any() else 0.0,
        "log_ppl_abs_diff": log_ppl_diff.abs().mean() if has_tokens.any() else 0.0,
        # verl: masked_mean(r²) - 1, which its 1e-8 in the count leaves at -1e-8 / tokens for identical log-probs
        "chi2_token": _mean(torch.exp(2 * log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) - 1.0, mask),
    }
    position = torch.arange(mask.shape[1], device=mask.device)
    for lo, hi in zip(buckets, (*buckets[1:], math.inf)):
        in_bucket = mask & (position >= lo) & (position < hi)
        if in_bucket.any():
            name = f"abs_diff_mean_pos_{lo}_{'inf' if hi == math.inf else hi}"
            metrics[name] = _mean(abs_diff, in_bucket)
    return {f"mismatch/{k}": float(v) for k, v in metrics.items()}
