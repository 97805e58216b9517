"""TRL's GRPO loss names (loss_type, importance_sampling_level, epsilon, beta) against TRL 1.16's own loss: the
unbound GRPOTrainer._compute_loss runs on the CPU with a stand-in for the trainer object (its model forward
replaced by fixed fp64 log-probs), and its loss and gradient equal hetrl.algo's under the mapping from_trl, to
1e-10. TRL divides a response's token sum by its token count clamped at 1 (no 1e-8: seq_len_eps=0) and averages
over all rows, so every row here has tokens."""

from __future__ import annotations

import zlib
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from hetrl.algo import agg_loss, kl_penalty, policy_loss
from hetrl.algo.losses import TRL_LOSS_TYPES, from_trl

grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL needed")

B, T, MAX_LEN = 8, 7, 10


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    @staticmethod
    def gather(x):
        return x

    reduce = gather_for_metrics = staticmethod(lambda x, reduction=None: x)


def _trl_loss(loss_type, level, logp, old, ref, adv, mask, beta, epsilon, epsilon_high):
    """TRL's own _compute_loss on these tensors: `self` is a stand-in holding what the method reads."""
    args = SimpleNamespace(delta=None, use_bias_correction_kl=False, sapo_temperature_pos=1.0,
                           sapo_temperature_neg=1.05, steps_per_generation=1)
    stub = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=beta, args=args, loss_type=loss_type, epsilon_low=epsilon,
        epsilon_high=epsilon_high, use_vllm=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=MAX_LEN, accelerator=_Accelerator(),
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list)})
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv, "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
    if beta:
        inputs["ref_per_token_logps"] = ref
    return grpo_trainer.GRPOTrainer._compute_loss(stub, None, inputs)


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lens[:, None]).double()
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return logp, old, ref, adv, mask


CASES = [(t, "token") for t in TRL_LOSS_TYPES] + [(t, "sequence") for t in ("grpo", "bnpo", "dapo", "dr_grpo")]


@pytest.mark.parametrize("loss_type,level", CASES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_trl_loss_types_equal_trl(loss_type, level, beta):
    epsilon, epsilon_high = 0.2, (5.0 if loss_type == "cispo" else 0.28)
    logp, old, ref, adv, mask = _inputs(zlib.crc32(repr((loss_type, level)).encode()) % 1000)
    theirs_lp, ours_lp = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    theirs = _trl_loss(loss_type, level, theirs_lp, old, ref, adv, mask, beta, epsilon, epsilon_high)
    names = from_trl(loss_type, level, epsilon, epsilon_high)
    mode, agg = names.pop("loss_mode"), names.pop("loss_agg_mode")
    if mode == "vanilla":
        names["clip_ratio_c"] = None   # TRL's clipped loss has no dual-clip
    if mode == "sapo":   # TRL's torch.where of two Python floats makes float32 temperatures: 1.05 -> 1.0499999523
        names |= dict(tau_pos=1.0, tau_neg=float(torch.tensor(1.05, dtype=torch.float32)))
    adv_bt = adv[:, None].expand(B, T) * mask
    ours, _ = policy_loss(mode, old, ours_lp, adv_bt, mask, agg, loss_scale_factor=MAX_LEN, seq_len_eps=0.0, **names)
    if beta:   # TRL adds beta * k3 to every token's loss before the aggregation, as the trainer does
        ours = ours + beta * agg_loss(kl_penalty(ours_lp, ref, "k3"), mask, agg, MAX_LEN, seq_len_eps=0.0)
    theirs.backward()
    ours.backward()
    assert abs(float(ours.detach()) - float(theirs.detach())) <= 1e-10
    assert float((ours_lp.grad - theirs_lp.grad).abs().max()) <= 1e-10
    assert ours_lp.grad.abs().sum() > 0


def test_trl_names_without_a_counterpart_are_refused():
    with pytest.raises(ValueError, match="loss_type=luspo has no counterpart here; valid: grpo, bnpo"):
        from_trl("luspo")
    with pytest.raises(ValueError, match="applies to the clipped losses"):
        from_trl("sapo", "sequence")
