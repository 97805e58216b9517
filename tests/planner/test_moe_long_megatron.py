"""Issue #37's terms against hand-computed values: MoE (total vs active parameters, expert parallelism's memory
and all-to-alls, grouped-GEMM efficiency, load imbalance, FSDP gathering every expert), long sequences (token
budgets, Ulysses sp, logits bounded), Megatron (sequence parallelism, interleaved pipeline, distributed
optimizer), operator tables; bad values refused with the valid choices; ILP == exhaustive with ep in the space."""

import math
import random

import pytest

from hetrl.planner import estimate, plan
from hetrl.planner.catalog import ATTENTION_EFFICIENCY_BY_SEQLEN, GEMM_TILE_M, attention_efficiency, gemm_efficiency
from hetrl.planner.cost import (
    GATHERED_LAYERS,
    HBM_EFF,
    LOGIT_CHUNK_TOKENS,
    MFU_TRAIN,
    MOE_LOAD_IMBALANCE,
    alltoall_s,
    param_split,
    task_costs,
    task_memory,
)
from hetrl.planner.plan import Group, Parallelism, plan_from_dict
from hetrl.planner.space import expert_degrees, parallelisms
from hetrl.planner.spec import GBIT, PRESETS, cluster_from_dict, model_spec, workload_from_dict

TINY_MOE = dict(layers=8, hidden=1024, heads=8, kv_heads=2, head_dim=128, intermediate=0, vocab=32000,
                experts=16, experts_per_token=2, moe_intermediate=512, name="tiny-moe")


def _h100(nodes=1, gbps=400):
    return cluster_from_dict({"name": "h", "nodes": [{"name": f"h{i}", "region": "r", "gpu": "H100", "count": 8,
                                                      "network_gbps": gbps} for i in range(nodes)]})


def _workload(actor="qwen3-30b-a3b", **kw):
    base = {"algorithm": "grpo", "models": {"actor": actor, "reference": actor}, "prompts_per_step": 32,
            "responses_per_prompt": 8, "prompt_tokens": {"max": 1024, "mean": 512},
            "response_tokens": {"max": 2048, "mean": 1024}, "dualkv": False, "micro_batch_responses": 1}
    return workload_from_dict({**base, **kw})


def _group(cluster, w, train: Parallelism, gen=None, n=8):
    gpus = tuple(range(n))
    tasks = ("actor_gen", "actor_infer", "ref_infer", "actor_train")
    gen = gen or Parallelism(1, 1, n)
    return Group(tasks, gpus, (("actor_gen", gen), ("actor_infer", train), ("ref_infer", train),
                               ("actor_train", train)), swap=True)


# ------------------------------------------------------------------------------------------ MoE in workloads


def test_presets_count_total_and_active_parameters():
    """Published sizes: Qwen3-30B-A3B 30.5B / 3.3B, Qwen3-235B-A22B 235B / 22B, DeepSeek-V3 671B / 37B,
    gpt-oss-120b 117B / 5.1B (its active count differs by the sliding-window layers' and sinks' detail)."""
    want = {"qwen3-30b-a3b": (30.5, 3.3), "qwen3-235b-a22b": (235, 22), "deepseek-v3": (671, 37.5),
            "gpt-oss-120b": (117, 5.7)}
    for name, (total, active) in want.items():
        m = PRESETS[name]
        assert m.params / 1e9 == pytest.approx(total, rel=0.02), name
        assert m.active_params / 1e9 == pytest.approx(active, rel=0.05), name
    ds = PRESETS["deepseek-v3"]
    assert (ds.moe_layers, ds.dense_layers) == (58, 3)
    assert ds.kv_bytes_per_token == 61 * (512 + 64) * 2      # MLA caches its latent and rope key


def test_moe_layer_pattern_by_hand():
    m = model_spec({**TINY_MOE, "intermediate": 4096, "first_k_dense": 2, "moe_every": 2,
                    "shared_intermediate": 256})
    assert m.moe_layers == 3 and m.dense_layers == 5          # layers 3, 5, 7 are MoE
    h = 1024
    attn = h * 128 * (2 * 8 + 2 * 2)
    moe = 16 * 3 * h * 512 + h * 16 + 3 * h * 256
    dense = 3 * h * 4096
    assert m.params == 8 * attn + 3 * moe + 5 * dense + 2 * 32000 * h
    assert m.active_params == 8 * attn + 3 * (2 * 3 * h * 512 + h * 16 + 3 * h * 256) + 5 * dense + 2 * 32000 * h


def test_memory_by_total_parameters_compute_by_active():
    c, w = _h100(), _workload(micro_batch_responses=8)     # 12,288 tokens per micro-batch: 768 per expert
    m = w.actor
    mem = task_memory(w, "actor_train", Parallelism(1, 1, 8))
    assert mem.weights == 2 * m.params                        # every expert held (ep 1)
    dense_twin = _workload(actor={"layers": 48, "hidden": 2048, "heads": 32, "kv_heads": 4, "head_dim": 128,
                                  "intermediate": 1, "vocab": 151936}, micro_batch_responses=8)
    # compute: the MoE trains like a dense model with its active parameters (ep 1, large tokens per expert)
    moe = task_costs(c, w, _group(c, w, Parallelism(1, 1, 8)))["actor_train"].terms["compute"]
    dense = task_costs(c, dense_twin, _group(c, dense_twin, Parallelism(1, 1, 8)))["actor_train"].terms["compute"]
    tokens = 32 * 8 * (512 + 1024)
    attn = 16 * 48 * 32 * 128 * 32 * 8 * (512 + 1024) ** 2 / 2
    speed = 8 * 989e12 * MFU_TRAIN
    assert moe == pytest.approx((8 * m.active_params * tokens + attn) / speed, rel=1e-12)
    assert moe > dense


def test_expert_parallel_memory_by_hand():
    w = _workload()
    m = w.actor
    par = Parallelism(2, 1, 4, ep=8, zero=1)
    dense = (m.params - m.expert_params) / 2
    experts = m.expert_params / 8
    assert param_split(m, par)[:2] == pytest.approx((dense + experts, dense / 4 + experts / 1))
    mem = task_memory(w, "actor_train", par)
    assert mem.weights == pytest.approx(2 * (dense + experts))
    # distributed optimizer: dense states over the 4 DP ranks, the experts' over tp*dp/ep = 1 rank
    assert mem.states == pytest.approx(2 * (dense + experts) + 12 * (dense / 4 + experts))


def test_fsdp_over_moe_gathers_every_expert():
    w = _workload()
    m = w.actor
    mem = task_memory(w, "actor_train", Parallelism(1, 1, 8, zero=3))
    layer = m.attn_params_per_layer + m.expert_params_per_layer + m.hidden * m.experts
    assert mem.weights == pytest.approx(2 * m.params / 8 + GATHERED_LAYERS * 2 * layer)
    with_ep = task_memory(w, "actor_train", Parallelism(1, 1, 8, zero=3, ep=8))
    assert with_ep.weights < mem.weights                       # a rank gathers only its experts' shards


def test_alltoall_by_hand():
    one = _h100()
    ids = list(range(8))
    got = alltoall_s(one, ids, 1e9, messages=3)
    nvlink = 450e9 * 370 / 450        # NCCL's bus efficiency on NVLink (catalog.NVLINK_BUS_EFFICIENCY)
    assert got == pytest.approx(7 / 8 * 1e9 / nvlink + 3 * 5e-6)
    two = _h100(2, gbps=400)
    ids = [0, 1, 2, 3, 8, 9, 10, 11]
    got = alltoall_s(two, ids, 1e9)
    # half of each GPU's bytes leave its node; the node's 4 GPUs of this group share its 400 Gb/s NIC
    assert got == pytest.approx(max(3 / 8 * 1e9 / nvlink, 4 / 8 * 1e9 / (400 * GBIT / 4)) + 50e-6)


def _ep_comm_by_hand(nvlink_bytes_per_s):
    c, w = _h100(), _workload()
    m = w.actor
    par = Parallelism(1, 1, 8, ep=8)
    terms = task_costs(c, w, _group(c, w, par))["actor_train"].terms
    tokens = 32 * 8 * (512 + 1024)
    micro_batches = 32 * 8 // 8
    nbytes = tokens / 8 * m.experts_per_token * m.hidden * 2
    want = 2 * 3 * m.moe_layers * (7 / 8 * nbytes / nvlink_bytes_per_s + micro_batches * 5e-6)
    assert terms["ep_comm"] == pytest.approx(want, rel=1e-12)


def test_ep_comm_term_by_hand(roofline_only):
    _ep_comm_by_hand(370e9)   # NCCL's bus efficiency on NVLink without the tables


def test_ep_comm_from_the_ep_tables_by_hand():
    # DeepEP's normal kernels, EP 8 in one H800 node: dispatch 153 and combine 158 GB/s of the H800's 200 GB/s one
    # way; H100's 450 GB/s at that fraction
    _ep_comm_by_hand(450e9 * (153 + 158) / 2 / 200)


def test_grouped_gemm_efficiency_falls_with_tokens_per_expert():
    flops, hbm = 989e12 * MFU_TRAIN, 3.35e12 * HBM_EFF
    effs = [gemm_efficiency(m, 2048, 1536, flops, hbm) for m in (16, 64, 128, 512, 4096)]
    assert effs == sorted(effs) and effs[-1] == 1.0 and effs[0] < 0.1
    m = 64   # half a tile, and memory-bound: intensity 64*2048*1536 / (64*2048 + 2048*1536 + 64*1536)
    intensity = m * 2048 * 1536 / (m * 2048 + 2048 * 1536 + m * 1536)
    assert gemm_efficiency(m, 2048, 1536, flops, hbm) == pytest.approx(m / GEMM_TILE_M * intensity * hbm / flops)
    # in a plan: fewer tokens per micro-batch -> fewer tokens per expert -> more compute per FLOP
    c = _h100()
    big, small = _workload(micro_batch_responses=8), _workload(prompt_tokens={"max": 64, "mean": 32},
                                                               response_tokens={"max": 64, "mean": 32})
    def per_token(w):
        t = task_costs(c, w, _group(c, w, Parallelism(1, 1, 8)))["actor_train"].terms["compute"]
        tokens = 32 * 8 * (w.prompt_tokens.mean + w.response_tokens.mean)
        return t / tokens
    assert per_token(small) > per_token(big)


def test_load_imbalance_is_a_stated_factor_under_ep():
    c, w = _h100(), _workload(micro_batch_responses=8)
    base = task_costs(c, w, _group(c, w, Parallelism(1, 1, 8)))["actor_train"].terms["compute"]
    ep = task_costs(c, w, _group(c, w, Parallelism(1, 1, 8, ep=8)))["actor_train"].terms["compute"]
    m = w.actor
    tokens = 32 * 8 * (512 + 1024)
    experts = 8 * m.expert_active_params * tokens / (8 * 989e12 * MFU_TRAIN)
    assert ep - base == pytest.approx(experts * (MOE_LOAD_IMBALANCE - 1), rel=1e-9)


@pytest.mark.parametrize("tables", [True, False])
def test_generation_with_ep_reads_its_experts_only(tables, request):
    """Under EP a GPU reads its own experts only: by the HBM roofline (tables off), or as the local experts'
    GEMMs of the operator tables (decode_ops)."""
    if not tables:
        request.getfixturevalue("roofline_only")
    c, w = _h100(), _workload()
    g1 = task_costs(c, w, _group(c, w, Parallelism(1, 1, 8), gen=Parallelism(2, 1, 4)))["actor_gen"].terms
    g8 = task_costs(c, w, _group(c, w, Parallelism(1, 1, 8), gen=Parallelism(2, 1, 4, ep=8)))["actor_gen"].terms
    weights = "decode_ops" if tables else "hbm"
    assert g8[weights] < g1[weights] and g8["ep_comm"] > 0
    assert "ep_comm" not in g1


def test_ep_in_the_space_follows_the_rule():
    w = _workload(actor=TINY_MOE)
    assert expert_degrees(w.actor, 2, 4) == [2, 4, 8]       # divisors of 16 experts that divide tp*dp = 8
    assert expert_degrees(PRESETS["qwen3-8b"], 2, 4) == []
    eps = {p.ep for p in parallelisms(w, "actor_train", 8)}
    assert eps == {1, 2, 4, 8}
    assert {p.sp for p in parallelisms(w, "actor_train", 8)} == {1}
    assert {p.sp for p in parallelisms(w, "actor_train", 8, long_sequences=True)} == {1, 2, 4, 8}
    assert {p.sp for p in parallelisms(w, "actor_gen", 8, long_sequences=True)} == {1}


TYPES = ["A100-80G", "A100-40G", "L40S", "H100", "A10G"]


def _small_cluster(seed):
    rng = random.Random(seed)
    types = rng.sample(TYPES, 2)
    nodes = [dict(name=f"n{i}", region="r1", gpu=t, count=rng.choice([2, 4]),
                  intra_node="nvlink" if t in ("A100-80G", "A100-40G", "H100") else "pcie",
                  network_gbps=rng.choice([100, 400])) for i, t in enumerate(types)]
    return cluster_from_dict(dict(name=f"moe-{seed}", nodes=nodes))


@pytest.mark.parametrize("seed", range(4))
def test_ilp_equals_exhaustive_with_ep_in_the_space(seed):
    c = _small_cluster(seed)
    w = _workload(actor=TINY_MOE, prompts_per_step=16, mode=random.Random(seed).choice(["sync", "async"]))
    ex = plan(c, w, "exhaustive")
    il = plan(c, w, "ilp")
    assert il.optimality_gap == 0.0
    assert il.iteration_time_s == pytest.approx(ex.iteration_time_s, rel=1e-9)
    e = estimate(c, w, ex.plan)
    assert e.feasible and e.iteration_time_s == pytest.approx(ex.iteration_time_s, rel=1e-9)


def test_the_optimum_is_no_slower_than_any_ep_plan_of_the_space():
    """The exhaustive optimum over a space that holds ep is no slower than hand-written colocated plans at every
    admissible ep (each is a member of the space), and it round-trips through JSON with its ep."""
    c = _h100()
    w = _workload(actor=TINY_MOE, prompts_per_step=16)
    best = plan(c, w, "exhaustive")
    tasks = ["actor_gen", "actor_infer", "ref_infer", "actor_train"]
    for ep in (1, 2, 4, 8):
        par = {"tp": 1, "pp": 1, "dp": 8, **({"ep": ep} if ep > 1 else {})}
        p = plan_from_dict({"groups": [{"tasks": tasks, "gpus": [f"h0:{i}" for i in range(8)],
                                        "parallelism": {t: par for t in tasks}}]}, c, w)
        e = estimate(c, w, p)
        assert e.feasible and best.iteration_time_s <= e.iteration_time_s * (1 + 1e-12), ep
    assert plan_from_dict(best.plan.to_dict(c), c, w) == best.plan


# ------------------------------------------------------------------------------------------ long sequences


def test_token_budget_sets_micro_batches_and_activation_memory():
    w = _workload(max_tokens_per_micro_batch=8192)
    m = w.actor
    for recompute in (True, False):
        par = Parallelism(1, 1, 8, recompute=recompute)
        mem = task_memory(w, "actor_train", par)
        logits = LOGIT_CHUNK_TOKENS * m.vocab * 4
        if recompute:
            want = 8192 * m.hidden * 2 * m.layers + 34 * 8192 * m.hidden + 2 * logits
        else:
            want = 34 * 8192 * m.hidden * m.layers + 2 * logits
        assert mem.working == pytest.approx(want), recompute
    c = _h100()
    terms = task_costs(c, w, _group(c, w, Parallelism(1, 1, 8, zero=3)))["actor_train"].terms
    no_budget = _workload()
    terms0 = task_costs(c, no_budget, _group(c, no_budget, Parallelism(1, 1, 8, zero=3)))["actor_train"].terms
    # 32*8 samples of 1536 tokens: 49,152 tokens per GPU, 6 micro-batches of 8192 instead of 32 of one response
    assert terms["dp_comm"] < terms0["dp_comm"]


def test_logits_are_bounded_by_the_chunk_not_the_token_budget():
    w = _workload(max_tokens_per_micro_batch=32768, prompt_tokens={"max": 2048, "mean": 1024},
                  response_tokens={"max": 28672, "mean": 16000})
    mem = task_memory(w, "actor_infer", Parallelism(1, 1, 8))
    assert mem.working == pytest.approx(34 * 32768 * w.actor.hidden + LOGIT_CHUNK_TOKENS * w.actor.vocab * 4)


def test_a_sequence_longer_than_the_budget_is_refused_with_the_fix():
    c = _h100()
    w = _workload(max_tokens_per_micro_batch=2048)     # one sequence is 1024 + 2048 = 3072 tokens
    g = _group(c, w, Parallelism(1, 1, 8))
    p = plan_from_dict({"groups": [{"tasks": list(g.tasks), "gpus": [f"h0:{i}" for i in range(8)], "swap": True,
                                    "parallelism": {**{t: {"tp": 1, "pp": 1, "dp": 8, "zero": 3} for t in g.tasks},
                                                    "actor_gen": {"tp": 1, "pp": 1, "dp": 8}}}]}, c, w)
    e = estimate(c, w, p)
    assert not e.feasible and "3072 tokens" in e.reason and "sp to >= 2" in e.reason
    sp2 = {"tp": 1, "pp": 1, "dp": 4, "sp": 2, "zero": 3}
    p2 = plan_from_dict({"groups": [{"tasks": list(g.tasks), "gpus": [f"h0:{i}" for i in range(8)], "swap": True,
                                     "parallelism": {**{t: sp2 for t in g.tasks}, "actor_gen": {"tp": 1, "pp": 1,
                                                                                                "dp": 8}}}]}, c, w)
    assert estimate(c, w, p2).feasible


def test_ulysses_all_to_alls_by_hand_and_memory_split():
    c, w = _h100(), _workload()
    m = w.actor
    par = Parallelism(1, 1, 4, sp=2)
    terms = task_costs(c, w, _group(c, w, par))["actor_train"].terms
    tokens = 32 * 8 * (512 + 1024)
    micro_batches = 32 * 8 // 4
    per_gpu = tokens / 4 / 2 * (2 * 32 + 2 * 4) * 128 * 2
    want = 3 * m.layers * (1 / 2 * per_gpu / 370e9 + micro_batches * 5e-6)
    assert terms["sp_comm"] == pytest.approx(want, rel=1e-12)
    one = task_memory(w, "actor_train", Parallelism(1, 1, 8, recompute=False)).working
    two = task_memory(w, "actor_train", Parallelism(1, 1, 4, sp=2, recompute=False)).working
    assert two < one


# ------------------------------------------------------------------------------------------ Megatron


def test_interleaved_pipeline_bubble_by_hand():
    c, w = _h100(), _workload(actor="qwen3-8b", optimizer_steps=2)
    plain = task_costs(c, w, _group(c, w, Parallelism(1, 4, 2, engine="megatron")))["actor_train"].terms
    inter = task_costs(c, w, _group(c, w, Parallelism(1, 4, 2, engine="megatron", vpp=3)))["actor_train"].terms
    m = 32 * 8 // 2
    assert plain["pipeline_bubble"] == pytest.approx(plain["compute"] * 3 * 2 / m)
    assert inter["pipeline_bubble"] == pytest.approx(inter["compute"] * 3 * 2 / (3 * m))


def test_megatron_memory_sequence_parallel_in_flight_and_distributed_optimizer():
    w = _workload(actor="qwen3-8b")
    m = w.actor
    mb = 1024 + 2048
    par = Parallelism(2, 4, 1, engine="megatron")
    mem = task_memory(w, "actor_train", par)
    s = m.params / 8
    assert mem.weights == pytest.approx(2 * s)
    assert mem.states == pytest.approx(2 * s + 12 * s / 1)     # bf16 grads + fp32 master and moments over dp 1
    inflight = 4                                                  # 1F1B: pp micro-batches on the first stage
    logits = min(mb, LOGIT_CHUNK_TOKENS) * m.vocab * 4 / 2
    want = inflight * mb * m.hidden * 2 * m.layers / 4 / 2 + 34 * mb * m.hidden / 2 + 2 * logits
    assert mem.working == pytest.approx(want)
    inter = task_memory(w, "actor_train", Parallelism(2, 4, 1, engine="megatron", vpp=3)).working
    assert inter - 2 * logits - 34 * mb * m.hidden / 2 == pytest.approx(
        4 * (1 + 3 / 12) * mb * m.hidden * 2 * m.layers / 4 / 2)
    dist = task_memory(w, "actor_train", Parallelism(1, 1, 8, engine="megatron"))
    assert dist.states == pytest.approx(2 * m.params + 12 * m.params / 8)   # Megatron's 4 + 12/d B per param


# ------------------------------------------------------------------------------------------ operator tables


def test_attention_table_is_sourced_and_read_where_an_engine_is_named():
    assert attention_efficiency(4096) == pytest.approx(319 / 989)
    assert attention_efficiency(100) == ATTENTION_EFFICIENCY_BY_SEQLEN[0][1]
    assert attention_efficiency(3000) == pytest.approx(
        298 / 989 + (319 - 298) / 989 * (math.log(3000) - math.log(2048)) / (math.log(4096) - math.log(2048)))
    c, w = _h100(), _workload(actor="qwen3-8b")
    plain = task_costs(c, w, _group(c, w, Parallelism(1, 1, 8)))["actor_train"].terms["compute"]
    fsdp = task_costs(c, w, _group(c, w, Parallelism(1, 1, 8, engine="fsdp")))["actor_train"].terms["compute"]
    m = w.actor
    pairs = 32 * 8 * 1536 ** 2 / 2
    attn = 16 * m.layers * m.heads * m.head_dim * pairs
    speed = 8 * 989e12
    assert fsdp - plain == pytest.approx(attn / speed / attention_efficiency(1536) - attn / (speed * MFU_TRAIN),
                                         rel=1e-9)


# ------------------------------------------------------------------------------------------ bad values


@pytest.mark.parametrize("par, match", [
    ({"tp": 1, "pp": 1, "dp": 8, "ep": 3}, r"ep 3 must divide tp\*sp\*dp = 1\*1\*8 = 8 .*valid: 1, 2, 4, 8"),
    ({"tp": 1, "pp": 1, "dp": 8, "vpp": 2}, "vpp 2 .* needs pp > 1"),
    ({"tp": 1, "pp": 1, "dp": 8, "engine": "deepspeed"}, "engine must be one of fsdp, megatron"),
    ({"tp": 1, "pp": 1, "dp": 8, "sp": 0}, "sp must be"),
])
def test_bad_parallelism_values_are_refused_with_the_choices(par, match):
    c, w = _h100(), _workload()
    tasks = ["actor_gen", "actor_infer", "ref_infer", "actor_train"]
    p = {"groups": [{"tasks": tasks, "gpus": [f"h0:{i}" for i in range(8)],
                     "parallelism": {**{t: {"tp": 1, "pp": 1, "dp": 8} for t in tasks}, "actor_train": par}}]}
    with pytest.raises(ValueError, match=match):
        plan_from_dict(p, c, w)


@pytest.mark.parametrize("actor, par, match", [
    ("qwen3-8b", {"tp": 1, "pp": 1, "dp": 8, "ep": 2}, "a dense model: ep 1"),
    ("qwen3-30b-a3b", {"tp": 1, "pp": 1, "dp": 4, "sp": 2, "ep": 8}, None),
    ("qwen3-8b", {"tp": 8, "pp": 1, "dp": 1, "sp": 1, "vpp": 1}, None),
    ("qwen3-8b", {"tp": 1, "pp": 2, "dp": 4, "vpp": 5}, "pp 2 x vpp 5 must divide the 36 layers"),
    ("qwen3-8b", {"tp": 4, "pp": 1, "dp": 1, "sp": 2}, None),
    ("qwen3-8b", {"tp": 1, "pp": 1, "dp": 1, "sp": 8}, None),
])
def test_plan_dimensions_checked_against_the_model(actor, par, match):
    c, w = _h100(), _workload(actor=actor)
    tasks = ["actor_gen", "actor_infer", "ref_infer", "actor_train"]
    p = {"groups": [{"tasks": tasks, "gpus": [f"h0:{i}" for i in range(8)],
                     "parallelism": {**{t: {"tp": 1, "pp": 1, "dp": 8} for t in tasks}, "actor_train": par}}]}
    if match is None:
        plan_from_dict(p, c, w)
    else:
        with pytest.raises(ValueError, match=match):
            plan_from_dict(p, c, w)


def test_bad_model_fields_are_refused():
    with pytest.raises(ValueError, match="describe an MoE"):
        model_spec({**TINY_MOE, "experts": 0, "experts_per_token": 0, "moe_intermediate": 0, "intermediate": 10,
                    "first_k_dense": 2})
    with pytest.raises(ValueError, match="leave no MoE layer"):
        model_spec({**TINY_MOE, "first_k_dense": 8, "intermediate": 100})
    with pytest.raises(ValueError, match="need intermediate >= 1"):
        model_spec({**TINY_MOE, "first_k_dense": 2})
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch must be"):
        _workload(max_tokens_per_micro_batch=0)


def test_moe_permute_term_by_hand():
    """With the operator tables an MoE pass carries its tokens' permutation to the experts and back at the HBM
    roofline: per MoE layer and direction each token read once and written k times, k rows read and summed back,
    E fp32 router logits read; without the tables the term is absent (the model before them)."""
    from hetrl.planner.cost import HBM_EFF
    c, w = _h100(), _workload()
    m = w.actor
    par = Parallelism(1, 1, 8, ep=8)
    terms = task_costs(c, w, _group(c, w, par))["actor_train"].terms
    tokens = 32 * 8 * (512 + 1024)
    per_gpu = tokens / 8
    moved = per_gpu * (2 * (m.experts_per_token + 1) * m.hidden * 2 + 4 * m.experts)
    directions = 3   # forward, recomputed forward, backward
    assert terms["moe_permute"] == pytest.approx(directions * m.moe_layers * moved / (3.35e12 * HBM_EFF), rel=1e-9)


def test_moe_permute_term_absent_without_tables(roofline_only):
    c, w = _h100(), _workload()
    terms = task_costs(c, w, _group(c, w, Parallelism(1, 1, 8, ep=8)))["actor_train"].terms
    assert "moe_permute" not in terms
