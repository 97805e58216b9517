"""PPO's math: GAE against a trajectory computed by hand, the clipped value loss, whitening, explained variance."""

import math

import pytest
import torch

from hetrl.algo import clipped_value_loss, explained_variance, gae_returns, row_mask, to_packed, to_padded, whiten


def gae(rewards, values, lens, gamma, lam):
    """GAE on packed [K] responses through the trainer's adapter (hetrl/algo/packing.py)."""
    if rewards.shape != values.shape:
        raise ValueError(f"rewards and values must both be [K], got {tuple(rewards.shape)} and {tuple(values.shape)}")
    adv, ret = gae_returns(to_padded(rewards, lens), to_padded(values, lens), row_mask(lens), gamma, lam)
    return to_packed(adv, lens), to_packed(ret, lens)


def test_gae_equals_the_hand_computed_trajectory():
    # response 0: T=3, reward 1 at the end; response 1 empty; response 2: T=2. gamma 0.9, lam 0.8 (gamma*lam 0.72)
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.5, -1.0], dtype=torch.float64)
    values = torch.tensor([0.5, 0.2, 0.7, 0.1, 0.3], dtype=torch.float64)
    adv, ret = gae(rewards, values, torch.tensor([3, 0, 2]), gamma=0.9, lam=0.8)
    # by hand: delta2 = 1 - 0.7 = 0.3; delta1 = 0.9*0.7 - 0.2 = 0.43; delta0 = 0.9*0.2 - 0.5 = -0.32
    #          A2 = 0.3, A1 = 0.43 + 0.72*0.3 = 0.646, A0 = -0.32 + 0.72*0.646 = 0.14512
    # second:  delta1 = -1 - 0.3 = -1.3; delta0 = 0.5 + 0.9*0.3 - 0.1 = 0.67; A1 = -1.3, A0 = 0.67 - 0.72*1.3 = -0.266
    want = torch.tensor([0.14512, 0.646, 0.3, -0.266, -1.3], dtype=torch.float64)
    assert torch.allclose(adv, want, atol=1e-12, rtol=0)
    assert torch.allclose(ret, want + values, atol=1e-12, rtol=0)


def test_gae_with_gamma_lam_one_is_reward_to_go_minus_value():
    rewards = torch.tensor([0.0, 0.0, 2.0, 0.0, 1.0])
    values = torch.tensor([0.5, 1.0, 1.5, 0.0, 0.25])
    adv, ret = gae(rewards, values, torch.tensor([3, 2]), gamma=1.0, lam=1.0)
    assert torch.allclose(ret, torch.tensor([2.0, 2.0, 2.0, 1.0, 1.0]))
    assert torch.allclose(adv, ret - values)


def test_gae_lam_zero_is_one_step_td():
    rewards = torch.tensor([0.0, 1.0])
    values = torch.tensor([0.3, 0.6])
    adv, _ = gae(rewards, values, torch.tensor([2]), gamma=0.5, lam=0.0)
    assert torch.allclose(adv, torch.tensor([0.5 * 0.6 - 0.3, 1.0 - 0.6]))


def test_gae_refuses_bad_input():
    with pytest.raises(ValueError, match="sum to"):
        gae(torch.zeros(3), torch.zeros(3), torch.tensor([2]), 1.0, 1.0)
    with pytest.raises(ValueError, match="gamma and lam"):
        gae(torch.zeros(2), torch.zeros(2), torch.tensor([2]), 1.5, 1.0)
    with pytest.raises(ValueError, match="both be"):
        gae(torch.zeros(2), torch.zeros(3), torch.tensor([2]), 1.0, 1.0)


def test_gae_passes_no_gradient_to_the_critic():
    values = torch.tensor([0.1, 0.2], requires_grad=True)
    adv, ret = gae(torch.tensor([0.0, 1.0]), values, torch.tensor([2]), 1.0, 0.95)
    assert not adv.requires_grad and not ret.requires_grad


def test_clipped_value_loss():
    v = torch.tensor([1.0, 0.0, 0.5])
    old = torch.tensor([0.0, 0.0, 0.4])
    ret = torch.tensor([1.0, 1.0, 0.0])
    loss, clipped = clipped_value_loss(v, old, ret, clip=0.2)
    # token 0: plain 0, clipped V = 0.2 -> (0.2-1)^2 = 0.64 -> 0.32 (clipped); token 1: both 1 -> 0.5;
    # token 2: plain 0.25, clipped V = 0.5 (within 0.2 of 0.4) -> 0.25 -> 0.125
    assert torch.allclose(loss, torch.tensor([0.32, 0.5, 0.125]))
    assert clipped.tolist() == [1.0, 0.0, 0.0]
    assert torch.allclose(clipped_value_loss(v, old, ret, None)[0], 0.5 * (v - ret) ** 2)
    with pytest.raises(ValueError, match="vf_clip"):
        clipped_value_loss(v, old, ret, 0.0)


def test_whiten_and_explained_variance():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    w = whiten(x)
    assert abs(w.mean().item()) < 1e-7 and abs(w.std().item() - 1) < 1e-6
    ret = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert explained_variance(ret, ret) == pytest.approx(1.0)
    assert explained_variance(torch.full((4,), 2.5), ret) == pytest.approx(0.0)
    assert explained_variance(-ret, ret) < 0
    assert math.isnan(explained_variance(ret, torch.ones(4)))
