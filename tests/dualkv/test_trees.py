"""The tree engine == running every sequence alone through the HF model (fp64): log-probs, losses with a different
advantage per sequence (clipped), and every parameter's gradient; the layout against a brute-force trie."""

import random

import pytest
import torch
import torch.nn.functional as F

from hetrl.dualkv import pack_groups, pack_sequences, sequence_logprobs, shared_prompt_head, shared_prompt_logprobs
from hetrl.dualkv.impl import flex, sdpa

from .oracle import FAMILIES, VOCAB, tiny_model

LOGP_TOL = 1e-10
GRAD_REL_TOL = 1e-10   # per parameter, |got - want| / |want| (norms), as the shared-prompt tests


def agent_tree(seed: int, prompt: int = 9, depth: int = 3, branches=(2, 3, 1), lens=(3, 9)):
    """Sequences of one tree: a prompt, then `depth` levels of turns, level i forking into branches[i] children;
    every root-to-leaf path is a sequence, plus a few inner paths (sequences that are prefixes of others)."""
    rng = random.Random(seed)
    paths = [[rng.randrange(VOCAB) for _ in range(prompt)]]
    inner = []
    for level in range(depth):
        nxt = []
        for path in paths:
            for _ in range(branches[level % len(branches)]):
                nxt.append(path + [rng.randrange(VOCAB) for _ in range(rng.randint(*lens))])
        inner += paths
        paths = nxt
    return paths + inner[1:3]


def forest(seed: int):
    """Several trees, branching at several depths, a sequence that is a prefix of another, identical sequences,
    a one-token sequence, and a tree sharing only its first token with another."""
    a = agent_tree(seed, prompt=9, depth=3, branches=(2, 3, 1))
    b = agent_tree(seed + 1, prompt=4, depth=2, branches=(3, 2))
    c = [a[0][:1] + [5, 6, 7], [a[0][0]]]                       # forks from tree a right after its first token
    return a + b + [a[2], list(b[1])] + c


def masks_for(seqs, seed: int):
    """Loss masks in the agent pattern: turns of model tokens separated by context (prompt, tool outputs)."""
    rng = random.Random(seed)
    out = []
    for s in seqs:
        m = [False] + [rng.random() < 0.6 for _ in s[1:]]
        out.append(m)
    return out


def alone_logprobs(model, seqs, masks=None, temperature: float = 1.0):
    """The oracle: each sequence alone through the model's own forward; per sequence the log-probs of its labels."""
    out = []
    for i, s in enumerate(seqs):
        ids = torch.tensor([s])
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1] / temperature
        logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        keep = torch.tensor(masks[i][1:], dtype=torch.bool) if masks is not None else torch.ones(len(s) - 1, dtype=bool)
        out.append(logp[keep])
    return out


def clipped_loss(per_seq, old, advantages):
    """PPO's clipped surrogate per token, each sequence with its own advantage: a token shared by several
    sequences enters once per sequence, with that sequence's advantage and clipping."""
    total = 0.0
    for logp, o, a in zip(per_seq, old, advantages):
        ratio = torch.exp(logp - o)
        total = total - torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a).sum()
    return total


def grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(got, want):
    assert got.keys() == want.keys()
    for name, g in want.items():
        rel = ((got[name] - g).norm() / g.norm().clamp(min=1e-300)).item()
        assert rel <= GRAD_REL_TOL, f"{name}: |diff| / |grad| = {rel:.3e} > {GRAD_REL_TOL:g}"


def trie_nodes(seqs) -> int:
    return len({tuple(s[: i + 1]) for s in seqs for i in range(len(s))})


# -- layout ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_layout_is_the_trie_and_the_mask_is_ancestry(seed):
    seqs = forest(seed)
    batch = pack_sequences(seqs)
    assert batch.num_tokens == trie_nodes(seqs)         # every shared token once, no extra token at branch points
    assert batch.num_standard_tokens == sum(map(len, seqs))
    # each stream row is one trie node: recover its prefix, then check ids, depth and visibility by brute force
    prefix = {}
    for (ids, _), rows in zip(batch.sequences(), torch.split(batch.sequence_rows, list(batch.sequence_lens))):
        for i, r in enumerate(rows.tolist()):
            assert prefix.setdefault(r, tuple(ids[: i + 1].tolist())) == tuple(ids[: i + 1].tolist())
    assert sorted(prefix) == list(range(batch.num_tokens))
    assert ([batch.input_ids[r].item() for r in range(batch.num_tokens)]
            == [prefix[r][-1] for r in range(batch.num_tokens)])
    assert batch.position_ids.tolist() == [len(prefix[r]) - 1 for r in range(batch.num_tokens)]
    t = torch.arange(batch.num_tokens)
    mask = (t[None] <= t[:, None]) & (t[:, None] < batch.visible_until[None])
    want = torch.tensor([[prefix[q][: len(prefix[k])] == prefix[k] for k in range(batch.num_tokens)]
                         for q in range(batch.num_tokens)])
    assert torch.equal(mask, want)
    assert [back.tolist() for back, _ in batch.sequences()] == seqs
    assert batch.labels.tolist() == [tok for s in seqs for tok in s[1:]]


def test_hand_example():
    batch = pack_sequences([[1, 2, 3, 4], [1, 2, 5], [1, 2], [7, 8], [1, 2, 3, 9, 9], [1, 2, 5]])
    assert batch.input_ids.tolist() == [1, 2, 3, 4, 9, 9, 5, 7, 8]       # depth first, branches in token order
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 3, 4, 2, 0, 1]
    assert batch.visible_until.tolist() == [7, 7, 6, 4, 6, 6, 7, 9, 9]
    assert batch.tree_bounds == ((0, 2, 7), (7, 2, 9))
    # the token after the branch point (3, 5, 3) is predicted from the shared row of "2" (row 1)
    assert batch.predict_index.tolist() == [0, 1, 2, 0, 1, 0, 7, 0, 1, 2, 4, 0, 1]
    assert batch.labels_per_sequence == (3, 2, 1, 1, 4, 2)
    assert batch.logit_rows.tolist() == [0, 1, 2, 4, 7]


def test_depth_one_layout_equals_pack_groups_when_nothing_else_is_shared():
    """(A group with one response would be one segment in the trie: nothing branches.)"""
    groups = [([1, 2, 3], [[4, 5], [6], [7, 8, 9]]), ([10], [[11, 12, 13], [14]])]
    seqs = [p + r for p, rs in groups for r in rs]
    masks = [[False] * len(p) + [True] * len(r) for p, rs in groups for r in rs]
    tree, packed = pack_sequences(seqs, masks), pack_groups(groups)
    for name in ("input_ids", "position_ids", "visible_until", "labels", "predict_index", "logit_rows"):
        assert torch.equal(getattr(tree, name), getattr(packed, name)), name
    assert tree.tree_bounds == packed.group_bounds and tree.labels_per_sequence == packed.response_lens_list


@pytest.mark.parametrize("masks, match", [
    ([[True, True]], "marks token 0 as a label"),
    ([[False, True, True]], r"one entry per token \(2\)"),
    ([[0, 2]], "must hold booleans"),
    ([[False, True], [False]], r"one mask per sequence \(1\)"),
])
def test_bad_loss_masks(masks, match):
    with pytest.raises(ValueError, match=match):
        pack_sequences([[1, 2]], masks)


def test_bad_sequences():
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        pack_sequences([[1], []])
    with pytest.raises(ValueError, match="non-empty list"):
        pack_sequences([])
    with pytest.raises(ValueError, match="sequence 0 holds a negative"):
        pack_sequences([[1, -2]])


# -- attention -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["tree", "stream", "auto"])
def test_sdpa_strategies_equal_the_dense_ancestry_mask(strategy):
    batch = pack_sequences(forest(3))
    n = batch.num_tokens
    torch.manual_seed(0)
    q = torch.randn(1, 4, n, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, n, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, n, 8, dtype=torch.float64, requires_grad=True)
    t = torch.arange(n)
    dense = F.scaled_dot_product_attention(q, k, v,
                                           attn_mask=(t[None] <= t[:, None]) & (t[:, None] < batch.visible_until[None]),
                                           scale=0.35, enable_gqa=True)
    plans = sdpa.build_masks(batch, strategy)
    out = sdpa.attend(q, k, v, plans, batch.tree_bounds, 0.35)
    assert (out - dense).abs().max() < 1e-12
    w = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad((out * w).sum(), (q, k, v)), torch.autograd.grad((dense * w).sum(), (q, k, v))):
        assert (a - b).abs().max() < 1e-12


def test_batched_strategy_refuses_deep_trees():
    with pytest.raises(ValueError, match="'batched' needs depth-one trees"):
        sdpa.build_masks(pack_sequences(forest(0)), "batched")


def test_tree_strategy_works_in_bf16():
    batch = pack_sequences(forest(1))
    n = batch.num_tokens
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, h, n, 16, dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2))
    out = sdpa.attend(q, k, v, sdpa.build_masks(batch, "tree"), batch.tree_bounds, 0.25)
    t = torch.arange(n)
    mask = (t[None] <= t[:, None]) & (t[:, None] < batch.visible_until[None])
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=0.25,
                                          enable_gqa=True)
    assert out.dtype == torch.bfloat16 and (out.double() - want).abs().max() < 2e-2
    out.sum().backward()
    assert all(bool(x.grad.isfinite().all()) for x in (q, k, v))


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_logprobs_and_grads_under_bf16_autocast(family):
    """precision=bf16-mixed (CPU bf16 autocast over fp32 weights): the tree strategy gets q, k, v in one dtype as SDPA
    would (RoPE leaves q, k fp32 beside a bf16 v; the flash kernel refused the mix), and its log-probs and gradients
    are the fp32 ones within bf16's error."""
    model = tiny_model(family, dtype=torch.float32)
    seqs = forest(3)
    batch = pack_sequences(seqs)
    want = sequence_logprobs(model, batch, impl="sdpa")
    want_g = grads(model, sum(p.sum() for p in want))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = sequence_logprobs(model, batch, impl="sdpa")
    got_g = grads(model, sum(p.sum() for p in got))
    for g, w in zip(got, want):
        assert g.shape == w.shape and bool(((g - w).abs() < 0.02).all())
    for name, w in want_g.items():
        assert got_g[name].isfinite().all()
        assert (got_g[name] - w).norm() <= 0.05 * w.norm() + 1e-6, name


def test_block_mask_equals_create_block_mask_on_trees():
    from torch.nn.attention.flex_attention import create_block_mask
    seqs = forest(2) + [[3] * 200 + [4] * 60, [3] * 200 + [5] * 90, [3] * 130]     # several tiles
    batch = pack_sequences(seqs)
    n, vis = batch.num_tokens, batch.visible_until
    want = create_block_mask(lambda b, h, q, kv: (kv <= q) & (q < vis[kv]), None, None, n, n, device="cpu")
    got = flex.build_block_mask(batch)
    assert torch.equal(got.to_dense(), want.to_dense())
    assert torch.equal(got.kv_num_blocks, want.kv_num_blocks)
    assert torch.equal(got.full_kv_num_blocks, want.full_kv_num_blocks)


# -- the model -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("with_masks", [False, True])
def test_fp64_tree_logprobs_losses_and_grads_equal_each_sequence_alone(family, with_masks):
    model = tiny_model(family)
    seqs = forest(10 + len(family))
    masks = masks_for(seqs, 5) if with_masks else None
    temperature = 0.8
    want = alone_logprobs(model, seqs, masks, temperature)
    rng = torch.Generator().manual_seed(0)
    old = [w.detach() + 0.3 * torch.randn(w.shape, generator=rng, dtype=w.dtype) for w in want]
    advantages = torch.randn(len(seqs), generator=rng, dtype=torch.float64)      # one per sequence (leaf)
    want_grads = grads(model, clipped_loss(want, old, advantages))

    batch = pack_sequences(seqs, masks)
    assert batch.num_tokens == trie_nodes(seqs) < batch.num_standard_tokens
    got = sequence_logprobs(model, batch, impl="sdpa", temperature=temperature)
    assert len(got) == len(seqs)
    assert [g.shape for g in got] == [w.shape for w in want]
    assert (torch.cat(got) - torch.cat(want)).abs().max().item() <= LOGP_TOL
    loss, want_loss = clipped_loss(got, old, advantages), clipped_loss(want, old, advantages)
    assert abs(loss.item() - want_loss.item()) <= LOGP_TOL * len(seqs) * 50
    assert_grads_close(grads(model, loss), want_grads)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("impl", ["reference", "flex"])
def test_other_impls_on_trees(impl):
    model = tiny_model("qwen3")
    seqs = forest(4)
    masks = masks_for(seqs, 1)
    with torch.no_grad():                      # flex on CPU is forward only
        want = alone_logprobs(model, seqs, masks)
        got = sequence_logprobs(model, pack_sequences(seqs, masks), impl=impl)
    assert (torch.cat(got) - torch.cat(want)).abs().max().item() <= LOGP_TOL


def test_depth_one_case_gives_pack_groups_numbers():
    """[prompt + response] sequences with the prompt masked out: pack_sequences (which also merges responses'
    common prefixes) gives pack_groups' log-probs and gradients."""
    model = tiny_model("llama")
    rng = random.Random(3)
    groups = [([rng.randrange(VOCAB) for _ in range(p)], [[rng.randrange(VOCAB) for _ in range(r)] for r in rs])
              for p, rs in [(12, [5, 1, 7, 0]), (3, [4, 4])]]
    groups[0][1][2][:2] = groups[0][1][0][:2]              # two responses share their first two tokens
    seqs = [p + r for p, rs in groups for r in rs]
    masks = [[False] * len(p) + [True] * len(r) for p, rs in groups for r in rs]
    tree = pack_sequences(seqs, masks)
    assert tree.num_tokens == trie_nodes(seqs) <= pack_groups(groups).num_tokens - 2
    weights = torch.linspace(-1, 2, sum(len(r) for _, rs in groups for r in rs), dtype=torch.float64)
    want = shared_prompt_logprobs(model, pack_groups(groups))
    want_grads = grads(model, (want * weights).sum())
    got = torch.cat(sequence_logprobs(model, tree))
    assert (got - want).abs().max().item() <= LOGP_TOL
    assert_grads_close(grads(model, (got * weights).sum()), want_grads)


def test_lm_head_runs_once_per_predicting_node():
    model = tiny_model("llama")
    seqs = forest(6)
    batch = pack_sequences(seqs)
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, inp, out: seen.append(inp[0].shape[1]))
    with torch.no_grad():
        sequence_logprobs(model, batch)
    hook.remove()
    # every trie node with a child predicts; each once, however many sequences pass through it
    assert seen == [len({tuple(s[: i + 1]) for s in seqs for i in range(len(s) - 1)})]


def test_value_head_on_trees_equals_each_sequence_alone():
    model = tiny_model("qwen2")
    seqs = forest(7)
    masks = masks_for(seqs, 2)
    head = torch.nn.Linear(model.config.hidden_size, 1, dtype=torch.float64)
    batch = pack_sequences(seqs, masks)
    got = shared_prompt_head(model, batch, head, impl="sdpa")
    want = shared_prompt_head(model, batch, head, impl="reference")
    assert got.shape == (batch.labels.numel(), 1) and (got - want).abs().max().item() <= LOGP_TOL


@pytest.mark.gpu
def test_cuda_flex_tree_logprobs_and_grads_equal_each_sequence_alone():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; this machine has none")
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model("qwen3", dtype=torch.float32).cuda()
    seqs = forest(8) + [[3] * 150 + [4] * 60, [3] * 150 + [5] * 90]
    masks = masks_for(seqs, 3)
    want = [w.cpu() for w in _alone_cuda(model, seqs, masks)]
    want_grads = grads(model, sum((w * (i + 1)).sum() for i, w in enumerate(_alone_cuda(model, seqs, masks))))
    got = sequence_logprobs(model, pack_sequences(seqs, masks), impl="flex")
    assert (torch.cat(got).cpu() - torch.cat(want)).abs().max().item() <= 1e-4
    got_grads = grads(model, sum((g * (i + 1)).sum() for i, g in enumerate(got)))
    for name, g in want_grads.items():
        assert (got_grads[name] - g).abs().max() <= 1e-3 * g.abs().max(), name


def _alone_cuda(model, seqs, masks):
    out = []
    for s, m in zip(seqs, masks):
        ids = torch.tensor([s], device="cuda")
        logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0, :-1].float(), -1)
        logp = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)
        out.append(logp[torch.tensor(m[1:], dtype=torch.bool, device="cuda")])
    return out


def test_block_mask_from_group_and_segment_ids_is_the_depth_one_tree_mask():
    """The layer benchmark's entry (group and segment ids, or documents with every segment 0) gives the same tiles
    as the tree mask of the same layout."""
    groups = [([1] * 130, [[2] * 50, [], [3] * 140]), ([4] * 7, [[5] * 3]), ([6] * 128, [[7] * 128] * 2)]
    batch = pack_groups(groups)
    got = flex.block_mask_from_ids(batch.group_ids, batch.segment_ids)
    assert torch.equal(got.to_dense(), flex.build_block_mask(batch).to_dense())
    docs = torch.repeat_interleave(torch.arange(3), torch.tensor([100, 200, 29]))
    t = torch.arange(docs.numel())
    want = (t[None] <= t[:, None]) & (docs[None] == docs[:, None])
    n = docs.numel()
    q, k, v = torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)
    from torch.nn.attention.flex_attention import flex_attention
    out = flex_attention(q, k, v, block_mask=flex.block_mask_from_ids(docs, torch.zeros_like(docs)))
    assert (out - F.scaled_dot_product_attention(q, k, v, attn_mask=want)).abs().max() < 1e-5


def test_pack_groups_response_masks_keep_only_the_marked_tokens():
    model = tiny_model("qwen3")
    groups = [([1, 2, 3], [[4, 5, 6, 7], [8, 9]])]
    masks = [[[True, False, False, True], [False, True]]]
    with torch.no_grad():
        got = shared_prompt_logprobs(model, pack_groups(groups, masks))
        want = torch.cat(alone_logprobs(model, [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 8, 9]],
                                        [[False] * 3 + [True, False, False, True], [False] * 4 + [True]]))
    assert (got - want).abs().max().item() <= LOGP_TOL
    with pytest.raises(ValueError, match=r"response_masks\[0\] must hold one mask per response \(2\)"):
        pack_groups(groups, [[[True] * 4]])


def test_activation_checkpointing_on_trees_equals_the_run_without():
    """The backward's recompute goes through the tree attention again (its blocks and custom backward included)."""
    import copy

    seqs = forest(9)
    masks = masks_for(seqs, 4)
    plain = tiny_model("qwen3").train()
    checkpointed = copy.deepcopy(plain)
    checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    want = torch.cat(sequence_logprobs(plain, pack_sequences(seqs, masks), impl="sdpa"))
    got = torch.cat(sequence_logprobs(checkpointed, pack_sequences(seqs, masks), impl="sdpa"))
    assert (got - want).abs().max().item() <= 1e-12
    weights = torch.linspace(-1, 1, want.numel(), dtype=torch.float64)
    assert_grads_close(grads(checkpointed, (got * weights).sum()), grads(plain, (want * weights).sum()))


def test_short_sliding_window_is_refused_on_trees():
    seqs = forest(5)
    longest = max(map(len, seqs))
    model = tiny_model("mistral", sliding_window=longest - 1)
    with pytest.raises(ValueError,
                       match=rf"sliding window of {longest - 1} tokens, shorter than .* \({longest} tokens"):
        sequence_logprobs(model, pack_sequences(seqs), impl="sdpa")
    assert model.config._attn_implementation == "sdpa"
    model = tiny_model("mistral", sliding_window=longest)
    with torch.no_grad():
        got = torch.cat(sequence_logprobs(model, pack_sequences(seqs), impl="sdpa"))
        assert (got - torch.cat(alone_logprobs(model, seqs))).abs().max().item() <= LOGP_TOL


@pytest.mark.parametrize("budget", [40, 75, 1000])
def test_token_budget_micro_batches_are_exact_and_within_budget(budget):
    from hetrl.dualkv import split_sequences_by_token_budget

    model = tiny_model("llama")
    seqs = forest(11)
    masks = masks_for(seqs, 6)
    micro = split_sequences_by_token_budget(seqs, budget)
    assert sorted(i for mb in micro for i in mb) == list(range(len(seqs)))
    assert all(pack_sequences([seqs[i] for i in mb]).num_tokens <= budget for mb in micro)
    if budget == 1000:
        assert len(micro) == 1
    got = [None] * len(seqs)
    with torch.no_grad():
        for mb in micro:
            for i, lp in zip(mb, sequence_logprobs(model,
                                                   pack_sequences([seqs[i] for i in mb], [masks[i] for i in mb]))):
                got[i] = lp
        want = alone_logprobs(model, seqs, masks)
    assert (torch.cat(got) - torch.cat(want)).abs().max().item() <= LOGP_TOL
    with pytest.raises(ValueError, match=r"sequence 0 alone has 3 tokens > max_tokens \(2\)"):
        split_sequences_by_token_budget([[1, 2, 3]], 2)


@pytest.mark.gpu
def test_cuda_sdpa_on_deep_trees_takes_the_masked_stream():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; this machine has none")
    batch = pack_sequences(forest(0)).to("cuda")
    assert all(type(p).__name__ == "_Stream" for p in sdpa.build_masks(batch) if p is not None)
    with pytest.raises(ValueError, match="strategy 'tree' runs torch's CPU flash-attention kernel"):
        sdpa.build_masks(batch, "tree")


def test_fp64_tree_grads_are_exact_only_with_fp64_norms():
    """Where the 1e-7 came from: transformers' RMSNorm computes in fp32 even on fp64 inputs, so its backward rounds
    each sequence's gradient to fp32 when the sequences run alone and the tree's summed gradient once: log-probs equal
    to 1e-15, every parameter below the final norm ~1e-7 off. With the norms in fp64 (hetrl.models.float64_norms,
    which load_model applies to dtype=float64) the tree's gradients are exact to 1e-10; the tree path itself has no
    lower-precision step."""
    from hetrl.models import float64_norms

    from .oracle import TINY
    config_cls, model_cls, extra = FAMILIES["llama"]
    torch.manual_seed(0)
    model = model_cls(config_cls(**(TINY | extra))).double()
    seqs = forest(4)
    rng = torch.Generator().manual_seed(0)

    def both():
        want = alone_logprobs(model, seqs)
        old = [w.detach() + 0.3 * torch.randn(w.shape, generator=rng, dtype=w.dtype) for w in want]
        adv = torch.randn(len(seqs), generator=rng, dtype=torch.float64)
        want_g = grads(model, clipped_loss(want, old, adv))
        got_g = grads(model, clipped_loss(sequence_logprobs(model, pack_sequences(seqs), impl="sdpa"), old, adv))
        return max(((got_g[k] - w).norm() / w.norm()).item() for k, w in want_g.items())

    assert both() > 1e-9          # transformers' norms: fp32 inside
    float64_norms(model)
    assert both() < 1e-12


def test_float64_norms_leave_a_norm_of_another_form_alone():
    from hetrl.models import Float64RMSNorm, float64_norms

    class GemmaLikeRMSNorm(torch.nn.Module):     # (1 + weight) x normed, as Gemma's
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(8, dtype=torch.float64))

        def forward(self, x):
            return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    class LlamaLikeRMSNorm(GemmaLikeRMSNorm):
        def forward(self, x):
            return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    model = torch.nn.Sequential(GemmaLikeRMSNorm(), LlamaLikeRMSNorm())
    float64_norms(model)
    assert isinstance(model[0], GemmaLikeRMSNorm) and isinstance(model[1], Float64RMSNorm)
