"""shared_prompt_head (a PPO critic's values, or any per-token head) == the plain forward on the N full sequences:
values and every parameter gradient (the model's and the head's), fp64, each model family."""

import pytest
import torch

from hetrl.dualkv import pack_groups, shared_prompt_head

from .oracle import FAMILIES, random_groups, tiny_model

PROMPTS = [1, 7, 64, 65]
RESPONSES = [[5, 0, 1, 12, 3], [1, 9], [4, 4, 0]]


def _value_head(model, seed=1):
    torch.manual_seed(seed)
    return torch.nn.Linear(model.config.hidden_size, 1, dtype=torch.float64)


def standard_values(model, head, groups):
    """The oracle: each [prompt, response] alone through the decoder; the head on the rows before each token."""
    out = []
    for prompt, resps in groups:
        for r in resps:
            if len(r) == 0:
                continue
            ids = torch.tensor([list(prompt) + list(r)])
            h = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0, len(prompt) - 1: -1]
            out.append(head(h).squeeze(-1))
    return torch.cat(out)


def _grads(modules, values, weights):
    for m in modules:
        m.zero_grad(set_to_none=True)
    (values * weights).sum().backward()
    return {f"{i}.{n}": p.grad.detach().clone() for i, m in enumerate(modules) for n, p in m.named_parameters()
            if p.grad is not None}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("p", PROMPTS)
@pytest.mark.parametrize("impl", ["sdpa", "reference"])
def test_fp64_values_and_grads_equal_standard(family, p, impl):
    model = tiny_model(family)
    head = _value_head(model)
    groups = random_groups(p, [p, 3, 40][: 1 + PROMPTS.index(p) % 3], RESPONSES)
    want = standard_values(model, head, groups)
    weights = torch.linspace(-1.0, 2.0, want.numel(), dtype=torch.float64)
    want_grads = _grads([model, head], want, weights)
    got = shared_prompt_head(model, pack_groups(groups), head, impl=impl).squeeze(-1)
    assert got.shape == want.shape and got.dtype == torch.float64
    assert (got - want).abs().max().item() <= 1e-10
    got_grads = _grads([model, head], got, weights)
    assert set(got_grads) == set(want_grads)
    assert "0.lm_head.weight" not in want_grads        # the LM head takes no part in values
    for name, g in want_grads.items():
        assert (got_grads[name] - g).abs().max().item() <= 1e-9 * max(g.abs().max().item(), 1e-30), name
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_flex_forward_values_equal_standard_on_cpu(family):
    model = tiny_model(family)
    head = _value_head(model)
    groups = random_groups(3, [9, 64], [[3, 0, 7], [1, 1]])
    with torch.no_grad():
        want = standard_values(model, head, groups)
        got = shared_prompt_head(model, pack_groups(groups), head, impl="flex").squeeze(-1)
    assert (got - want).abs().max().item() <= 1e-10


def test_the_lm_head_does_not_run_and_any_head_shape_works():
    model = tiny_model("llama")
    calls = []
    model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    groups = random_groups(0, [5], [[2, 3]])
    head = torch.nn.Linear(model.config.hidden_size, 3, dtype=torch.float64)
    out = shared_prompt_head(model, pack_groups(groups), head)
    assert out.shape == (5, 3) and not calls
    empty = shared_prompt_head(model, pack_groups([([1, 2], [[], []])]), head)
    assert empty.shape == (0, 3)
