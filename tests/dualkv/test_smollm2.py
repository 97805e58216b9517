"""The equivalence check on the real embedded SmolLM2-135M-Instruct weights (fp32, one group)."""

import pytest
import torch

from hetrl.dualkv import pack_groups, shared_prompt_logprobs

from .oracle import standard_logprobs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from hetrl.models import load_model

    model, tokenizer = load_model()
    return model, tokenizer


def test_smollm2_logprobs_and_grads_equal_standard(smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 17 + 25? Explain briefly."}],
                                           add_generation_prompt=True)
    prompt = prompt["input_ids"] if not isinstance(prompt, list) else prompt
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (9, 1, 0, 14)]
    groups = [(prompt, responses)]

    want = standard_logprobs(model, groups, temperature=0.8)
    weights = torch.linspace(-1.0, 1.0, want.numel())
    model.zero_grad(set_to_none=True)
    (want * weights).sum().backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad(set_to_none=True)
    got = shared_prompt_logprobs(model, pack_groups(groups), impl="sdpa", temperature=0.8)
    (got * weights).sum().backward()
    assert (got - want).abs().max().item() <= 1e-4
    # fp32 over 30 layers: the gradients differ by summation order only (exactness is the fp64 tests' job, 1e-9).
    # 1e-4 held on the Intel Xeon this was written on; an AMD EPYC gives 1.01e-4 for layer 3's input norm, with
    # the same code (checked on the commit before), so the bound is 3e-4 of each gradient's largest entry.
    for name, p in model.named_parameters():
        scale = want_grads[name].abs().max().item()
        assert (p.grad - want_grads[name]).abs().max().item() <= 3e-4 * scale, name
