"""Model shapes real runs use (issue 44): hybrid attention stacks (linear-attention and sliding-window layers) and
vision towers, priced by hand-computed terms; bad combinations refused in one line."""

import dataclasses

import pytest

from hetrl.planner.cost import _tokens_and_pairs, _vision_tokens, task_costs
from hetrl.planner.plan import Group, Parallelism
from hetrl.planner.spec import PRESETS, ModelSpec, cluster_from_dict, workload_from_dict

DENSE = dict(layers=8, hidden=1024, heads=8, kv_heads=2, head_dim=128, intermediate=4096, vocab=32000)


def _w(actor, **kw):
    base = {"algorithm": "grpo", "models": {"actor": actor, "reference": actor}, "prompts_per_step": 16,
            "responses_per_prompt": 4, "prompt_tokens": {"max": 1024, "mean": 512},
            "response_tokens": {"max": 1024, "mean": 512}, "dualkv": False, "micro_batch_responses": 1}
    return workload_from_dict({**base, **kw})


def _costs(w, tp=1):
    cluster = cluster_from_dict({"name": "h", "nodes": [{"name": "h", "region": "r", "gpu": "H100", "count": 8}]})
    par = Parallelism(tp, 1, 8 // tp)
    tasks = ("actor_gen", "ref_infer", "actor_train")
    return task_costs(cluster, w, Group(tasks, tuple(range(8)), tuple((t, par) for t in tasks)))


def test_only_full_attention_layers_cache_every_token():
    m = ModelSpec(**DENSE, linear_attention_layers=4, sliding_window_layers=2, sliding_window=128)
    assert m.full_attention_layers == 2
    assert m.kv_bytes_per_token == 2 * 2 * 2 * 128 * 2          # 2 layers x K,V x 2 heads x 128 x 2 bytes
    nxt = PRESETS["qwen3-next-80b-a3b"]
    assert nxt.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2       # every 4th of 48 layers
    assert 78e9 < nxt.params < 81e9 and 3.0e9 < nxt.active_params < 3.5e9   # "80B-A3B"


def test_attention_flops_by_layer_kind():
    plain, pairs, tokens = ModelSpec(**DENSE), 1e9, 1e5
    assert plain.attention_flops(pairs, tokens) == 4 * 8 * 8 * 128 * pairs     # the formula before hybrid stacks
    hybrid = ModelSpec(**DENSE, linear_attention_layers=4, sliding_window_layers=2, sliding_window=128)
    want = 4 * 8 * 128 * (2 * pairs + 2 * min(pairs, tokens * 128) + 4 * tokens * 128)
    assert hybrid.attention_flops(pairs, tokens) == pytest.approx(want, rel=1e-12)
    wide = dataclasses.replace(hybrid, sliding_window=10**9)     # a window wider than the sequence: every pair
    assert wide.attention_flops(pairs, tokens) == pytest.approx(4 * 8 * 128 * (4 * pairs + 4 * tokens * 128))


def test_linear_attention_layers_shorten_the_passes_and_the_decode_reads():
    plain = {**DENSE, "name": "plain"}
    hybrid = {**DENSE, "name": "hybrid", "linear_attention_layers": 6}
    a, b = _costs(_w(plain)), _costs(_w(hybrid))
    assert b["actor_train"].terms["compute"] < a["actor_train"].terms["compute"]
    assert b["actor_gen"].terms["hbm"] == pytest.approx(a["actor_gen"].terms["hbm"] * 2 / 8, rel=1e-9)  # KV reads
    assert b["actor_gen"].terms["decode_ops"] == a["actor_gen"].terms["decode_ops"]   # same projections


def test_a_vision_tower_encodes_each_prompt_copys_images():
    vlm = {**DENSE, "name": "vlm", "vision_params": 600_000_000}
    text = {**DENSE, "name": "vlm", "vision_params": 600_000_000}
    w, w0 = _w(vlm, image_patches=256), _w(text)
    assert _vision_tokens(w) == 16 * 4 * 256                      # no DualKV: one prompt copy per response
    assert _vision_tokens(dataclasses.replace(w, dualkv=True, micro_batch_responses=4)) == 16 * 1 * 256
    a, b = _costs(w0), _costs(w)
    flops = 989e12 * 0.45 * 8                                     # MFU_TRAIN on 8 H100s, each its own replica
    assert b["actor_train"].terms["compute"] - a["actor_train"].terms["compute"] == pytest.approx(
        8 * 600e6 * 16 * 4 * 256 / flops, rel=1e-9)               # forward, recompute, backward
    assert b["actor_gen"].terms["compute"] > a["actor_gen"].terms["compute"]   # encoded once per prompt, prefill
    assert _tokens_and_pairs(w) == _tokens_and_pairs(w0)          # the image tokens are part of the prompt already


def test_bad_hybrid_and_vision_inputs_are_refused():
    with pytest.raises(ValueError, match="exceed its 8 layers"):
        ModelSpec(**DENSE, linear_attention_layers=6, sliding_window_layers=3, sliding_window=64)
    with pytest.raises(ValueError, match="go together"):
        ModelSpec(**DENSE, sliding_window_layers=2)
    with pytest.raises(ValueError, match="has none; give the model vision_params"):
        _w({**DENSE, "name": "text"}, image_patches=64)
    with pytest.raises(ValueError, match="at most prompt_tokens.max"):
        _w({**DENSE, "name": "vlm", "vision_params": 10**8}, image_patches=4096)
