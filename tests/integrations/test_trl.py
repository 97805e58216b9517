"""DualKV inside TRL 1.16's GRPOTrainer (hetrl.integrations.trl), on a tiny fp64 model in TRL's own layout.

The oracle is TRL's log-prob pass as the plain forward computes it: the model on the [B, P + C] rows (left-padded
prompts, right-padded completions), log-softmax of the logits that predict each completion token, in fp64.
Stock TRL 1.16 cannot serve as the fp64 oracle itself: its fused LM head (trl/kernels/chunked_logprob.py)
accumulates the log-softmax in fp32 whatever the model's dtype, so on this model it is ~1e-3 from the fp64
log-probs; it is compared at that tolerance.
"""

import tempfile

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from hetrl.integrations.trl import DualKVGRPOTrainer, shared_prompt_groups, with_dualkv  # noqa: E402
from hetrl.models import load_model  # noqa: E402

# 6 rows, 3 prompts; rows of one prompt are not adjacent (TRL shuffles across micro-batches), one prompt has a
# single row, completions are ragged (right padding) and prompts left-padded
PROMPTS = [[0, 0, 5, 6, 7], [9, 10, 11, 12, 13], [0, 0, 5, 6, 7], [0, 0, 0, 30, 31], [9, 10, 11, 12, 13],
           [0, 0, 5, 6, 7]]
COMPLETIONS = [[20, 21, 3, 0], [23, 24, 25, 26], [22, 3, 0, 0], [40, 41, 42, 3], [27, 3, 0, 0], [28, 0, 0, 0]]
LENS = [3, 4, 2, 4, 2, 1]


def _batch():
    pid = torch.tensor(PROMPTS)
    cid = torch.tensor(COMPLETIONS)
    cm = (torch.arange(4)[None, :] < torch.tensor(LENS)[:, None]).long()
    return pid, (pid != 0).long(), cid, cm


class PlainForwardGRPOTrainer(trl.GRPOTrainer):
    """TRL's trainer with its log-prob pass computed by the plain forward in the model's dtype (the oracle)."""

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **_):
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits
        logits = logits[:, -logits_to_keep - 1:-1] / self.temperature
        logp = torch.log_softmax(logits, -1)
        per_token = logp.gather(-1, input_ids[:, -logits_to_keep:, None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1) if compute_entropy else None
        return per_token, entropy, None


@pytest.fixture(scope="module")
def model_dir():
    model, tok = load_model("tiny", torch.float64, seed=0)
    d = tempfile.mkdtemp()
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d, tok


def _trainer(cls, model_dir, beta=0.1, temperature=1.0):
    path, tok = model_dir
    torch.manual_seed(0)
    args = trl.GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=6, num_generations=3,
                          max_completion_length=4, use_cpu=True, report_to=[], beta=beta, save_strategy="no",
                          temperature=temperature, model_init_kwargs={"dtype": torch.float64})
    data = datasets.Dataset.from_list([{"prompt": "1+1="}, {"prompt": "2+2="}])
    return cls(model=path, reward_funcs=[lambda completions, **_: [0.0] * len(completions)], args=args,
               train_dataset=data, processing_class=tok)


def test_rows_are_grouped_by_their_prompt_wherever_they_sit():
    pid, pm, cid, cm = _batch()
    groups, rows, lens = shared_prompt_groups(torch.cat([pid, cid], 1), torch.cat([pm, cm], 1), 4)
    assert rows == [[0, 2, 5], [1, 4], [3]]
    assert groups[0] == ([5, 6, 7], [[20, 21, 3], [22, 3], [28]]) and groups[2] == ([30, 31], [[40, 41, 42, 3]])
    assert lens.tolist() == LENS
    holey = cm.clone()
    holey[1, 1] = 0            # a hole in a completion mask: not DualKV's layout
    assert shared_prompt_groups(torch.cat([pid, cid], 1), torch.cat([pm, holey], 1), 4) is None


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_and_entropies_equal_the_plain_forward_fp64(model_dir, temperature):
    pid, pm, cid, cm = _batch()
    ids, am = torch.cat([pid, cid], 1), torch.cat([pm, cm], 1)
    ours = _trainer(DualKVGRPOTrainer, model_dir, temperature=temperature)
    oracle = _trainer(PlainForwardGRPOTrainer, model_dir, temperature=temperature)
    lp, ent, _ = ours._get_per_token_logps_and_entropies(ours.model, ids, am, 4, compute_entropy=True)
    want, want_ent, _ = oracle._get_per_token_logps_and_entropies(oracle.model, ids, am, 4, compute_entropy=True)
    assert lp.shape == want.shape == (6, 4) and lp.dtype == torch.float64
    assert torch.allclose(lp * cm, want * cm, rtol=0, atol=1e-10)
    assert torch.allclose(ent * cm, want_ent * cm, rtol=0, atol=1e-10)
    assert (lp[cm == 0] == 0).all()


def _loss_and_grads(trainer):
    pid, pm, cid, cm = _batch()
    g = torch.Generator().manual_seed(0)
    inputs = {"prompt_ids": pid, "prompt_mask": pm, "completion_ids": cid, "completion_mask": cm,
              "advantages": torch.randn(6, generator=g, dtype=torch.float64),
              "old_per_token_logps": -4.0 + 0.1 * torch.randn(6, 4, generator=g, dtype=torch.float64),
              "ref_per_token_logps": -4.0 + 0.1 * torch.randn(6, 4, generator=g, dtype=torch.float64),
              "num_items_in_batch": cm.sum().double()}
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


class ExactPathGRPOTrainer(DualKVGRPOTrainer):
    dualkv_impl = "reference"


@pytest.mark.parametrize("trainer, grad_rel", [(ExactPathGRPOTrainer, 1e-12), (DualKVGRPOTrainer, 1e-6)],
                         ids=["dualkv-reference-path", "dualkv-sdpa-path"])
def test_grpo_loss_and_gradients_equal_trls_fp64(model_dir, trainer, grad_rel):
    """TRL's own compute_loss (clipped ratio against old log-probs, k3 KL to the reference, its loss aggregation) on
    both trainers: the same loss and the same gradient in every parameter. With impl=reference (each prompt
    duplicated per completion: the layout mapping alone) to fp64 rounding. With the shared-prompt SDPA path (the
    CPU default) the same loss (bit for bit in the forward), and gradients within 1e-6 of the largest: measured
    3-7e-8. That is not DualKV's: transformers' RMSNorm computes in fp32 even in an fp64 model, so every gradient
    below the final norm carries fp32 rounding, which depends on how a shared prompt's gradients are summed
    (norm.weight and lm_head agree to 1e-16, outside TRL as well)."""
    loss, grads = _loss_and_grads(_trainer(trainer, model_dir))
    want_loss, want_grads = _loss_and_grads(_trainer(PlainForwardGRPOTrainer, model_dir))
    assert abs(loss - want_loss) <= 1e-10 * abs(want_loss)
    assert set(grads) == set(want_grads) and len(grads) > 5
    for name, g in want_grads.items():
        assert (grads[name] - g).abs().max() <= grad_rel * g.abs().max(), name
    # stock TRL (fused fp32 log-softmax): the same up to its fp32 accumulation
    stock_loss, stock_grads = _loss_and_grads(_trainer(trl.GRPOTrainer, model_dir))
    assert abs(loss - stock_loss) <= 1e-2 * abs(stock_loss)
    flat = torch.cat([g.flatten() for g in grads.values()])
    stock_flat = torch.cat([stock_grads[n].flatten() for n in grads])
    assert (flat - stock_flat).norm() <= 1e-2 * stock_flat.norm()


def test_other_layouts_fall_back_to_trls_own_pass(model_dir):
    calls = []

    class Spy(trl.GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            calls.append(kwargs.get("pixel_values"))
            return torch.zeros(6, 4, dtype=torch.float64), None, None

    trainer = _trainer(with_dualkv(Spy), model_dir)
    pid, pm, cid, cm = _batch()
    holey = cm.clone()
    holey[1, 1] = 0
    trainer._get_per_token_logps_and_entropies(trainer.model, torch.cat([pid, cid], 1), torch.cat([pm, holey], 1), 4)
    trainer._get_per_token_logps_and_entropies(trainer.model, torch.cat([pid, cid], 1), torch.cat([pm, cm], 1), 4,
                                               pixel_values=torch.zeros(1))
    assert len(calls) == 2 and type(trainer).__name__ == "DualKVSpy"
