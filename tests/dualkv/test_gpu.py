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
