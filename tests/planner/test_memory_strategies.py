"""Memory strategies (ZeRO-2/3, offload, recompute, time-shared colocation): memory and time terms against
hand-computed values, default strategies scoring today's plans as before, the ILP equal to exhaustive search
where memory forces a strategy, and bad values refused with the valid choices."""

import json
import math
import pathlib

import pytest
import yaml

from hetrl.planner import estimate, load_cluster, load_workload, plan, plan_from_dict, space
from hetrl.planner.cost import (
    CPU_ADAM_BYTES_PER_PARAM,
    HOST_BYTES_PER_S_PER_GPU,
    MEM_UTIL,
    MFU_DECODE,
    MFU_INFER,
    MFU_TRAIN,
    _dense_pass,
    _generation,
    allreduce_s,
    group_memory,
    memory,
    slowest_link,
    task_costs,
    task_memory,
    timeshare_efficiency,
    weight_sync_s,
)
from hetrl.planner.plan import Group, Parallelism, Plan
from hetrl.planner.spec import PCIE_BYTES_PER_S, cluster_from_dict, workload_from_dict

ROOT = pathlib.Path(__file__).parents[2]
MODEL = dict(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=32)
# per layer: attention 8*4*(2*2 + 2*1) = 192, MLP 3*8*16 = 384 -> 576; embeddings 2*32*8 = 512; total 1664
PARAMS, LAYER = 1664, 576


def _workload(**extra):
    return workload_from_dict({"models": {"actor": MODEL, "reference": MODEL}, "prompts_per_step": 2,
                               "responses_per_prompt": 2, "prompt_tokens": {"max": 4}, "response_tokens": {"max": 4},
                               "micro_batch_responses": 2, **extra})


def test_the_hand_computed_model_size():
    assert _workload().actor.params == PARAMS
    assert _workload().actor.attn_params_per_layer + _workload().actor.mlp_params_per_layer == LAYER


def test_training_memory_per_strategy_by_hand():
    w = _workload()
    # micro-batch: P + m*R = 4 + 2*4 = 12 tokens; logits of 12 rows x 32 vocab x 4 B (tp 1)
    mb, logits = 12, 12 * 32 * 4
    recompute_act = mb * 8 * 2 * 2 + 34 * mb * 8 + 2 * logits
    cases = {
        # (zero, offload): (weights, states, host)
        (1, "none"): (2 * PARAMS, 2 * PARAMS + 12 * PARAMS / 4, 0),
        (2, "none"): (2 * PARAMS, 2 * PARAMS / 4 + 12 * PARAMS / 4, 0),
        (3, "none"): (2 * PARAMS / 4 + 2 * 2 * LAYER, 2 * PARAMS / 4 + 12 * PARAMS / 4, 0),
        (3, "optimizer"): (2 * PARAMS / 4 + 2 * 2 * LAYER, 2 * PARAMS / 4, 12 * PARAMS / 4),
        (3, "params"): (2 * 2 * LAYER, 2 * PARAMS / 4, 12 * PARAMS / 4 + 2 * PARAMS / 4),
    }
    for (zero, offload), (weights, states, host) in cases.items():
        m = task_memory(w, "actor_train", Parallelism(1, 1, 4, zero=zero, offload=offload))
        assert (m.weights, m.states, m.host) == pytest.approx((weights, states, host), rel=1e-12), (zero, offload)
        assert m.working == pytest.approx(recompute_act, rel=1e-12)
    no_recompute = task_memory(w, "actor_train", Parallelism(1, 1, 4, recompute=False))
    assert no_recompute.working == pytest.approx(34 * mb * 8 * 2 + 2 * logits, rel=1e-12)


def test_swap_holds_one_phase_at_a_time_and_pays_pcie_for_what_moves():
    w = _workload()
    par = Parallelism(1, 1, 1)
    tasks = ("actor_gen", "actor_infer", "ref_infer", "actor_train")
    resident = Group(tasks, (0,), tuple((t, par) for t in tasks))
    swapped = Group(tasks, (0,), tuple((t, par) for t in tasks), swap=True)
    usable = 1e9
    m = {t: task_memory(w, t, par) for t in tasks}
    states = m["actor_train"].states
    # resident: actor weights + reference weights + training states, plus the largest working set
    r = group_memory(w, resident, usable)
    assert r.peak == pytest.approx(2 * PARAMS + 2 * PARAMS + states + m["actor_train"].working, rel=1e-12)
    assert r.kv_free == pytest.approx(usable - (4 * PARAMS + states), rel=1e-12) and r.swap_s == 0
    s = group_memory(w, swapped, usable)
    phases = [2 * PARAMS,                                                           # generation: actor weights
              4 * PARAMS + max(m["actor_infer"].working, m["ref_infer"].working),  # inference: actor + reference
              2 * PARAMS + states + m["actor_train"].working]                      # training: actor + states
    assert s.peak == pytest.approx(max(phases), rel=1e-12)
    assert s.kv_free == pytest.approx(usable - 2 * PARAMS, rel=1e-12)     # the KV cache gets the others' room
    moved = 2 * PARAMS + states        # the reference's weights and the training states leave and come back
    assert s.swap_s == pytest.approx(2 * moved / PCIE_BYTES_PER_S, rel=1e-12)
    assert s.host == pytest.approx(moved, rel=1e-12)


@pytest.fixture(scope="module")
def big():
    return (load_cluster(str(ROOT / "examples" / "clusters" / "paper-single-region.yaml")),
            load_workload(str(ROOT / "examples" / "workloads" / "qwen3-8b-grpo-sync.yaml")))


def _group(cluster, par, n=8, task="actor_train"):
    gpus = tuple(g.id for g in cluster.gpus if g.type.name == "A100-80G")[:n]
    return Group((task,), gpus, ((task, par),))


def test_zero3_gathers_overlap_compute_as_far_as_the_link_allows(big, roofline_only):
    cluster, w = big
    base = _dense_pass(cluster, w, w.actor, _group(cluster, Parallelism(1, 1, 8)), "actor_train", True)
    z3 = _dense_pass(cluster, w, w.actor, _group(cluster, Parallelism(1, 1, 8, zero=3)), "actor_train", True)
    link = slowest_link(cluster, _group(cluster, Parallelism(1, 1, 8)).gpus)
    # every micro-batch gathers each layer for its forward and its backward and reduce-scatters its gradients
    micro_batches = math.ceil(w.samples / 8 / w.micro_batch_responses)
    gather = micro_batches * 3 / 2 * allreduce_s(2 * w.actor.params, 8, link, w.actor.layers)
    assert z3.terms["dp_comm"] == pytest.approx(max(gather - z3.terms["compute"], gather / w.actor.layers), rel=1e-12)
    assert z3.terms["compute"] == base.terms["compute"]
    # the optimizer writes only its shard of the weights
    assert z3.terms["optimizer"] == pytest.approx(base.terms["optimizer"] * 20 / (16 + 4 * 8), rel=1e-12)


def test_per_optimizer_step_terms_scale_with_optimizer_steps(big):
    cluster, _ = big
    one = load_workload(str(ROOT / "examples" / "workloads" / "qwen3-8b-grpo-sync.yaml"))
    four = workload_from_dict({**json.loads(json.dumps(_as_dict(one))), "optimizer_steps": 4})
    for par in (Parallelism(1, 2, 4), Parallelism(1, 1, 8, offload="optimizer", zero=3)):
        a = _dense_pass(cluster, one, one.actor, _group(cluster, par), "actor_train", True).terms
        b = _dense_pass(cluster, four, four.actor, _group(cluster, par), "actor_train", True).terms
        assert b["compute"] == a["compute"]
        for term in ("optimizer", "offload", "pipeline_bubble"):   # once per optimizer step
            assert b.get(term, 0) == pytest.approx(4 * a.get(term, 0), rel=1e-12), term
        if par.zero == 1:   # gradients all-reduced once per optimizer step; ZeRO-3 reduces every micro-batch
            assert b["dp_comm"] == pytest.approx(4 * a["dp_comm"], rel=1e-12)
    with pytest.raises(ValueError, match="optimizer_steps must divide prompts_per_step"):
        workload_from_dict({**_as_dict(one), "optimizer_steps": 3})


def _as_dict(w):
    return {"algorithm": w.algorithm, "mode": w.mode, "models": {"actor": w.actor.name, "reference": w.reference.name},
            "prompts_per_step": w.prompts_per_step, "responses_per_prompt": w.responses_per_prompt,
            "prompt_tokens": {"max": w.prompt_tokens.max, "mean": w.prompt_tokens.mean},
            "response_tokens": {"max": w.response_tokens.max, "mean": w.response_tokens.mean},
            "micro_batch_responses": w.micro_batch_responses, "dualkv": w.dualkv}


def test_rings_that_leave_their_node_share_its_network():
    """TP=2 x DP=8 on two 8-GPU nodes: two DP rings (one per tensor slice) cross the same two NICs, so each runs
    at half the node's bandwidth; with TP=1 on one node the ring stays on NVLink at full speed."""
    cluster = cluster_from_dict({"name": "two", "nodes": [
        {"name": f"n{i}", "region": "r", "gpu": "H100", "count": 8, "network_gbps": 400} for i in range(2)]})
    w = load_workload(str(ROOT / "examples" / "workloads" / "qwen3-8b-grpo-sync.yaml"))
    group = Group(("actor_train",), tuple(range(16)), (("actor_train", Parallelism(2, 1, 8)),))
    got = _dense_pass(cluster, w, w.actor, group, "actor_train", True).terms["dp_comm"]
    lat, bw = slowest_link(cluster, (0, 8))
    assert bw == 400e9 / 8
    assert got == pytest.approx(allreduce_s(2 * w.actor.params / 2, 8, (lat, bw / 2)), rel=1e-12)
    # ZeRO-3 training colocated with generation gathers its shards before the weights reach the rollout
    z3 = Group(("actor_gen", "actor_train"), tuple(range(16)),
               (("actor_gen", Parallelism(2, 1, 8)), ("actor_train", Parallelism(2, 1, 8, zero=3))))
    base = Group(z3.tasks, z3.gpus, (("actor_gen", Parallelism(2, 1, 8)), ("actor_train", Parallelism(2, 1, 8))))
    extra = weight_sync_s(cluster, w, z3, z3, True) - weight_sync_s(cluster, w, base, base, True)
    assert extra == pytest.approx(allreduce_s(2 * w.actor.params / 2, 8, (lat, bw / 2)) / 2, rel=1e-12)


def test_offload_and_recompute_time_terms_by_hand(big):
    cluster, w = big
    on = _dense_pass(cluster, w, w.actor, _group(cluster, Parallelism(1, 1, 8)), "actor_train", True)
    off = _dense_pass(cluster, w, w.actor, _group(cluster, Parallelism(1, 1, 8, recompute=False)), "actor_train", True)
    assert off.terms["compute"] == pytest.approx(0.75 * on.terms["compute"], rel=1e-12)   # 6N + 3 attn vs 8N + 4
    opt = _dense_pass(cluster, w, w.actor, _group(cluster, Parallelism(1, 1, 8, zero=3, offload="optimizer")),
                      "actor_train", True)
    shard = w.actor.params / 8
    assert "optimizer" not in opt.terms
    assert opt.terms["offload"] == pytest.approx(2 * 2 * shard / PCIE_BYTES_PER_S
                                                 + CPU_ADAM_BYTES_PER_PARAM * shard / HOST_BYTES_PER_S_PER_GPU,
                                                 rel=1e-12)
    ref = _dense_pass(cluster, w, w.reference, _group(cluster, Parallelism(1, 1, 8, zero=3, offload="params"),
                                                      task="ref_infer"), "ref_infer", False)
    stream = 2 * shard / PCIE_BYTES_PER_S
    assert ref.terms["offload"] == pytest.approx(max(stream - ref.terms["compute"], stream / w.actor.layers), rel=1e-12)


def test_committed_benchmark_plans_score_as_committed_and_written_out_defaults_change_nothing():
    """Every plan of benchmarks/results/planner.json (48 pairs x 5 methods) scores as committed (within a few ulps),
    and the same plan with the default strategies written out (zero 1, no offload, recompute, no swap) scores
    bit-identically: the strategy dimensions at their defaults are today's model."""
    res = json.loads((ROOT / "benchmarks" / "results" / "planner.json").read_text())
    n = 0
    for row in res["rows"]:
        c = load_cluster(str(ROOT / "examples" / "clusters" / f"{row['scenario']}.yaml"))
        w = load_workload(str(ROOT / "examples" / "workloads" / f"{row['workload']}.yaml"))
        for m in ("hybrid", "ilp", "verl", "verl-all", "streamrl"):
            data = row[m]["plan"]
            got = estimate(c, w, plan_from_dict(data, c, w)).iteration_time_s
            assert math.isclose(got, row[m]["iteration_time_s"], rel_tol=1e-15, abs_tol=0), (row["scenario"], m)
            p = plan_from_dict(data, c, w)
            if (all(par.default_memory for g in p.groups for _, par in g.parallelism)
                    and not any(g.swap for g in p.groups)):
                explicit = json.loads(json.dumps(data))
                for g in explicit["groups"]:
                    g["swap"] = False
                    for t, par in g["parallelism"].items():
                        if t != "actor_gen":
                            par.update({"zero": 1, "offload": "none"},
                                       **({"recompute": True} if t.endswith("_train") else {}))
                assert estimate(c, w, plan_from_dict(explicit, c, w)).iteration_time_s == got
            n += 1
    assert n == 240


def test_where_memory_forces_a_strategy_the_ilp_equals_exhaustive_search():
    """Qwen3-8B GRPO on 4 L4 (24 GB) + 2 L40S (48 GB): nothing fits with every state resident."""
    cluster = cluster_from_dict({"name": "tight", "nodes": [
        {"name": "l4", "region": "r", "gpu": "L4", "count": 4, "intra_node": "pcie"},
        {"name": "l40s", "region": "r", "gpu": "L40S", "count": 2, "intra_node": "pcie"}]})
    w = load_workload(str(ROOT / "examples" / "workloads" / "qwen3-8b-grpo-sync.yaml"))
    ex = plan(cluster, w, "exhaustive")
    ilp = plan(cluster, w, "ilp")
    assert ilp.iteration_time_s == pytest.approx(ex.iteration_time_s, rel=1e-6)
    pars = [par for g in ilp.plan.groups for _, par in g.parallelism]
    assert any(not p.default_memory for p in pars) or any(g.swap for g in ilp.plan.groups)
    e = estimate(cluster, w, ilp.plan)
    assert e.feasible and e.iteration_time_s == pytest.approx(ilp.iteration_time_s, rel=1e-9)
    round_trip = plan_from_dict(json.loads(json.dumps(ilp.plan.to_dict(cluster))), cluster, w)
    assert round_trip == ilp.plan


@pytest.mark.parametrize("par, match", [
    ({"zero": 4}, "zero must be one of 1, 2, 3, got 4"),
    ({"offload": "disk"}, "offload must be one of none, optimizer, params"),
    ({"recompute": "yes"}, "recompute must be true or false"),
    ({"offload": "params"}, "offload: params needs zero: 3"),
])
def test_bad_strategies_are_refused_with_the_choices(par, match):
    with pytest.raises(ValueError, match=match):
        Parallelism(**{"tp": 1, "pp": 1, "dp": 1, **par})


def test_generation_keeps_default_memory_and_swap_is_a_bool(big):
    cluster, w = big
    good = plan(cluster, w, "verl").plan.to_dict(cluster)
    g = good["groups"][0]
    bad = {"groups": [{**g, "parallelism": {**g["parallelism"], "actor_gen": {**g["parallelism"]["actor_gen"],
                                                                              "zero": 3}}}]}
    with pytest.raises(ValueError, match="generation keeps its weights whole"):
        plan_from_dict(bad, cluster, w)
    with pytest.raises(ValueError, match="swap must be true or false"):
        plan_from_dict({"groups": [{**g, "swap": "yes"}]}, cluster, w)


def test_host_memory_is_a_constraint():
    small_host = cluster_from_dict({"name": "h", "nodes": [
        {"name": "a", "region": "r", "gpu": "A100-80G", "count": 2, "host_memory_gb": 1}]})
    w = _workload()
    big_w = workload_from_dict({"models": {"actor": "qwen3-8b", "reference": "qwen3-8b"},
                                "prompt_tokens": {"max": 512}, "response_tokens": {"max": 512}})
    par = Parallelism(1, 1, 2, zero=3, offload="optimizer")
    tasks = ("actor_gen", "actor_infer", "ref_infer", "actor_train")
    p = {"groups": [{"tasks": list(tasks), "gpus": ["a:0", "a:1"], "parallelism": {
        t: ({"tp": 1, "pp": 1, "dp": 2} if t == "actor_gen" else {"tp": 1, "pp": 1, "dp": 2, "zero": 3,
                                                                 "offload": "optimizer"}) for t in tasks}}]}
    e = estimate(small_host, big_w, plan_from_dict(p, small_host, big_w))
    assert not e.feasible and "host memory" in e.reason and "host_memory_gb" in e.reason
    assert MEM_UTIL < 1 and task_memory(w, "actor_train", par).host > 0


@pytest.mark.parametrize("cluster, workload, plan_file", [
    ("h100-2x8", "llama3.1-8b-grpo-nemorl", "nemorl-llama3.1-8b-16xh100"),
    ("a100-40g-8x8", "qwen3-8b-grpo-dualkv-paper", "dualkv-paper-qwen3-8b-64xa100-40g"),
    ("h20-8x8", "qwen2.5-7b-dapo-verl", "verl-dapo-qwen2.5-7b-64xh20"),
])
def test_published_setups_are_scored(cluster, workload, plan_file, capsys):
    """The plans teams publish (colocated, time-shared, FSDP / offload) evaluate as feasible with a breakdown."""
    from hetrl.cli import main

    args = ["plan", "--cluster", f"examples/clusters/{cluster}.yaml", "--workload",
            f"examples/workloads/{workload}.yaml", "--evaluate", f"examples/plans/{plan_file}.json", "--json"]
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert math.isfinite(r["iteration_time_s"]) and r["breakdown"]["compute"] > 0
    assert r["plan"]["groups"][0]["swap"] is True


def _cpu_cluster(concurrent, mfu=None, hbm=1.6e10, **device):
    node = {"name": "cpu", "region": "local", "gpu": "cpu-core", "count": 2, "intra_node": "pcie", "network_gbps": 10}
    if concurrent is not None:
        node["concurrent_devices"] = concurrent
    return cluster_from_dict({"name": "cpu", "gpu_types": [{"name": "cpu-core", "dense_bf16_flops": 1.5e11,
                                                             "memory_bytes": 12e9, "hbm_bytes_per_s": hbm,
                                                             "source": "test", **({} if mfu is None else {"mfu": mfu}),
                                                             **device}],
                              "nodes": [node]})


def test_a_measured_decode_rate_by_rows_prices_the_decode_at_its_rows():
    """decode_mfu_by_rows: 8 prompts x 2 responses of 4 tokens decode 4 steps of 16 rows; 16 lies halfway (in
    log rows) between 8 and 32, so [[8, 0.2], [32, 0.4]] prices the decode at 0.3 of the peak, as a flat 0.3 does;
    below and above the measured rows the ends hold; prefill keeps MFU_INFER; without the table MFU_DECODE."""
    w = _workload(prompts_per_step=8)
    group = Group(("actor_gen",), (0,), (("actor_gen", Parallelism(1, 1, 1)),))
    free = {0: 1e9}
    peak, active = 1.5e11, w.actor.active_params

    def decode(**device):   # a fast memory, so the decode is compute-bound; prefill at the type's mfu or MFU_INFER
        prefill = 2 * active * 8 * 4 / (peak * device.get("mfu", MFU_INFER))
        return _generation(_cpu_cluster(None, hbm=1e15, **device), w, w.actor, group, free).terms["compute"] - prefill

    tokens = 2 * active * 16 * 4
    assert decode(decode_mfu_by_rows=[[8, 0.2], [32, 0.4]]) == pytest.approx(tokens / (peak * 0.3), rel=1e-12)
    assert decode(decode_mfu_by_rows=[[1, 0.3]]) == pytest.approx(tokens / (peak * 0.3), rel=1e-12)
    assert decode(decode_mfu_by_rows=[[32, 0.4], [64, 0.5]]) == pytest.approx(tokens / (peak * 0.4), rel=1e-12)
    assert decode(decode_mfu_by_rows=[[2, 0.1], [4, 0.2]]) == pytest.approx(tokens / (peak * 0.2), rel=1e-12)
    assert decode() == pytest.approx(tokens / (peak * MFU_DECODE), rel=1e-12)
    assert decode(mfu=0.9) == pytest.approx(tokens / (peak * 0.9), rel=1e-12)


@pytest.mark.parametrize("bad, why", [([[8, 0.2], [8, 0.3]], "rising"), ([[0, 0.2]], "rows >= 1"), ([], "rising"),
                                      ([[8, 1.5]], r"\(0, 1\]"), ([[8]], "list of 2"), ("fast", "must be a list")])
def test_a_bad_decode_table_is_refused_with_what_it_takes(bad, why):
    with pytest.raises(ValueError, match=why):
        _cpu_cluster(None, decode_mfu_by_rows=bad)
    with pytest.raises(ValueError, match="timeshare_efficiency"):
        _cpu_cluster(None, timeshare_efficiency=1.2)


def test_async_generation_beside_training_on_the_same_devices_pays_the_time_sharing():
    """timeshare_efficiency 0.8: in async mode a group that generates and trains on the same cores runs both at
    once, so each of its tasks takes 1/0.8 of its time (the `timeshare` term); sync phases take turns (no
    term), and generation alone on its devices shares nothing."""
    cluster, plain = _cpu_cluster(None, timeshare_efficiency=0.8), _cpu_cluster(None)
    tasks = ("actor_gen", "actor_train", "ref_infer")
    both = Group(tasks, (0, 1), tuple((t, Parallelism(1, 1, 2)) for t in tasks))
    for mode in ("async", "sync"):
        w = _workload(mode=mode)
        got, base = task_costs(cluster, w, both), task_costs(plain, w, both)
        for t in tasks:
            if mode == "async":
                assert got[t].seconds == pytest.approx(base[t].seconds / 0.8, rel=1e-12)
                assert got[t].terms["timeshare"] == pytest.approx(base[t].seconds * 0.25, rel=1e-12)
            else:
                assert got[t].seconds == base[t].seconds and "timeshare" not in got[t].terms
    alone = Group(("actor_gen",), (0,), (("actor_gen", Parallelism(1, 1, 1)),))
    w = _workload(mode="async")
    assert task_costs(cluster, w, alone)["actor_gen"].seconds == task_costs(plain, w, alone)["actor_gen"].seconds
    assert timeshare_efficiency(cluster, w, both) == 0.8 and timeshare_efficiency(cluster, w, alone) == 1.0


def test_a_rollout_that_scores_its_own_samples_pays_one_inference_pass_over_them():
    """rollout_logprob_pass (hetrl async on Ray where the sampling logits are bf16): the generation task also runs
    a forward pass over every sample, the same pass a reference of the actor's size runs at the same parallelism
    (the `behaviour_logprobs` term); off (the default), generation's seconds are as before, bit for bit."""
    cluster = _cpu_cluster(None)
    tasks = ("actor_gen", "actor_train", "ref_infer")
    group = Group(tasks, (0, 1), tuple((t, Parallelism(1, 1, 2)) for t in tasks))
    plain, scoring = _workload(mode="async"), _workload(mode="async", rollout_logprob_pass=True)
    base, got = task_costs(cluster, plain, group), task_costs(cluster, scoring, group)
    assert got["actor_gen"].terms["behaviour_logprobs"] == pytest.approx(base["ref_infer"].seconds, rel=1e-12)
    assert got["actor_gen"].seconds == pytest.approx(base["actor_gen"].seconds + base["ref_infer"].seconds, rel=1e-12)
    assert "behaviour_logprobs" not in base["actor_gen"].terms
    assert {t: got[t].seconds for t in tasks[1:]} == {t: base[t].seconds for t in tasks[1:]}
    with pytest.raises(ValueError, match="rollout_logprob_pass"):
        _workload(rollout_logprob_pass="sometimes")


def test_a_device_type_with_a_measured_mfu_is_priced_at_it():
    """A type that states the fraction of its peak a model pass reaches replaces the GPU constants in every
    compute term (training, inference, prefill, compute-bound decode) and in nothing else."""
    w = _workload(prompt_tokens={"max": 64}, response_tokens={"max": 16})
    plain, measured = _cpu_cluster(None), _cpu_cluster(None, mfu=0.9)
    group = Group(("actor_gen", "actor_train", "ref_infer"), (0, 1),
                  tuple((t, Parallelism(1, 1, 2)) for t in ("actor_gen", "actor_train", "ref_infer")))
    for task, train, mfu in (("actor_train", True, MFU_TRAIN), ("ref_infer", False, MFU_INFER)):
        model = w.actor if train else w.reference
        a, b = (_dense_pass(c, w, model, group, task, train).terms for c in (plain, measured))
        assert b["compute"] == pytest.approx(a["compute"] * mfu / 0.9, rel=1e-12)
        assert {k: v for k, v in b.items() if k != "compute"} == {k: v for k, v in a.items() if k != "compute"}
    free = {0: 1e10, 1: 1e10}
    a, b = (_generation(c, w, w.actor, group, free).terms for c in (plain, measured))
    assert a["hbm"] == b["hbm"]                       # 4 rows: decode reads weights, the prefill is compute
    assert b["compute"] == pytest.approx(a["compute"] * MFU_INFER / 0.9, rel=1e-12)
    fast = [_cpu_cluster(None, mfu, hbm=1e16) for mfu in (None, 0.9)]     # memory so fast that decode is compute
    a, b = (_generation(c, w, w.actor, group, free).terms for c in fast)
    assert "hbm" not in a and "hbm" not in b
    assert b["compute"] == pytest.approx(a["compute"] * MFU_DECODE / 0.9, rel=1e-12)   # MFU_INFER == MFU_DECODE
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValueError, match="mfu"):
            _cpu_cluster(None, mfu=bad)


@pytest.mark.parametrize("concurrent", [1.0, 1.5])
def test_devices_of_one_pool_share_its_compute_and_bandwidth(concurrent):
    w = _workload()
    free, pooled = _cpu_cluster(None), _cpu_cluster(concurrent)
    both = Group(("actor_train",), (0, 1), (("actor_train", Parallelism(1, 1, 2)),))
    one = Group(("actor_train",), (0,), (("actor_train", Parallelism(1, 1, 1)),))
    a, b = (_dense_pass(c, w, w.actor, both, "actor_train", True) for c in (free, pooled))
    # two busy devices of a pool worth `concurrent` devices each run at concurrent / 2 of their own speed
    assert b.terms["compute"] == pytest.approx(a.terms["compute"] * 2 / concurrent, rel=1e-12)
    assert b.terms["optimizer"] == pytest.approx(a.terms["optimizer"] * 2 / concurrent, rel=1e-12)
    assert b.terms["dp_comm"] == a.terms["dp_comm"]
    # a group on one device of the pool has it to itself
    assert _dense_pass(pooled, w, w.actor, one, "actor_train", True) == _dense_pass(free, w, w.actor, one,
                                                                                      "actor_train", True)


def test_a_pool_cannot_hold_more_devices_than_the_node():
    with pytest.raises(ValueError, match="concurrent_devices 3 is more than its count 2"):
        _cpu_cluster(3)


def test_a_measured_intra_node_link_replaces_the_pcie_default():
    assert slowest_link(_cpu_cluster(None), (0, 1))[1] == PCIE_BYTES_PER_S
    d = {"name": "c", "gpu_types": [{"name": "cpu-core", "dense_bf16_flops": 1.5e11, "memory_bytes": 12e9,
                                     "hbm_bytes_per_s": 1.6e10, "source": "test"}],
         "nodes": [{"name": "cpu", "region": "local", "gpu": "cpu-core", "count": 2, "intra_node": "pcie",
                    "intra_node_gbps": 8}]}
    assert slowest_link(cluster_from_dict(d), (0, 1))[1] == 1e9


def test_time_terms_move_values_at_the_workloads_precision(big, roofline_only):
    """fp32 (hetrl train on a CPU) moves 4-byte weights, gradients and activations: the gradient all-reduce, ZeRO-3
    gathers, weight sync and decode's weight reads take twice the bytes of bf16; compute is unchanged."""
    cluster, bf16 = big
    fp32 = workload_from_dict({**_as_dict(bf16), "precision": "fp32"})
    for par in (Parallelism(1, 1, 8), Parallelism(1, 1, 8, zero=3)):
        a = _dense_pass(cluster, bf16, bf16.actor, _group(cluster, par), "actor_train", True).terms
        b = _dense_pass(cluster, fp32, fp32.actor, _group(cluster, par), "actor_train", True).terms
        assert b["compute"] == a["compute"]
        link = slowest_link(cluster, _group(cluster, par).gpus)
        if par.zero == 1:
            assert b["dp_comm"] == pytest.approx(allreduce_s(4 * bf16.actor.params, 8, link), rel=1e-12)
            assert a["dp_comm"] == pytest.approx(allreduce_s(2 * bf16.actor.params, 8, link), rel=1e-12)
    gen = Group(("actor_gen",), _group(cluster, Parallelism(1, 1, 1)).gpus[:1], (("actor_gen", Parallelism(1, 1, 1)),))
    free = {i: 10e9 for i in gen.gpus}   # a decode bound by reads in both precisions
    a, b = (_generation(cluster, w, w.actor, gen, free).terms for w in (bf16, fp32))
    assert b["hbm"] > a["hbm"]
    train = Group(("actor_train",), gen.gpus, (("actor_train", Parallelism(1, 1, 1)),))
    assert weight_sync_s(cluster, fp32, train, gen, True) == pytest.approx(
        2 * weight_sync_s(cluster, bf16, train, gen, True), rel=1e-12)


def test_generation_holds_a_prompts_kv_once_for_its_responses(roofline_only):
    """The N responses of a prompt share its KV cache (prefix caching; hetrl's SharedPrefixCache) and the cache is
    paged under continuous batching (vLLM, SGLang): a sequence holds P/N + the tokens it has made so far. 2 prompts x
    2 responses, P = R = 4, KV bytes per token 2 layers x 1 head x 4 dims x K,V x 2 B = 32. Over its life a sequence
    holds R x (P/N + R/2) = 4 x (2 + 2) = 16 token-steps, the batch 64. With room for 24 tokens the decode lasts the
    longest response (R_max = 4 steps: 64 / 24 < 4); with room for 8 the cache binds: 64 / 8 = 8 steps, each reading
    the weights; with less than one whole sequence (P/N + R_max = 6 tokens) it cannot run."""
    w = _workload()
    cluster = cluster_from_dict({"name": "one", "nodes": [{"name": "n", "region": "r", "gpu": "H100", "count": 1}]})
    group = Group(("actor_gen",), (0,), (("actor_gen", Parallelism(1, 1, 1)),))
    roomy = _generation(cluster, w, w.actor, group, {0: 24 * 32})
    tight = _generation(cluster, w, w.actor, group, {0: 8 * 32})
    hbm = cluster.gpus[0].type.hbm_bytes_per_s * 0.7
    step = PARAMS * 2 / hbm            # one decode step reads the weights once for every running sequence
    kv = 4 * 4 * (4 + 2) * 32 / hbm    # every sequence reads its prompt's and its own KV at every step
    assert roomy.terms["hbm"] == pytest.approx(4 * step + kv, rel=1e-12)
    assert tight.terms["hbm"] == pytest.approx(8 * step + kv, rel=1e-12)
    assert _generation(cluster, w, w.actor, group, {0: 6 * 32}).terms["hbm"] == pytest.approx(64 / 6 * step + kv)
    assert _generation(cluster, w, w.actor, group, {0: 6 * 32 - 1}).seconds == math.inf


def test_the_old_logprob_pass_runs_on_its_share_of_the_samples(big):
    """old_logprob_share scales the actor_infer pass (its tokens and micro-batches); 0 (log-probs from the rollout)
    costs nothing, 1 (the default) is today's pass; other tasks do not change."""
    cluster, w = big
    par = Parallelism(1, 1, 8)
    for share in (0.0, 0.5, 1.0):
        ws = workload_from_dict({**_as_dict(w), "old_logprob_share": share})
        infer = _dense_pass(cluster, ws, ws.actor, _group(cluster, par, task="actor_infer"), "actor_infer", False)
        full = _dense_pass(cluster, w, w.actor, _group(cluster, par, task="actor_infer"), "actor_infer", False)
        assert infer.terms["compute"] == pytest.approx(share * full.terms["compute"], rel=1e-12)
        ref = _dense_pass(cluster, ws, ws.reference, _group(cluster, par, task="ref_infer"), "ref_infer", False)
        assert ref.seconds == _dense_pass(cluster, w, w.reference, _group(cluster, par, task="ref_infer"),
                                          "ref_infer", False).seconds
    assert _dense_pass(cluster, workload_from_dict({**_as_dict(w), "old_logprob_share": 0}), w.actor,
                       _group(cluster, par, task="actor_infer"), "actor_infer", False).seconds == 0
    with pytest.raises(ValueError, match="old_logprob_share"):
        workload_from_dict({**_as_dict(w), "old_logprob_share": 1.5})


def test_gradient_all_reduce_inside_an_nvlink_node_comes_from_the_collective_table(big):
    """With the tables, a DP group of one node's NVLink GPUs all-reduces its gradients at the NCCL table's time for
    that message and group (A100-80G: Vidur's DGX A100 table), not the ring at line rate."""
    from hetrl.planner import optables
    cluster, w = big
    par = Parallelism(1, 1, 8)
    g = _group(cluster, par)
    terms = _dense_pass(cluster, w, w.actor, g, "actor_train", True).terms
    table = optables.allreduce_s(cluster.gpus[g.gpus[0]].type, 2 * w.actor.params, 8)
    assert table is not None
    assert terms["dp_comm"] == pytest.approx(w.optimizer_steps * table, rel=1e-12)
    ring = allreduce_s(2 * w.actor.params, 8, slowest_link(cluster, g.gpus))
    assert terms["dp_comm"] != pytest.approx(w.optimizer_steps * ring, rel=1e-3)


@pytest.mark.parametrize("only", ["but_generation", "all"])
def test_a_data_parallel_executor_gets_plans_it_runs_and_the_ilp_still_equals_exhaustive(only):
    """`data_parallel_only` (what hetrl's Ray executor runs): every task it names has one GPU per replica in the
    plan (ZeRO and offload still chosen where memory needs them), and the ILP still equals exhaustive search over
    that space. Qwen3-8B GRPO on 2 nodes of 4 L4 (24 GB), where memory decides the layout, and on 4 H100, where
    the plan over every layout trains with pipeline parallelism. The restricted space is part of the whole one, so
    the plan over every layout is never slower (on the L4s it was 2.6% slower while the per-group rule stopped at
    its first fitting configuration)."""
    text = yaml.safe_load((ROOT / "examples" / "workloads" / "qwen3-8b-grpo-sync.yaml").read_text())
    free_w, dp = workload_from_dict(text), workload_from_dict({**text, "data_parallel_only": only})
    l4s = cluster_from_dict({"name": "l4s", "nodes": [
        {"name": f"l4-{i}", "region": "r", "gpu": "L4", "count": 4, "intra_node": "pcie"} for i in range(2)]})
    h100s = cluster_from_dict({"name": "h100s", "nodes": [
        {"name": "h-0", "region": "r", "gpu": "H100", "count": 4, "intra_node": "pcie"}]})
    for cluster in (l4s, h100s):
        free = plan(cluster, free_w, "ilp")
        ilp, ex = plan(cluster, dp, "ilp"), plan(cluster, dp, "exhaustive")
        assert ilp.iteration_time_s == pytest.approx(ex.iteration_time_s, rel=1e-6)
        assert free.iteration_time_s <= ilp.iteration_time_s * (1 + 1e-9)
        for g in ilp.plan.groups:
            for t, p in g.parallelism:
                if t != "actor_gen" or only == "all":
                    assert (p.tp, p.pp, p.sp, p.ep) == (1, 1, 1, 1), (t, p)
        assert any(not p.default_memory for g in ilp.plan.groups for _, p in g.parallelism) or \
            any(g.swap for g in ilp.plan.groups)
    assert any(p.tp * p.pp > 1 for g in free.plan.groups for t, p in g.parallelism if t != "actor_gen")
    with pytest.raises(ValueError, match="data_parallel_only must be one of none, but_generation, all"):
        workload_from_dict({**yaml.safe_load((ROOT / "examples" / "workloads" / "qwen3-8b-grpo-sync.yaml")
                                             .read_text()), "data_parallel_only": "yes"})


@pytest.mark.parametrize("swap, zero", [(False, 1), (True, 3)])
def test_memory_of_a_mixed_group_equals_its_gpus_one_by_one(swap, zero):
    """`memory` sums each run of a group's GPUs (one GPU type on one node) at once; the reference is every GPU
    priced alone by `group_memory`: the same peak and KV cache per GPU and swap seconds, and the first GPU in the
    group's order that does not fit named (m:1, after an H100 that fits and before l:1 of a node listed earlier)."""
    cluster = cluster_from_dict({"name": "mixed", "nodes": [
        {"name": "h", "region": "r", "gpu": "H100", "count": 2},
        {"name": "l", "region": "r", "gpu": "L4", "count": 2, "intra_node": "pcie"},
        {"name": "m", "region": "r", "gpu": "L4", "count": 2, "intra_node": "pcie"}]})
    w = workload_from_dict({"models": {"actor": "qwen3-8b", "reference": "qwen3-8b"},
                            "prompt_tokens": {"max": 512}, "response_tokens": {"max": 512}})
    ids = {g.name: g.id for g in cluster.gpus}
    order = tuple(ids[n] for n in ("h:0", "m:1", "l:1", "h:1", "l:0", "m:0"))
    par = {"actor_gen": Parallelism(1, 1, 6), "ref_infer": Parallelism(1, 1, 6, zero=3),
           "actor_train": Parallelism(1, 1, 6, zero=zero)}
    group = Group(tuple(par), order, tuple(par.items()), swap=swap)
    mem = memory(cluster, w, Plan((group,)))
    first = None
    for i in order:
        g = cluster.gpus[i]
        usable = g.type.memory_bytes * MEM_UTIL
        ref = group_memory(w, group, usable)
        assert mem.peak[i] == pytest.approx(ref.peak, rel=1e-12)
        assert mem.kv_free[i] == pytest.approx(ref.kv_free, rel=1e-12)
        assert mem.swap_s[0] == pytest.approx(ref.swap_s, rel=1e-12)
        if ref.peak > usable and first is None:
            first = g
    assert first is not None and first.type.name == "L4", "the case must have GPUs that do not fit"
    assert first.name == "m:1" and mem.why.startswith("m:1 (L4) needs"), mem.why


def _one_node(gpu, count, link="pcie"):
    return cluster_from_dict({"name": gpu, "nodes": [{"name": "n0", "region": "r", "gpu": gpu, "count": count,
                                                      "intra_node": link}]})


# Known misses of the planner's Level 4, kept visible rather than hidden: the rule that configures a group (a first
# fit, improved one task at a time, a change that does not fit made to fit by sharding the others further) is not
# exact. strict: when a rule finds these configurations, these cases fail and the mark comes off.
def not_exact(why: str):
    """A known Level-4 miss (docs/cost_model.md, Level 4): the per-group rule is a local search, not exact."""
    return pytest.mark.xfail(strict=True, reason=f"known Level-4 miss of the per-group local search: {why}")


@pytest.mark.parametrize("cluster, workload, tasks, counts", [
    # missed by the rule before 2026-11-29's second change (a change that does not fit was dropped, and a first fit
    # whose heaviest task could shard no further gave up): 50.8 s where 41.5 s fits; nothing where 329 s fits;
    # 267.8 vs 266.9 s; 71.2 vs 67.0 s; 216.3 vs 212.1 s
    ("a100-40g-8x8", "qwen3-8b-grpo-sync", ("actor_infer", "actor_train"), (1,)),
    ("h100-2x8", "qwen3-14b-grpo-sync", ("ref_infer", "reward_infer", "actor_infer", "actor_train"), (1,)),
    ("4 A10G", "qwen3-4b-ppo-sync", ("critic_infer", "critic_train", "reward_infer"), (4,)),
    ("4 H100 nvlink", "qwen3-14b-ppo-async", ("ref_infer", "critic_infer", "critic_train"), (4,)),
    ("4 A100-80G nvlink", "qwen3-14b-ppo-async", ("critic_infer", "critic_train", "ref_infer"), (4,)),
    ("h100-2x8", "qwen3-14b-grpo-sync", ("actor_gen", "ref_infer", "actor_infer", "actor_train"), (1,)),
    ("4 H100", "qwen3-8b-grpo-sync", ("actor_gen", "actor_infer", "actor_train"), (4,)),
    # missed until the first fit kept offload within the host's memory and, where it still finds nothing, tries each
    # option of each task with the others made to fit around it: the first fit sharded by GPU bytes and ended with
    # every task offloaded, over the host's memory, where keeping actor_infer resident fits (379 s)
    ("2 L40S", "qwen3-14b-grpo-sync", ("actor_infer", "actor_train", "ref_infer"), (2,)),
    # missed today: a 0.4% trade between three tasks
    pytest.param("2 A100-80G nvlink", "qwen3-8b-ppo-sync", ("actor_infer", "actor_train", "reward_infer"), (2,),
                 marks=not_exact("242.08 s where 241.23 s fits: a trade between three tasks that no change of one "
                                 "task (with room made by sharding the others) reaches")),
])
def test_configure_against_every_configuration_of_a_group(cluster, workload, tasks, counts):
    """The oracle for Level 4: the shortest group_seconds over every combination of the group's tasks' options
    (TP/PP/DP, memory strategy, recompute) in every pass, priced whole. The rule is a local search; the cases
    marked xfail are those it misses today (strict: a rule that gets them right turns them into failures to
    unmark)."""
    c = load_cluster(str(ROOT / "examples" / "clusters" / f"{cluster}.yaml")) if "-" in cluster.split()[0] \
        else _one_node(cluster.split()[1], int(cluster.split()[0]), *cluster.split()[2:])
    w = load_workload(str(ROOT / "examples" / "workloads" / f"{workload}.yaml"))
    found = space.configure(c, w, tasks, counts)
    best = space.every_configuration(c, w, tasks, counts)
    assert best is not None, "the case must have a configuration that fits"
    want = space.group_seconds(best)
    assert found is not None and space.group_seconds(found) == pytest.approx(want, rel=1e-12)
