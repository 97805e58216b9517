"""shared_prompt_logprobs == the plain HF forward on the N full sequences: values and every gradient."""

import pytest
import torch

from hetrl.dualkv import pack_groups, shared_prompt_logprobs, split_by_token_budget

from .oracle import FAMILIES, random_groups, standard_logprobs, tiny_model

PROMPTS = [1, 7, 64, 65, 128]
# Ragged responses with R=0 and R=1 in every batch; a second and third group of other prompt sizes.
RESPONSES = [[5, 0, 1, 12, 3], [1, 9], [4, 4, 0]]


def _batch(p: int, n_groups: int, seed: int):
    prompt_lens = [p, 3, 40][:n_groups]
    return random_groups(seed, prompt_lens, RESPONSES[:n_groups])


def _param_grads(model, logp, weights):
    model.zero_grad(set_to_none=True)
    (logp * weights).sum().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _assert_grads_close(got, want, rel):
    for name, g in want.items():
        scale = g.abs().max().item()
        diff = (got[name] - g).abs().max().item()
        assert diff <= rel * scale, f"{name}: max|diff| {diff:.3e} > {rel:g} x max|grad| {scale:.3e}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("p", PROMPTS)
@pytest.mark.parametrize("impl", ["sdpa", "reference"])
def test_fp64_logprobs_and_grads_equal_standard(family, p, impl):
    n_groups = 1 + PROMPTS.index(p) % 3  # 1, 2 and 3 groups across the P grid
    model = tiny_model(family)
    groups = _batch(p, n_groups, seed=p)
    temperature = 0.7
    want = standard_logprobs(model, groups, temperature)
    weights = torch.linspace(-1.0, 2.0, want.numel(), dtype=torch.float64)
    want_grads = _param_grads(model, want, weights)

    got = shared_prompt_logprobs(model, pack_groups(groups), impl=impl, temperature=temperature)
    assert got.shape == want.shape and got.dtype == torch.float64
    assert (got - want).abs().max().item() <= 1e-9
    _assert_grads_close(_param_grads(model, got, weights), want_grads, rel=1e-8)
    assert model.config._attn_implementation == "sdpa"  # restored


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("p", PROMPTS)
def test_flex_forward_equals_standard_on_cpu(family, p):
    model = tiny_model(family)
    groups = _batch(p, 3, seed=p + 1)
    with torch.no_grad():
        want = standard_logprobs(model, groups, 1.3)
        got = shared_prompt_logprobs(model, pack_groups(groups), impl="flex", temperature=1.3)
    assert (got - want).abs().max().item() <= 1e-9


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fp32_within_1e4(family):
    model = tiny_model(family, dtype=torch.float32)
    groups = _batch(65, 3, seed=3)
    want = standard_logprobs(model, groups)
    weights = torch.linspace(-1.0, 2.0, want.numel())
    want_grads = _param_grads(model, want, weights)
    got = shared_prompt_logprobs(model, pack_groups(groups), impl="sdpa")
    assert (got - want).abs().max().item() <= 1e-4
    _assert_grads_close(_param_grads(model, got, weights), want_grads, rel=1e-4)
    with torch.no_grad():
        flex = shared_prompt_logprobs(model, pack_groups(groups), impl="flex")
    assert (flex - want).abs().max().item() <= 1e-4


def test_entropy_equals_standard():
    model = tiny_model("qwen3")
    groups = _batch(7, 2, seed=5)
    want_lp, want_ent = standard_logprobs(model, groups, 0.9, entropy=True)
    for impl in ("sdpa", "reference"):
        lp, ent = shared_prompt_logprobs(model, pack_groups(groups), impl=impl, temperature=0.9, return_entropy=True)
        assert (lp - want_lp).abs().max() <= 1e-9 and (ent - want_ent).abs().max() <= 1e-9


def test_first_token_logprobs_are_per_response():
    """The shared prompt row predicts every first token; each response must get its own label's log-prob."""
    model = tiny_model("llama")
    groups = [([3, 4, 5], [[10, 1], [20, 2], [30], [10]])]
    batch = pack_groups(groups)
    with torch.no_grad():
        firsts = [r[0].item() for r in batch.split_responses(shared_prompt_logprobs(model, batch))]
    assert firsts[0] == firsts[3] and len({firsts[0], firsts[1], firsts[2]}) == 3


def test_lm_head_runs_only_on_predicting_rows():
    model = tiny_model("llama")
    groups = _batch(64, 3, seed=9)
    batch = pack_groups(groups)
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, inp, out: seen.append(inp[0].shape))
    with torch.no_grad():
        shared_prompt_logprobs(model, batch, impl="sdpa")
    hook.remove()
    n_nonempty_groups = 3
    k = batch.labels.numel()
    n_responses_nonempty = sum(1 for r in batch.response_lens_list if r > 0)
    # one shared row per group replaces the first-token rows of all its responses
    assert seen == [torch.Size([1, k - n_responses_nonempty + n_nonempty_groups, 64])]


def test_micro_batches_give_the_same_logprobs():
    model = tiny_model("qwen2")
    groups = random_groups(11, [30, 5, 12], [[8, 8, 8, 8], [3, 0], [6, 6]])
    whole = shared_prompt_logprobs(model, pack_groups(groups))
    micro = split_by_token_budget(groups, 45)  # the 62-token first group must be cut
    assert len(micro) >= 3
    parts = torch.cat([shared_prompt_logprobs(model, pack_groups(mb)) for mb in micro])
    assert (parts - whole).abs().max() <= 1e-12
    assert (parts - standard_logprobs(model, groups)).abs().max() <= 1e-9


def test_all_empty_responses_give_an_empty_tensor():
    model = tiny_model("llama")
    out = shared_prompt_logprobs(model, pack_groups([([1, 2], [[], []])]))
    assert out.shape == (0,)


def test_train_mode_without_dropout_is_exact():
    model = tiny_model("llama").train()
    groups = _batch(7, 2, seed=2)
    got = shared_prompt_logprobs(model, pack_groups(groups))
    assert (got - standard_logprobs(model, groups)).abs().max() <= 1e-9


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fp64_chunked_lm_head_equals_standard(family, monkeypatch):
    """The row-chunked LM head + log-softmax (recomputed in the backward), forced on with 5-row chunks."""
    from hetrl.dualkv import api

    model = tiny_model(family)
    monkeypatch.setattr(api, "CHUNK_LOGITS_ABOVE_BYTES", 0)
    monkeypatch.setattr(api, "CHUNK_BYTES", 5 * 4 * model.config.vocab_size)
    groups = _batch(65, 3, seed=11)
    want = standard_logprobs(model, groups, 0.7)
    weights = torch.linspace(-1.0, 2.0, want.numel(), dtype=torch.float64)
    want_grads = _param_grads(model, want, weights)
    got, entropy = shared_prompt_logprobs(model, pack_groups(groups), impl="sdpa", temperature=0.7,
                                          return_entropy=True)
    assert (got - want).abs().max().item() <= 1e-9
    assert entropy.requires_grad and bool((entropy > 0).all())    # its gradient: test_entropy_gradient_equals_...
    _assert_grads_close(_param_grads(model, got, weights), want_grads, rel=1e-8)
    with torch.no_grad():
        assert (shared_prompt_logprobs(model, pack_groups(groups), impl="sdpa", temperature=0.7)
                - want).abs().max() <= 1e-9


def _create_block_mask_reference(batch):
    from torch.nn.attention.flex_attention import create_block_mask
    g, s, n = batch.group_ids, batch.segment_ids, batch.num_tokens
    return create_block_mask(lambda b, h, q, kv: (kv <= q) & (g[q] == g[kv]) & ((s[kv] == 0) | (s[kv] == s[q])),
                             None, None, n, n, device="cpu")


@pytest.mark.parametrize("chunk_pairs", [1 << 26, 128 * 256])    # one chunk, and a chunk per query tile
def test_block_mask_is_create_block_masks_tile_for_tile(monkeypatch, chunk_pairs):
    """The chunked tile classification (bounded memory) gives create_block_mask's mask: the same partial and
    full tiles, and the same attention output through flex."""
    from torch.nn.attention.flex_attention import flex_attention

    from hetrl.dualkv.impl import flex

    monkeypatch.setattr(flex, "_CHUNK_PAIRS", chunk_pairs)
    torch.manual_seed(0)
    layouts = [
        [([1] * 300, [[2] * 50, [], [3] * 130])],                       # a tail tile, an empty response
        [([1] * 7, [[2] * 3]), ([1] * 129, [[2], [3] * 256, [4] * 5]), ([1] * 128, [[2] * 128] * 3)],  # aligned
        [([1] * 128, [[2] * 128])],                                     # exactly two tiles
    ]
    for groups in layouts:
        batch = pack_groups(groups)
        want, got = _create_block_mask_reference(batch), flex.build_block_mask(batch)
        assert torch.equal(got.to_dense(), want.to_dense())
        assert torch.equal(got.kv_num_blocks, want.kv_num_blocks)
        assert torch.equal(got.full_kv_num_blocks, want.full_kv_num_blocks)
        n = batch.num_tokens
        q, k, v = torch.randn(1, 4, n, 8), torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)
        a = flex_attention(q, k, v, block_mask=want, enable_gqa=True)
        b = flex_attention(q, k, v, block_mask=got, enable_gqa=True)
        assert torch.equal(a, b)


def test_compiled_flex_keeps_one_kernel_across_many_packed_lengths():
    """Every micro-batch packs to another length. A shape-specialised compile (dynamic=False) recompiles per
    length and, past dynamo's recompile limit (8 by default), silently falls back to eager flex, which
    materialises the full score matrix. The compiled kernel must serve more lengths than a tight limit allows
    (dynamo told to fail instead of falling back). Forward on CPU: torch compiles flex there; the backward is
    CUDA-only."""
    import torch._dynamo

    from hetrl.dualkv.impl import flex

    torch._dynamo.reset()
    flex._compiled_flex.cache_clear()
    with torch._dynamo.config.patch(recompile_limit=3, fail_on_recompile_limit_hit=True):
        for i, r in enumerate([17, 100, 211, 333, 450, 600]):
            batch = pack_groups([([1] * (30 + i), [[2] * r, [3] * (r // 2)])])
            n = batch.num_tokens
            q, k, v = torch.randn(1, 4, n, 8), torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)
            mask = flex.build_block_mask(batch)
            got = flex._compiled_flex()(q, k, v, block_mask=mask, scale=0.3, enable_gqa=True)
            want = flex.flex_attention(q, k, v, block_mask=mask, scale=0.3, enable_gqa=True)
            assert (got - want).abs().max().item() <= 1e-5
    torch._dynamo.reset()


@pytest.mark.parametrize("impl,chunked", [("sdpa", False), ("reference", False), ("sdpa", True)])
def test_fp64_entropy_and_its_gradient_equal_standard(impl, chunked, monkeypatch):
    """The entropy bonus's gradient (and the log-probs' with it) through the gathered log-softmax and the
    chunked LM head, against autograd through the plain forward's softmax."""
    from hetrl.dualkv import api

    model = tiny_model("llama")
    if chunked:
        monkeypatch.setattr(api, "CHUNK_LOGITS_ABOVE_BYTES", 0)
        monkeypatch.setattr(api, "CHUNK_BYTES", 5 * 4 * model.config.vocab_size)
    groups = _batch(9, 3, seed=5)
    want_lp, want_ent = standard_logprobs(model, groups, 0.7, entropy=True)
    got_lp, got_ent = shared_prompt_logprobs(model, pack_groups(groups), impl=impl, temperature=0.7,
                                             return_entropy=True)
    assert (got_ent - want_ent).abs().max().item() <= 1e-9
    a = torch.linspace(-1.0, 2.0, want_lp.numel(), dtype=torch.float64)
    b = torch.linspace(0.5, -1.5, want_lp.numel(), dtype=torch.float64)
    for lp_w, ent_w in ((a, b), (None, b)):      # both terms, and the entropy alone
        def grads(lp, ent):
            model.zero_grad(set_to_none=True)
            loss = (ent * ent_w).sum() + ((lp * lp_w).sum() if lp_w is not None else 0.0)
            loss.backward(retain_graph=True)
            return {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        _assert_grads_close(grads(got_lp, got_ent), grads(want_lp, want_ent), rel=1e-8)
