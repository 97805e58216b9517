import pytest
import torch

from hetrl.algo import advantage, kl_penalty, per_token_policy_loss, token_weights


def group_advantages(rewards, **options):
    """[G, N] outcome rewards -> [G, N] advantages through the registry's estimator on [G*N, 1] rows."""
    index = torch.arange(rewards.shape[0]).repeat_interleave(rewards.shape[1])
    flat = rewards.reshape(-1, 1)
    return advantage("grpo", flat, torch.ones_like(flat), index, **options).view_as(rewards)


def clipped_policy_loss(logp, old_logp, advantages, clip_low, clip_high):
    loss, metrics = per_token_policy_loss("vanilla", old_logp, logp, advantages, torch.ones_like(logp),
                                          clip_ratio_low=clip_low, clip_ratio_high=clip_high, clip_ratio_c=None)
    return loss, metrics["pg_clipfrac"]


def kl_k3(logp, ref_logp):
    return kl_penalty(logp, ref_logp, "k3")


def test_group_advantages_center_and_scale_per_group():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]], dtype=torch.float64)
    a = group_advantages(r)
    assert torch.allclose(a[0], torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=torch.float64) / (0.5773502691896257 + 1e-6))
    assert torch.equal(a[1], torch.zeros(4, dtype=torch.float64))  # no signal in an all-equal group
    assert torch.allclose(group_advantages(r, norm_adv_by_std_in_grpo=False)[0],
                          torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=torch.float64))
    with pytest.raises(ValueError, match="one group id per row"):
        advantage("grpo", torch.zeros(4, 1), torch.ones(4, 1), [0, 0])


def test_clipped_loss_matches_ppo_definition():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([0.5, 1.5, 0.5, 1.5]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, clipped = clipped_policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.28)
    # A>0: min(r, clip(r)) -> ratio 0.5 unclipped (0.5), ratio 1.5 clipped at 1.28
    # A<0: min(-r, -clip(r)) -> ratio 0.5 clipped at 0.8 (-0.8), ratio 1.5 unclipped (-1.5)
    assert torch.allclose(loss, torch.tensor([-0.5, -1.28, 0.8, 1.5]))
    assert clipped.tolist() == [0.0, 1.0, 1.0, 0.0]


def test_clipped_loss_gradient_is_policy_gradient_at_ratio_one():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    adv = torch.tensor([0.5, -2.0])
    loss, _ = clipped_policy_loss(logp, logp.detach(), adv, 0.2, 0.2)
    loss.sum().backward()
    assert torch.allclose(logp.grad, -adv)


def test_kl_k3_is_nonnegative_and_zero_at_equality():
    logp = torch.tensor([-1.0, -0.5, -3.0])
    assert torch.equal(kl_k3(logp, logp), torch.zeros(3))
    assert (kl_k3(logp, torch.tensor([-2.0, 0.0, -1.0])) > 0).all()


def test_token_weights_sum_to_one_and_drop_left_out_responses():
    lens = torch.tensor([2, 3, 0, 5])
    keep = torch.tensor([True, True, True, False])
    tm = token_weights(lens, keep, "token-mean")
    assert tm.tolist() == pytest.approx([0.2] * 5 + [0.0] * 5)
    sm = token_weights(lens, keep, "seq-mean-token-mean")
    assert sm.tolist() == pytest.approx([0.25, 0.25] + [1 / 6] * 3 + [0.0] * 5)
    assert token_weights(lens, keep, "token-sum").tolist() == [1.0] * 5 + [0.0] * 5
    assert token_weights(lens, keep, "seq-mean-token-sum").tolist() == pytest.approx([0.5] * 5 + [0.0] * 5)
    assert token_weights(lens, keep, "seq-mean-token-sum-norm", loss_scale_factor=4).tolist() == pytest.approx(
        [0.125] * 5 + [0.0] * 5)
    with pytest.raises(ValueError, match="loss aggregation must be one of"):
        token_weights(lens, keep, "sum")
    with pytest.raises(ValueError, match="loss_scale_factor"):
        token_weights(lens, keep, "seq-mean-token-sum-norm")


def test_tree_advantages_by_hand():
    """Two rollouts; the first forks at token 2 into two leaves. Rewards 1, 0 (the fork's leaves) and 0.5."""
    from hetrl.algo import tree_advantages

    r = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
    paths, forks, lens = [(0, 0), (0, 1), (1,)], [(2,), (2,), ()], [4, 3, 2]
    leaves = tree_advantages(r, paths, forks, lens, scale=False)
    assert leaves.tolist() == [0.5] * 4 + [-0.5] * 3 + [0.0] * 2          # every leaf against the mean 0.5
    sub = tree_advantages(r, paths, forks, lens, subtree=True, scale=False)
    # before the fork: against the task's leaves (0.5); after it: against the fork's leaves (0.5 too) ...
    assert sub.tolist() == [0.5, 0.5, 0.5, 0.5, -0.5, -0.5, -0.5, 0.0, 0.0]
    r2 = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)                 # ... and here 1/3 and 1/2
    sub = tree_advantages(r2, paths, forks, lens, subtree=True, scale=False)
    assert torch.allclose(sub, torch.tensor([2 / 3, 2 / 3, 0.5, 0.5, -1 / 3, -1 / 3, -0.5, -1 / 3, -1 / 3],
                                            dtype=torch.float64), atol=1e-15)
    scaled = tree_advantages(r2, paths, forks, lens, subtree=True)
    assert torch.allclose(scaled, sub / (r2.std() + 1e-6), atol=1e-15)
    # no fork: the per-subtree baseline is GRPO's
    flat = [(0,), (1,), (2,)], [(), (), ()]
    assert torch.allclose(tree_advantages(r2, *flat, lens, subtree=True), tree_advantages(r2, *flat, lens),
                          atol=1e-15)
    with pytest.raises(ValueError, match="increasing fork positions"):
        tree_advantages(r, paths, [(2,), (5,), ()], lens)
