"""Multi-turn tool-use workloads in the cost model (issue 38, item 7): a workload describes turns, tool results,
tool latency and branching; generation pays one decode per turn and a tool wait per turn boundary, and the update
is priced by the tree's unique tokens. Hand-computed on a small case; single-turn workloads price as before
(test_baseline_scores.py holds that bit for bit)."""

import dataclasses

import pytest

from hetrl.planner.cost import _tokens_and_pairs, task_costs
from hetrl.planner.plan import Group, Parallelism
from hetrl.planner.spec import cluster_from_dict, workload_from_dict

MODEL = dict(layers=4, hidden=256, heads=4, kv_heads=4, head_dim=64, intermediate=512, vocab=1000, name="m")
# P = 100, R = 10 per turn, U = 20 per tool result, N = 2 rollouts forking into K = 2, 3 turns
EPISODES = dict(algorithm="grpo", mode="sync", models={"actor": MODEL, "reference": None},
                prompts_per_step=4, responses_per_prompt=2, prompt_tokens={"max": 100, "mean": 100},
                response_tokens={"max": 10, "mean": 10}, turns=3, tool_tokens={"max": 20, "mean": 20},
                tool_latency_s=0.5, branches=2)


def _w(**over):
    return workload_from_dict({**EPISODES, **over})


def test_the_tree_of_a_task_by_hand():
    w = _w()
    # both rollouts fork at the first result (4 leaves = N x K, the default max_leaves); no room at the second
    assert w.turn_rows == (2, 4, 4) and w.leaves == 4 and w.samples == 16 and w.micro_batch_responses == 4
    assert (w.completion_tokens.max, w.completion_tokens.mean) == (3 * 10 + 2 * 20, 70.0)
    assert _w(max_leaves=6).turn_rows == (2, 4, 6)   # the first two of four episodes fork again
    assert _w(max_leaves=3).turn_rows == (2, 3, 3)
    assert _w(branches=1).turn_rows == (2, 2, 2)
    # unique tokens: P + 2 x 30 + 4 x 30 + 4 x 10 = 320 per task, each attending to its ancestors:
    # 100^2/2 + 2 (30 x 100 + 450) + 4 (30 x 130 + 450) + 4 (10 x 160 + 50) = 5000 + 6900 + 17400 + 6600
    assert _tokens_and_pairs(w) == (4 * 320, 4 * 35900)
    # linear (no DualKV): 4 leaves of 100 + 70 tokens each
    assert _tokens_and_pairs(dataclasses.replace(w, dualkv=False)) == (4 * 4 * 170, 4 * 4 * 170 ** 2 / 2)
    # two leaves per micro-batch: the prompt runs twice per task, the turns once
    assert _tokens_and_pairs(dataclasses.replace(w, micro_batch_responses=2)) == (4 * 420, 4 * 40900)
    # padded to the maxima: turns of 12 and results of 25 tokens (the prompt is at its max already)
    padded = _w(response_tokens={"max": 12, "mean": 10}, tool_tokens={"max": 25, "mean": 20}, padding="max")
    assert _tokens_and_pairs(padded)[0] == 4 * (100 + 2 * 37 + 4 * 37 + 4 * 12)


def _costs(w):
    cluster = cluster_from_dict(dict(name="one", nodes=[dict(name="n", region="r", gpu="H100", count=1)]))
    par = Parallelism()
    group = Group(("actor_gen", "actor_train"), (0,), (("actor_gen", par), ("actor_train", par)))
    return task_costs(cluster, w, group)


def test_generation_waits_for_tools_and_decodes_each_turn(roofline_only):
    w = _w()
    gen = _costs(w)["actor_gen"]
    assert gen.terms["tool_wait"] == 2 * 0.5                     # two turn boundaries, each one round of calls
    slow = _costs(dataclasses.replace(w, tool_latency_s=3.0))["actor_gen"]
    assert slow.seconds - gen.seconds == pytest.approx(2 * 2.5, rel=1e-12)
    # a turn is a decode of R_max steps at least: three turns cost more than one turn of the same model tokens
    one = workload_from_dict({**EPISODES, "turns": 1, "tool_tokens": None, "tool_latency_s": 0.0, "branches": 1,
                              "response_tokens": {"max": 30, "mean": 30}, "responses_per_prompt": 4})
    assert "tool_wait" not in _costs(one)["actor_gen"].terms
    assert gen.seconds - gen.terms["tool_wait"] > _costs(one)["actor_gen"].seconds


def test_the_update_is_priced_by_unique_tokens():
    """actor_train's compute is its FLOPs over the GPU's speed: 8 N tokens + 4 x attention (recompute), with the
    tree's tokens and pairs; the same leaves run linearly cost what their linear tokens and pairs give."""
    tree, linear = _w(), _w(dualkv=False)
    params = tree.actor.active_params
    attn = 4 * MODEL["layers"] * MODEL["heads"] * MODEL["head_dim"]

    def flops(tokens, pairs):
        return 8 * params * tokens + 4 * attn * pairs

    ratio = _costs(linear)["actor_train"].terms["compute"] / _costs(tree)["actor_train"].terms["compute"]
    assert ratio == pytest.approx(flops(4 * 4 * 170, 4 * 4 * 170 ** 2 / 2) / flops(4 * 320, 4 * 35900), rel=1e-12)


def test_bad_episode_fields_are_one_line():
    with pytest.raises(ValueError, match="give its length as tool_tokens"):
        workload_from_dict({**EPISODES, "tool_tokens": None})
    with pytest.raises(ValueError, match="and turns is 1"):
        workload_from_dict({**EPISODES, "turns": 1})
    with pytest.raises(ValueError, match="use at least 2"):
        _w(max_leaves=1)
    with pytest.raises(ValueError, match="branches is 1"):
        _w(branches=1, max_leaves=4)


def test_an_export_runs_the_episodes_as_single_turn_and_says_so():
    from hetrl.integrations import verl
    from hetrl.integrations.common import workload_dict
    from hetrl.planner import load_cluster, plan

    c = load_cluster("examples/clusters/h100-2x8.yaml")
    w = _w(models={"actor": "qwen3-8b", "reference": "qwen3-8b"}, prompts_per_step=64, turns=3)
    v = verl.view(c, w, plan(c, w, "hybrid").plan)
    (gap,) = [g for g in v.gaps if g.field == "workload.turns"]
    assert "single-turn" in gap.text and "4 leaves" in gap.text
    assert v.workload.turns == 1 and v.workload.responses_per_prompt == 4
    assert v.workload.response_tokens == w.completion_tokens
    back = workload_dict(v.workload, {**EPISODES, "turns": 3})
    assert "turns" not in back and "tool_tokens" not in back
    assert workload_dict(w, {})["turns"] == 3
