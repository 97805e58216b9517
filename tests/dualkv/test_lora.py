"""DualKV on a peft LoRA model: log-probs and the adapter's gradients equal the plain forward of the same peft model
on the N full sequences (fp64), and the adapter switched off gives the base model's log-probs exactly."""

import copy

import peft
import pytest
import torch

from hetrl.dualkv import pack_groups, shared_prompt_logprobs

from .oracle import random_groups, standard_logprobs, tiny_model

GROUPS = dict(prompt_lens=[13, 1, 32], response_lens=[[5, 0, 9, 1], [12, 3], [4, 4, 7]])


def _lora(model, targets="all-linear"):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)  # B != 0
    torch.manual_seed(1)
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_shared_prompt_logprobs_and_adapter_gradients_equal_the_plain_forward(family):
    groups = random_groups(0, **GROUPS)
    packed_model = _lora(tiny_model(family))
    plain_model = copy.deepcopy(packed_model)
    logp = shared_prompt_logprobs(packed_model.get_base_model(), pack_groups(groups), impl="sdpa", temperature=0.9)
    want = standard_logprobs(plain_model, groups, temperature=0.9)
    assert torch.allclose(logp, want, rtol=0, atol=1e-10)
    weights = torch.linspace(0.5, 1.5, logp.numel(), dtype=torch.float64)
    (logp * weights).sum().backward()
    (want * weights).sum().backward()
    trained = [(n, p) for n, p in packed_model.named_parameters() if p.requires_grad]
    plain = dict(plain_model.named_parameters())
    assert trained and all("lora_" in n for n, _ in trained)
    for name, p in trained:
        assert p.grad is not None and p.grad.abs().max() > 0, name
        assert torch.allclose(p.grad, plain[name].grad, rtol=1e-9, atol=1e-12), name


def test_the_adapter_switched_off_is_the_base_model():
    groups = random_groups(1, **GROUPS)
    base = tiny_model("llama")
    with_adapter = _lora(copy.deepcopy(base), targets=["q_proj", "v_proj"])
    batch = pack_groups(groups)
    with torch.no_grad():
        on = shared_prompt_logprobs(with_adapter.get_base_model(), batch, impl="sdpa")
        with with_adapter.disable_adapter():
            off = shared_prompt_logprobs(with_adapter.get_base_model(), batch, impl="sdpa")
        want = shared_prompt_logprobs(base, batch, impl="sdpa")
    assert torch.equal(off, want) and not torch.allclose(on, want)
