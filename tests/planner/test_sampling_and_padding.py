"""Two workload terms against equivalent workloads and hand-computed values: dynamic sampling (the rollout generates
rollout_batch_multiplier x the trained prompts; the passes and the update run on the kept ones) and padding (the
passes compute over prompts, or prompts and responses, padded to their maxima). Absent, both leave every plan
priced as before (test_baseline_scores.py holds that bit for bit)."""

import pytest

from hetrl.planner.cost import SAMPLE_BYTES_PER_TOKEN, _tokens_and_pairs, estimate, sample_bytes, task_costs
from hetrl.planner.plan import Group, Parallelism, Plan
from hetrl.planner.spec import cluster_from_dict, workload_from_dict
from hetrl.schema import InputError


def _cluster():
    return cluster_from_dict({"name": "h", "nodes": [{"name": f"h{i}", "region": "r", "gpu": "H100", "count": 8,
                                                      "network_gbps": 400} for i in range(2)]})


def _workload(**kw):
    base = {"algorithm": "dapo", "models": {"actor": "qwen3-8b", "reference": None}, "prompts_per_step": 32,
            "responses_per_prompt": 8, "prompt_tokens": {"max": 1024, "mean": 300},
            "response_tokens": {"max": 4096, "mean": 1500}, "dualkv": False, "micro_batch_responses": 2}
    return workload_from_dict({**base, **kw})


def _plan():
    gen = Group(("actor_gen",), tuple(range(8)), (("actor_gen", Parallelism(2, 1, 4)),))
    par = Parallelism(1, 1, 8, zero=3)
    train = Group(("actor_infer", "actor_train"), tuple(range(8, 16)), (("actor_infer", par), ("actor_train", par)))
    return Plan((gen, train))


def _costs(w):
    c, p = _cluster(), _plan()
    e = estimate(c, w, p)
    assert e.feasible, e.reason
    return e.task_times_s, e.task_terms


def test_dynamic_sampling_generates_the_multiplied_batch_and_trains_the_kept_one():
    kept, drawn = _costs(_workload(rollout_batch_multiplier=3)), _costs(_workload(prompts_per_step=96))
    plain = _costs(_workload())
    assert kept[0]["actor_gen"] == drawn[0]["actor_gen"]             # generation: 96 prompts' worth, exactly
    assert kept[1]["actor_gen"] == drawn[1]["actor_gen"]
    for task in ("actor_infer", "actor_train"):                       # the passes: the 32 kept prompts
        assert kept[0][task] == plain[0][task] and kept[1][task] == plain[1][task]
    w = _workload(rollout_batch_multiplier=3)
    assert w.samples == 256 and w.generated_samples == 768
    assert sample_bytes(w) == 768 * (1024 + 4096) * SAMPLE_BYTES_PER_TOKEN


def test_padding_prices_the_passes_at_the_padded_lengths():
    g, n = 32, 8
    assert _tokens_and_pairs(_workload(padding="max")) == (g * n * (1024 + 4096), g * n * (1024 + 4096) ** 2 / 2)
    assert _tokens_and_pairs(_workload(padding="prompt")) == (g * n * (1024 + 1500), g * n * (1024 + 1500) ** 2 / 2)
    padded = _costs(_workload(padding="max"))
    at_max = _costs(_workload(prompt_tokens={"max": 1024, "mean": 1024}, response_tokens={"max": 4096, "mean": 4096}))
    plain = _costs(_workload())
    for task in ("actor_infer", "actor_train"):                       # as if every sample were as long as the caps
        assert padded[0][task] == at_max[0][task] and padded[1][task] == at_max[1][task]
        assert padded[0][task] > plain[0][task]
    assert padded[0]["actor_gen"] == plain[0]["actor_gen"]            # generation decodes the real lengths
    prompt = _costs(_workload(padding="prompt"))
    at_prompt_max = _costs(_workload(prompt_tokens={"max": 1024, "mean": 1024}))
    assert prompt[0]["actor_train"] == at_prompt_max[0]["actor_train"]


def test_task_costs_of_a_group_see_the_same_terms():
    w, c, p = _workload(rollout_batch_multiplier=2, padding="prompt"), _cluster(), _plan()
    e = estimate(c, w, p)
    for group in p.groups:
        for task, cost in task_costs(c, w, group).items():
            assert cost.seconds == e.task_times_s[task]


@pytest.mark.parametrize("field, value, match", [("padding", "left", "none.*prompt.*max"),
                                                 ("rollout_batch_multiplier", 0.5, ">= 1")])
def test_bad_values_are_refused_with_the_valid_choices(field, value, match):
    with pytest.raises((InputError, ValueError), match=match):
        _workload(**{field: value})
