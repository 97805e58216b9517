"""hetrl.algo against verl 0.9.1's own core_algos: the same fp64 tensors (ragged and equal groups, masks with
varied lengths, holes and empty rows) into verl's function and ours; advantages, loss and the gradient w.r.t.
log_prob agree to 1e-10 for every name. verl is installed without its dependencies for these tests; its
core_algos needs ray, tensordict and omegaconf to import."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from hetrl.algo import (
    ADVANTAGE_ESTIMATORS,
    KL_PENALTIES,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    advantage,
    entropy_loss,
    kl_penalty,
    policy_loss,
)

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl (and ray, tensordict, omegaconf) needed")
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

TOL = 1e-10
GROUPINGS = {"equal": [4, 4, 4], "ragged": [4, 3, 1, 4], "pairs": [2, 2, 2, 2, 2, 2]}
MAX_DIFF: dict[str, float] = {}   # the largest difference seen per name (printed with -s)


def _batch(grouping: str, masks: str, seed: int, discrete: bool = False):
    g = torch.Generator().manual_seed(seed)
    sizes = GROUPINGS[grouping]
    b, t = sum(sizes), 9
    index = np.array([f"uid-{i}" for i, n in enumerate(sizes) for _ in range(n)], dtype=object)
    lens = torch.randint(2, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lens[:, None]).double()
    if masks == "holes":                       # tool tokens inside responses, one empty row
        mask[torch.rand(b, t, generator=g) < 0.2] = 0
        mask[1] = 0
        mask[mask.sum(-1) == 0] = 0
        mask[0, :3] = 1                        # whitening needs tokens
    rewards = torch.zeros(b, t, dtype=torch.float64)
    last = (mask * torch.arange(t)).argmax(-1)
    score = torch.randint(0, 3, (b,), generator=g).double() / 2 if discrete else torch.randn(b, generator=g,
                                                                                                dtype=torch.float64)
    rewards[torch.arange(b), last] = score * (mask.sum(-1) > 0)
    return index, rewards, mask, g


def _diff(name, a, b):
    d = float((a - b).abs().max()) if a.numel() else 0.0
    MAX_DIFF[name] = max(MAX_DIFF.get(name, 0.0), d)
    return d


CASES = [(gr, m, d) for gr in GROUPINGS for m in ("plain", "holes") for d in (False, True)]


@pytest.mark.parametrize("grouping,masks,discrete", CASES)
@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "opo", "reinforce_plus_plus_baseline", "gpg",
                                  "grpo_passk", "reinforce_plus_plus", "remax", "gae"])
def test_advantages_equal_verl(name, grouping, masks, discrete):
    seed = zlib.crc32(repr((name, grouping, masks, discrete)).encode()) % 1000   # hash() varies with PYTHONHASHSEED
    index, rewards, mask, g = _batch(grouping, masks, seed=seed, discrete=discrete)
    if name == "grpo_passk" and grouping == "ragged":   # both refuse a group of one
        with pytest.raises(ValueError, match="at least 2"):
            core_algos.compute_grpo_passk_outcome_advantage(rewards, mask, index, config=AlgoConfig())
        with pytest.raises(ValueError, match="at least 2"):
            advantage(name, rewards, mask, index)
        return
    if name in ("rloo", "opo", "reinforce_plus_plus_baseline", "gpg", "grpo"):
        theirs = core_algos.get_adv_estimator_fn(name)(rewards.clone(), mask, index)[0]
        ours = advantage(name, rewards, mask, index)
    elif name == "dr_grpo":
        theirs = core_algos.compute_grpo_outcome_advantage(rewards.clone(), mask, index,
                                                           norm_adv_by_std_in_grpo=False)[0]
        ours = advantage("grpo", rewards, mask, index, norm_adv_by_std_in_grpo=False)
    elif name == "grpo_passk":
        for norm in (True, False):
            theirs = core_algos.compute_grpo_passk_outcome_advantage(
                rewards.clone(), mask, index, config=AlgoConfig(norm_adv_by_std_in_grpo=norm))[0]
            ours = advantage(name, rewards, mask, index, norm_adv_by_std_in_grpo=norm)
            assert _diff(name, ours, theirs) <= TOL
        return
    elif name == "reinforce_plus_plus":
        dense = torch.randn(rewards.shape, generator=g, dtype=torch.float64) * mask
        theirs = core_algos.compute_reinforce_plus_plus_outcome_advantage(dense, mask, config=AlgoConfig(gamma=0.9))[0]
        ours = advantage(name, dense, mask, index, gamma=0.9)
    elif name == "remax":
        base = torch.randn(len(index), generator=g, dtype=torch.float64)
        theirs = core_algos.compute_remax_outcome_advantage(rewards, base, mask)[0]
        ours = advantage(name, rewards, mask, index, reward_baselines=base)
    else:   # gae
        values = torch.randn(rewards.shape, generator=g, dtype=torch.float64)
        theirs = core_algos.compute_gae_advantage_return(rewards, values, mask, gamma=0.99, lam=0.95)[0]
        ours = advantage(name, rewards, mask, index, values=values, gamma=0.99, lam=0.95)
    assert ours.shape == rewards.shape
    if name in ("grpo", "gpg") and grouping == "ragged":
        # verl's group of one gets mean torch.tensor(0.0) and std torch.tensor(1.0), float32 tensors, so it divides
        # by 1 + epsilon rounded to float32 (1 + 9.5e-7, 4.6e-8 relative from 1 + 1e-6); hetrl keeps the scores' dtype.
        # Other rows to 1e-10, that row to 1e-7 relative.
        single = torch.tensor([list(index).count(i) == 1 for i in index])
        assert float(((ours[single] - theirs[single]).abs() / theirs[single].abs().clamp_min(1.0)).max()) <= 1e-7
        ours, theirs = ours[~single], theirs[~single]
    assert _diff(name, ours, theirs) <= TOL


def _actor_config(loss_scale_factor=None, **options) -> ActorConfig:
    loss_keys = {"clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef"}
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                      policy_loss=PolicyLossConfig(**{k: v for k, v in options.items() if k in loss_keys}),
                      **{k: v for k, v in options.items() if k not in loss_keys})
    if loss_scale_factor is not None:
        cfg.global_batch_info["loss_scale_factor"] = loss_scale_factor
    return cfg


LOSS_OPTIONS = {
    "vanilla": dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0),
    "gspo": dict(clip_ratio=0.2, clip_ratio_low=0.0003, clip_ratio_high=0.0004),
    "sapo": dict(tau_pos=1.0, tau_neg=1.05),
    "gpg": dict(),
    "cispo": dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28),
    "clip_cov": dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_cov_ratio=0.2, clip_cov_lb=0.0,
                     clip_cov_ub=5.0),
    "kl_cov": dict(kl_cov_ratio=0.2, ppo_kl_coef=0.1),
    "geo_mean": dict(clip_ratio=0.4, clip_ratio_low=0.4, clip_ratio_high=0.4),
}


def _loss_inputs(masks: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    _, _, mask, _ = _batch("ragged", masks, seed)
    old = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 3
    logp = old + 0.3 * torch.randn(mask.shape, generator=g, dtype=torch.float64)
    logp[0, :2] = old[0, :2] + 1.5                      # ratios beyond the dual-clip bound
    adv = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    adv[0, :2] = -1.0
    return old, logp, adv, mask


def _both(name, masks, mode, factor, seed):
    old, logp, adv, mask = _loss_inputs(masks, seed)
    opts = LOSS_OPTIONS[name]
    ours_lp, theirs_lp = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    torch.manual_seed(seed)                               # clip_cov draws its tokens from torch's generator
    ours, ours_metrics = policy_loss(name, old, ours_lp, adv, mask, mode, loss_scale_factor=factor, **opts)
    torch.manual_seed(seed)
    theirs, theirs_metrics = core_algos.get_policy_loss_fn(name)(
        old, theirs_lp, adv, mask, mode or "token-mean", _actor_config(factor, **opts))
    ours.backward()
    theirs.backward()
    return ours, theirs, ours_lp.grad, theirs_lp.grad, ours_metrics, theirs_metrics


LOSS_CASES = [(name, mode, masks) for name in LOSS_OPTIONS
              for mode in ((None,) if name in ("sapo", "geo_mean") else LOSS_AGGREGATIONS)
              for masks in ("plain", "holes") if not (name == "geo_mean" and masks == "holes")]


@pytest.mark.parametrize("name,mode,masks", LOSS_CASES)
def test_policy_loss_and_gradient_equal_verl(name, mode, masks):
    for seed, factor in ((0, None), (1, 7.0)):
        ours, theirs, g_ours, g_theirs, m_ours, m_theirs = _both(name, masks, mode, factor, seed)
        assert _diff(name, ours.detach(), theirs.detach()) <= TOL
        assert _diff(name, g_ours, g_theirs) <= TOL
        assert g_ours.abs().sum() > 0
        for key, value in m_theirs.items():
            short = key.removeprefix("actor/")
            if short in m_ours:
                assert abs(m_ours[short] - value) <= TOL, key


def test_geo_mean_counts_responses_with_tokens():
    """verl's geo_mean takes torch.mean over all rows, a row without tokens included (its loss is 0); hetrl
    averages over the rows with tokens, like the seq-mean aggregations: the two differ by rows/non-empty rows."""
    old, logp, adv, mask = _loss_inputs("plain", 3)
    mask[2] = 0
    ours = policy_loss("geo_mean", old, logp, adv, mask, **LOSS_OPTIONS["geo_mean"])[0]
    theirs = core_algos.compute_policy_loss_geo_mean(old, logp, adv, mask, config=_actor_config(
        **LOSS_OPTIONS["geo_mean"]))[0]
    b = mask.shape[0]
    assert abs(float(ours) * (b - 1) / b - float(theirs)) <= TOL


@pytest.mark.parametrize("name", KL_PENALTIES)
def test_kl_penalty_value_and_gradient_equal_verl(name):
    g = torch.Generator().manual_seed(5)
    ref = -torch.rand(6, 7, generator=g, dtype=torch.float64) * 3
    logp = ref + torch.randn(6, 7, generator=g, dtype=torch.float64)
    a, b = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    ours, theirs = kl_penalty(a, ref, name), core_algos.kl_penalty(b, ref, name)
    (ours * torch.arange(7.0, dtype=torch.float64)).sum().backward()
    (theirs * torch.arange(7.0, dtype=torch.float64)).sum().backward()
    assert _diff("kl_" + name, ours.detach(), theirs.detach()) <= TOL
    assert _diff("kl_" + name, a.grad, b.grad) <= TOL


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_entropy_equals_verl(mode):
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 7, 11, generator=g, dtype=torch.float64)
    _, _, mask, _ = _batch("ragged", "holes", 6)
    mask = mask[:5, :7]
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ours, theirs = entropy_loss(a, mask, mode), core_algos.compute_entropy_loss(b, mask, mode)
    ours.backward()
    theirs.backward()
    assert _diff("entropy", ours.detach(), theirs.detach()) <= TOL
    assert _diff("entropy", a.grad, b.grad) <= TOL


@pytest.mark.parametrize("kind", ["fixed", "adaptive"])
def test_kl_in_reward_and_its_controller_equal_verl(kind):
    """verl's apply_kl_penalty (its lines, on tensors: ray_trainer needs a DataProto) and its KL controllers."""
    from hetrl.algo import KLController, kl_in_reward

    index, scores, mask, g = _batch("ragged", "holes", 8)
    old = -torch.rand(mask.shape, generator=g, dtype=torch.float64)
    ref = old + 0.3 * torch.randn(mask.shape, generator=g, dtype=torch.float64)
    ours_ctrl = KLController(0.05, kind, target=0.02, horizon=100)
    theirs_ctrl = (core_algos.AdaptiveKLController(0.05, 0.02, 100) if kind == "adaptive"
                   else core_algos.FixedKLController(0.05))
    for _ in range(3):
        kld = core_algos.kl_penalty(old, ref, kl_penalty="kl") * mask
        theirs = scores - theirs_ctrl.value * kld
        current = torch.mean(core_algos.verl_F.masked_mean(kld, mask=mask, axis=-1), dim=0).item()
        theirs_ctrl.update(current_kl=current, n_steps=len(index))
        ours, ours_kl = kl_in_reward(scores, old, ref, mask, ours_ctrl, "kl")
        assert _diff("kl_in_reward", ours, theirs) <= TOL and abs(ours_kl - current) <= TOL
        assert abs(ours_ctrl.value - theirs_ctrl.value) <= TOL
    assert (ours_ctrl.value != 0.05) == (kind == "adaptive")


def test_every_name_is_covered():
    assert set(ADVANTAGE_ESTIMATORS) <= set(core_algos.ADV_ESTIMATOR_REGISTRY)
    assert set(POLICY_LOSSES) <= set(core_algos.POLICY_LOSS_REGISTRY)


def test_unknown_names_and_options_are_refused_with_the_valid_ones():
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; valid: gae, grpo"):
        advantage("ppo", mask, mask, [0, 0])
    with pytest.raises(ValueError, match="takes no option alpha; its options: f_norm"):
        advantage("gpg", mask, mask, [0, 0], alpha=2.0)
    with pytest.raises(ValueError, match="unknown loss_mode 'ppo'; valid: vanilla, gspo"):
        policy_loss("ppo", mask, mask, mask, mask)
    with pytest.raises(ValueError, match="loss_mode=sapo aggregates by seq-mean-token-mean"):
        policy_loss("sapo", mask, mask, mask, mask, "token-mean")
    with pytest.raises(ValueError, match="unknown kl estimator 'k4'"):
        kl_penalty(mask, mask, "k4")


def teardown_module():
    if MAX_DIFF:
        print("\nmax |hetrl - verl| per name:", {k: f"{v:.1e}" for k, v in sorted(MAX_DIFF.items())})
