"""hetrl.algo.rollout_correction against verl 0.9.1's rollout_corr_helper: the same fp64 log-probs (ragged masks with
holes, responses without tokens, gaps of ±3 and +25 nats on a few tokens so that truncation and rejection trigger,
garbage in the padding) into verl's compute_rollout_correction_and_rejection_mask and ours. Weights and masks agree
to 1e-10 (relative to max(1, |w|)) for every rollout_is level, rollout_rs option and threshold form verl parses, and
every preset of verl's RolloutCorrectionConfig; metrics too, against verl on the rows with tokens (verl counts a row
without tokens as a response of weight 1). mismatch_metrics: by hand on a tiny batch, and against verl's off-policy
metrics. verl is installed without its dependencies; its helper needs tensordict and transformers to import."""

from __future__ import annotations

import ast
import inspect
import math
import re

import pytest
import torch

from hetrl.algo import ROLLOUT_IS_LEVELS, ROLLOUT_RS_OPTIONS, mismatch_metrics, rollout_correction

TOL = 1e-10
SEEDS = (0, 1, 2)
MAX_DIFF: dict[str, float] = {}   # the largest relative difference seen per kind (printed with -s)
# verl takes these means of float32 tensors (`.float().mean()`): k/6 is then off by ~1e-8
FLOAT32_IN_VERL = {"rollout_corr/rollout_rs_seq_masked_fraction", "rollout_corr/rollout_is_ratio_fraction_high",
                   "rollout_corr/rollout_is_ratio_fraction_low"}


def _verl():
    return pytest.importorskip("verl.trainer.ppo.rollout_corr_helper",
                               reason="verl (and tensordict, transformers) needed")


def _batch(seed: int, b: int = 8, t: int = 24):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lens[:, None]) & (torch.rand(b, t, generator=g) > 0.15)   # holes: tool tokens
    mask[:, 0] = True
    mask[1] = mask[-1] = False                                    # responses without tokens
    rollout = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4
    old = rollout + 0.05 * torch.randn(b, t, generator=g, dtype=torch.float64)
    old[0, 0] += 3.0      # the trainer far likelier than the rollout: truncated, rejected
    old[2, 0] -= 3.0      # far less likely
    old[3, 0] += 25.0     # beyond verl's ±20 clamp of log-ratios
    old[~mask] += 50.0    # padding: never read
    return old, rollout, mask.double()


def _diff(kind: str, ours: torch.Tensor | float, theirs: torch.Tensor | float) -> float:
    ours, theirs = torch.as_tensor(ours, dtype=torch.float64), torch.as_tensor(theirs, dtype=torch.float64)
    d = float(((ours - theirs).abs() / theirs.abs().clamp(min=1.0)).max()) if ours.numel() else 0.0
    MAX_DIFF[kind] = max(MAX_DIFF.get(kind, 0.0), d)
    return d


def _assert_equal_verl(opts: dict, seed: int):
    """Ours and verl's on one batch: weights, mask, and every metric key we report (on the rows with tokens)."""
    helper = _verl()
    old, rollout, mask = _batch(seed)
    ours_w, ours_mask, ours_m = rollout_correction(old, rollout, mask, **opts)
    theirs_w, theirs_mask, _ = helper.compute_rollout_correction_and_rejection_mask(old, rollout, mask, **opts)
    assert (ours_w is None) == (theirs_w is None)
    if ours_w is not None:
        assert not ours_w.requires_grad
        assert _diff("weights", ours_w, theirs_w.batch["rollout_is_weights"]) <= TOL
    assert ours_mask.dtype == mask.dtype and torch.equal(ours_mask, theirs_mask)

    rows = mask.bool().any(-1)
    _, _, theirs_m = helper.compute_rollout_correction_and_rejection_mask(old[rows], rollout[rows], mask[rows], **opts)
    for key, value in ours_m.items():
        assert key in theirs_m, key
        if key in FLOAT32_IN_VERL:
            assert _diff("metrics verl takes in float32", value, theirs_m[key]) <= 1e-7, key
        else:
            assert _diff("metrics", value, theirs_m[key]) <= TOL, key
    return ours_w, ours_mask, ours_m, mask


# --- importance weights ---------------------------------------------------------------------------------------

IS_THRESHOLDS = [2.0, 2, "2.0", " 1.5 ", "0.5_2.0", "0.8_1.25", float("inf")]   # TIS as float / int / str, IcePop


def test_our_levels_and_options_are_verls():
    helper = _verl()
    levels = re.search(r"valid_is_levels = (\{[^}]*\})", inspect.getsource(helper.compute_rollout_correction_weights))
    assert set(ROLLOUT_IS_LEVELS) == ast.literal_eval(levels.group(1))
    assert set(ROLLOUT_RS_OPTIONS) == helper.SUPPORTED_ROLLOUT_RS_OPTIONS


@pytest.mark.parametrize("batch_normalize", [False, True])
@pytest.mark.parametrize("threshold", IS_THRESHOLDS, ids=repr)
@pytest.mark.parametrize("level", ROLLOUT_IS_LEVELS)
def test_importance_weights_equal_verl(level, threshold, batch_normalize):
    opts = dict(rollout_is=level, rollout_is_threshold=threshold, rollout_is_batch_normalize=batch_normalize)
    icepop = isinstance(threshold, str) and "_" in threshold
    upper = float(threshold.split("_")[-1]) if isinstance(threshold, str) else float(threshold)
    for seed in SEEDS:
        weights, _, metrics, mask = _assert_equal_verl(opts, seed)
        on_mask = weights[mask.bool()]
        assert (weights[~mask.bool()] == 0).all()
        if icepop:                                           # out-of-range weights are zeroed, the mask kept
            assert metrics["rollout_corr/rollout_is_oob_ratio"] > 0 and (on_mask == 0).any()
        elif math.isfinite(upper):                           # truncation happened
            assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] > 0
            if not batch_normalize:
                assert on_mask.max() == upper
        if batch_normalize:   # mean 1 over tokens (token) or over responses (sequence), to verl's 1e-8 in counts
            assert metrics["rollout_corr/rollout_is_batch_norm_factor"] != 1.0
            units = on_mask if level == "token" else weights.max(-1).values[mask.bool().any(-1)]
            assert abs(float(units.mean()) - 1.0) <= 1e-8


# --- rejection ------------------------------------------------------------------------------------------------

# per option an upper bound that keeps the ±0.05 noise and rejects the ±3 / +25 gaps; k1 also as a ratio range
RS_UPPER = {"token_k1": 2.0, "seq_sum_k1": 2.0, "seq_mean_k1": 1.1, "token_k2": 0.5, "token_k3": 0.5,
            "seq_sum_k2": 1, "seq_sum_k3": 1.0, "seq_mean_k2": 0.05, "seq_mean_k3": 0.05, "seq_max_k2": 0.5,
            "seq_max_k3": 0.5}
RS_RANGE = {"token_k1": "0.8_1.5", "seq_sum_k1": "0.6_1.5", "seq_mean_k1": "0.95_1.1"}
RS_CASES = ([(o, RS_UPPER[o]) for o in ROLLOUT_RS_OPTIONS] + [(o, f" {RS_UPPER[o]} ") for o in ROLLOUT_RS_OPTIONS]
            + list(RS_RANGE.items())
            + [("token_k1,seq_mean_k3", "0.5_2.0,0.05"),            # one threshold per option
               ("token_k2, seq_max_k3 ,token_k2", 0.5),             # spaces and a repeat; one number for both
               ("seq_sum_k1,seq_mean_k1", "1.1"),                   # one k1 string shared: [1/1.1, 1.1]
               ("token_k3,seq_sum_k2,seq_mean_k1", "0.5, 1.0, 0.95_1.1")])


def test_every_rs_option_is_covered():
    assert {o for options, _ in RS_CASES for o in options.replace(" ", "").split(",")} == set(ROLLOUT_RS_OPTIONS)
    assert set(RS_RANGE) == {o for o in ROLLOUT_RS_OPTIONS if o.endswith("k1")}


@pytest.mark.parametrize("options,threshold", RS_CASES, ids=repr)
def test_rejection_mask_equals_verl(options, threshold):
    for seed in SEEDS:
        weights, kept, metrics, mask = _assert_equal_verl(dict(rollout_rs=options, rollout_rs_threshold=threshold),
                                                          seed)
        assert weights is None
        assert 0 < kept.sum() < mask.sum(), "rejection should trigger and keep some tokens"
        assert metrics["rollout_corr/rollout_rs_masked_fraction"] > 0
        assert ((kept == 1) <= (mask == 1)).all()


@pytest.mark.parametrize("level", ROLLOUT_IS_LEVELS)
def test_weights_and_rejection_together_equal_verl(level):
    for seed in SEEDS:
        _assert_equal_verl(dict(rollout_is=level, rollout_is_threshold="0.5_5.0", rollout_is_batch_normalize=True,
                                rollout_rs="token_k1,seq_max_k2", rollout_rs_threshold="0.5_2.0,0.5"), seed)


def test_every_verl_preset_equals_verl():
    _verl()
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    presets = [name for name, v in vars(RolloutCorrectionConfig).items() if isinstance(v, classmethod)]
    assert len(presets) >= 15
    for name in presets:
        cfg = getattr(RolloutCorrectionConfig, name)()
        opts = {k: getattr(cfg, k) for k in ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize",
                                             "rollout_rs", "rollout_rs_threshold")}
        _assert_equal_verl(opts, seed=len(name))


def test_a_bool_mask_gives_the_float_masks_result():
    old, rollout, mask = _batch(4)
    opts = dict(rollout_is="sequence", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.05)
    w_float, kept_float, m_float = rollout_correction(old, rollout, mask, **opts)
    w_bool, kept_bool, m_bool = rollout_correction(old, rollout, mask.bool(), **opts)
    assert kept_bool.dtype == torch.bool and torch.equal(kept_bool, kept_float.bool())
    assert torch.equal(w_bool, w_float) and m_bool == m_float


# --- refusals -------------------------------------------------------------------------------------------------

BOTH_REFUSE = [   # (options, error, what our message says); verl raises the same error class
    (dict(rollout_is="geometric"), ValueError, "valid: token, sequence"),
    (dict(rollout_rs="token_k4", rollout_rs_threshold=2.0), ValueError, "valid: token_k1, token_k2"),
    (dict(rollout_rs="seq_max_k1", rollout_rs_threshold=2.0), ValueError, "unknown option"),
    (dict(rollout_rs=" , ", rollout_rs_threshold=2.0), ValueError, "no option named"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold=None), ValueError, "needs rollout_rs_threshold"),
    (dict(rollout_is="token", rollout_is_threshold="abc"), ValueError, "not a number"),
    (dict(rollout_is="token", rollout_is_threshold="2.0_"), ValueError, "not a number"),
    (dict(rollout_is="token", rollout_is_threshold="2_0.5"), ValueError, "0 < lower <= upper"),
    (dict(rollout_is="token", rollout_is_threshold="0_2"), ValueError, "0 < lower <= upper"),
    (dict(rollout_is="token", rollout_is_threshold=-1.0), ValueError, "positive"),
    (dict(rollout_is="token", rollout_is_threshold=True), TypeError, "a number"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold="0.5_2"), ValueError, "one upper bound"),
    (dict(rollout_rs="token_k1,token_k2", rollout_rs_threshold="0.5_2,0.1,0.3"), ValueError, "3 entries for 2"),
    (dict(rollout_rs="token_k1,token_k1", rollout_rs_threshold="0.5_2,1.5"), ValueError, "2 entries for 1"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold=0.5), ValueError, "u must be >= 1"),  # [2, 0.5]
    (dict(rollout_rs="seq_sum_k1", rollout_rs_threshold="inf"), ValueError, "0 < lower"),   # [0, inf]
    (dict(rollout_rs="seq_mean_k3", rollout_rs_threshold="x"), ValueError, "not a number"),
    (dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=[0.1]), TypeError, "a number or a string"),
]


@pytest.mark.parametrize("opts,error,message", BOTH_REFUSE, ids=lambda x: repr(x) if isinstance(x, dict) else "")
def test_bad_options_are_refused_as_verl_does(opts, error, message):
    old, rollout, mask = _batch(0)
    with pytest.raises(error, match=re.escape(message)):
        rollout_correction(old, rollout, mask, **opts)
    helper = _verl()
    with pytest.raises(error):
        helper.compute_rollout_correction_and_rejection_mask(old, rollout, mask, **opts)


OURS_REFUSE = [   # where verl silently does something else
    (dict(rollout_is="token", rollout_is_threshold=None), "float('inf')"),     # verl: no weights at all
    (dict(rollout_rs_threshold="0.5_2.0"), "rollout_rs is None"),               # verl: ignored
    (dict(rollout_is_batch_normalize=True), "rollout_is is None"),              # verl: ignored
    (dict(rollout_is="token", rollout_is_threshold=float("nan")), "positive"),  # verl: every weight nan
    (dict(rollout_rs="token_k3", rollout_rs_threshold="nan"), "positive"),      # verl: every token rejected
]


@pytest.mark.parametrize("opts,message", OURS_REFUSE, ids=lambda x: repr(x) if isinstance(x, dict) else "")
def test_options_verl_would_silently_drop_are_refused(opts, message):
    old, rollout, mask = _batch(0)
    with pytest.raises(ValueError, match=re.escape(message)):
        rollout_correction(old, rollout, mask, **opts)


def test_bad_shapes_and_an_empty_mask_are_refused():
    old, rollout, mask = _batch(0)
    with pytest.raises(ValueError, match="must all be"):
        rollout_correction(old, rollout[:, :-1], mask)
    with pytest.raises(ValueError, match="no token"):
        rollout_correction(old, rollout, torch.zeros_like(mask), rollout_is="token")
    with pytest.raises(ValueError, match="increasing"):
        mismatch_metrics(old, rollout, mask, buckets=(0, 64, 16))


# --- mismatch_metrics -----------------------------------------------------------------------------------------

def test_mismatch_metrics_by_hand():
    # log π_trainer - log π_rollout per token; row 1 has a hole at position 1, row 2 no token
    gaps = torch.tensor([[0.5, -1.0, 0.0, 9.0], [0.2, 7.0, 0.0, 9.0], [3.0, 3.0, 3.0, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    rollout = -torch.linspace(0.1, 2.0, 12, dtype=torch.float64).view(3, 4)
    m = mismatch_metrics(rollout + gaps, rollout, mask, buckets=(0, 1, 2))
    tokens = [0.5, -1.0, 0.0, 0.2, 0.0]
    expected = {
        "mismatch/abs_diff_mean": 1.7 / 5, "mismatch/abs_diff_max": 1.0,
        "mismatch/abs_diff_p99": 0.5 + 0.96 * (1.0 - 0.5),                   # sorted 0, 0, .2, .5, 1; rank 3.96
        "mismatch/kl_k1": 0.3 / 5,
        "mismatch/kl_k3": sum(math.exp(x) - x - 1 for x in tokens) / 5,
        "mismatch/ratio_out_of_range_frac": 1 / 5,                           # exp(-1) < 0.5
        "mismatch/log_ppl_diff": (-(-0.5 / 3) + -0.1) / 2,                   # rows 0 and 1: -mean gap
        "mismatch/log_ppl_abs_diff": (0.5 / 3 + 0.1) / 2,
        "mismatch/chi2_token": sum(math.exp(2 * x) - 1 for x in tokens) / 5,
        "mismatch/abs_diff_mean_pos_0_1": 0.35, "mismatch/abs_diff_mean_pos_1_2": 1.0,
        "mismatch/abs_diff_mean_pos_2_inf": 0.0,
    }
    assert m.keys() == expected.keys()
    for key, value in expected.items():
        assert abs(m[key] - value) <= 1e-8, key   # the means divide by tokens + 1e-8, as verl's


def test_identical_log_probs_and_an_empty_mask_give_zeros():
    old, _, mask = _batch(1)
    same = mismatch_metrics(old, old.clone(), mask)
    assert same and all(v == 0.0 for v in same.values()), same
    empty = mismatch_metrics(old, old - 1.0, torch.zeros_like(mask))
    assert empty and all(v == 0.0 for v in empty.values()), empty
    assert not any("_pos_" in k for k in empty)


def test_position_buckets_default_names():
    t = 1100
    mask = torch.zeros(2, t)
    mask[0, [3, 20, 100, 300, 1050]] = 1
    old = torch.zeros(2, t, dtype=torch.float64)
    old[0, 1050] = 0.7
    m = mismatch_metrics(old, torch.zeros_like(old), mask)
    assert [k for k in m if "_pos_" in k] == ["mismatch/abs_diff_mean_pos_0_16", "mismatch/abs_diff_mean_pos_16_64",
                                              "mismatch/abs_diff_mean_pos_64_256",
                                              "mismatch/abs_diff_mean_pos_256_1024",
                                              "mismatch/abs_diff_mean_pos_1024_inf"]
    assert abs(m["mismatch/abs_diff_mean_pos_1024_inf"] - 0.7) <= 1e-8 and m["mismatch/abs_diff_mean_pos_0_16"] == 0


VERL_OFFPOLICY = {"kl": "kl_k1", "k3_kl": "kl_k3", "log_ppl_diff": "log_ppl_diff",
                  "log_ppl_abs_diff": "log_ppl_abs_diff", "chi2_token": "chi2_token"}


@pytest.mark.parametrize("seed", SEEDS)
def test_mismatch_metrics_equal_verls_offpolicy_metrics(seed):
    helper = _verl()
    old, rollout, mask = _batch(seed)
    ours = mismatch_metrics(old, rollout, mask)
    rows = mask.bool().any(-1)   # verl averages its per-response metrics over every row, empty ones included
    theirs = helper.compute_offpolicy_metrics(old[rows], rollout[rows], mask[rows])
    for verl_key, key in VERL_OFFPOLICY.items():
        # chi2: verl's masked_mean(r²) - 1 and our masked_mean(r² - 1) differ by 1e-8 / tokens (their count's eps)
        assert _diff("offpolicy", ours[f"mismatch/{key}"], theirs[verl_key]) <= (1e-8 if key == "chi2_token"
                                                                                 else TOL), key
    assert ours["mismatch/ratio_out_of_range_frac"] > 0 and ours["mismatch/abs_diff_max"] >= 25.0


def teardown_module():
    if MAX_DIFF:
        print("\nmax |hetrl - verl| / max(1, |verl|) per kind:", {k: f"{v:.1e}" for k, v in sorted(MAX_DIFF.items())})
