"""CUDA paths: flex (compiled, forward and backward) and sdpa against the standard forward. Skipped without a GPU."""

import pytest
import torch

from hetrl.dualkv import pack_groups, shared_prompt_logprobs

from .oracle import random_groups, standard_logprobs, tiny_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("impl", ["flex", "sdpa", "auto"])
def test_cuda_logprobs_and_grads_equal_standard(impl):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model("qwen3", dtype=torch.float32).cuda()
    groups = random_groups(0, [130, 7], [[40, 0, 1, 90], [5, 5]])
    want = standard_logprobs(model, groups)
    model.zero_grad(set_to_none=True)
    want.sum().backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    got = shared_prompt_logprobs(model, pack_groups(groups), impl=impl)
    got.sum().backward()
    assert (got - want).abs().max() <= 1e-4
    for name, p in model.named_parameters():
        assert (p.grad - want_grads[name]).abs().max() <= 1e-3 * want_grads[name].abs().max(), name


def test_the_layer_benchmark_runs_on_cuda_in_bf16():
    """`hetrl bench dualkv --layer tiny --device cuda --checkpointing`: flex DualKV, with and without checkpointing,
    against the three packed kernels (flash varlen, flex with a document mask, SDPA per sequence) and
    prefix-grouper, bf16, CUDA events; every layout runs (none errs) and agrees with DualKV."""
    from hetrl.bench import dualkv_layer

    res = dualkv_layer.run("tiny", "cuda", repeats=2, checkpointing=True)
    assert res["dtype"] == "bfloat16" and res["gpu"]
    for r in res["rows"]:
        for k, e in r["layouts"].items():
            assert "error" not in e, (k, e["error"])
            if "skipped" in e:
                assert k == "prefix_grouper", (k, e["skipped"])     # only where the package is not carried
                continue
            assert e["peak_bytes"] > 0 and e["seconds"] > 0, k
            if k != "dualkv":
                assert e["max_abs_logprob_diff"] < 0.1, k       # bf16 log-probs over a 256-token vocabulary


def test_flex_trains_on_a_stream_shorter_than_one_tile_in_bf16():
    """A 98-token bf16 stream at head dim 16 (the tiny layer's 64-token prompt and two responses): flex's own
    choice, its decoding kernel, failed to compile this pass on the first lent GPU (NoValidChoicesError);
    `attend` asks for the standard kernel. Forward and gradients against eager SDPA with the same tree mask."""
    from hetrl.dualkv.impl import flex

    torch.manual_seed(0)
    n, d = 98, 16
    group = torch.zeros(n, dtype=torch.long, device="cuda")
    seg = torch.zeros(n, dtype=torch.long, device="cuda")
    seg[64:80], seg[80:] = 1, 2
    mask = flex.block_mask_from_ids(group, seg)
    q = torch.randn(1, 4, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 2, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = flex.attend(q, k, v, mask, d ** -0.5)
    out.float().square().sum().backward()
    got = [out.detach().float()] + [x.grad.float() for x in (q, k, v)]
    idx = torch.arange(n, device="cuda")
    seen = (idx[None] <= idx[:, None]) & ((seg[None] == 0) | (seg[None] == seg[:, None]))   # [q, kv]
    q2, k2, v2 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q2, k2.repeat_interleave(2, 1), v2.repeat_interleave(2, 1),
                                                           attn_mask=seen, scale=d ** -0.5)
    ref.square().sum().backward()
    for g, want in zip(got, [ref.detach(), q2.grad, k2.grad, v2.grad]):
        assert torch.isfinite(g).all() and (g - want).norm() <= 2e-2 * want.norm()
