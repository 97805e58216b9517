"""Operator tables (hetrl/planner/optables.py): measured points come back as measured, other GPUs scale by their
roofline, a decode step is the sum of its operators, and a user's own tables take precedence."""

import csv
import math
import statistics

import pytest

from hetrl.planner import optables
from hetrl.planner.catalog import GPUS, GPUType, gpu
from hetrl.planner.cost import _step_ops_s
from hetrl.planner.spec import PRESETS, cluster_from_dict


@pytest.fixture
def own_tables(monkeypatch, tmp_path):
    def use(rows: list[dict], name="mine_H100.csv"):
        with open(tmp_path / name, "w", newline="") as f:
            w = csv.DictWriter(f, optables.FIELDS)
            w.writeheader()
            w.writerows(rows)
        monkeypatch.setenv("HETRL_OPERATOR_TABLES", str(tmp_path))
        optables.reload()
    yield use
    monkeypatch.delenv("HETRL_OPERATOR_TABLES", raising=False)
    optables.reload()


def test_every_row_names_its_source_and_every_file_a_catalog_gpu():
    files = sorted(optables.DATA.glob("*.csv"))
    assert files
    for path in files:
        assert path.stem.rsplit("_", 1)[1] in GPUS, path.name
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        assert rows and all(r["source"].strip() and float(r["seconds"] or r["rate"]) > 0 for r in rows), path.name
        assert list(rows[0]) == list(optables.FIELDS)


def _measured(gpu_name, n, k, m):
    rows = [r for r in optables.tables()[gpu_name]["gemm"] if (r["n"], r["k"], r["m"]) == (n, k, m)]
    return statistics.median(r["seconds"] for r in rows)


@pytest.mark.parametrize("m", [1, 64, 1024, 4096])
def test_a_measured_gemm_comes_back_as_measured(m):
    h100 = gpu("H100")
    for n, k in ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)):   # Llama-2-7B's projections, TP 1
        assert optables.gemm_s(h100, m, n, k) == pytest.approx(_measured("H100", n, k, m), rel=1e-9)


def test_another_gpu_scales_by_the_bound_its_roofline_names():
    """H200 is H100's die with faster HBM: a 1-token GEMM (weight-read bound) scales by the HBM ratio, a
    4096-token one (FLOP bound, same peak) keeps its time."""
    h100, h200 = gpu("H100"), gpu("H200")
    assert optables.nearest_measured(h200, "gemm") == "H100"
    one = optables.gemm_s(h200, 1, 12288, 4096) / optables.gemm_s(h100, 1, 12288, 4096)
    assert one == pytest.approx(h100.hbm_bytes_per_s / h200.hbm_bytes_per_s, rel=1e-9)
    assert optables.gemm_s(h200, 4096, 12288, 4096) == pytest.approx(optables.gemm_s(h100, 4096, 12288, 4096),
                                                                      rel=1e-9)
    assert "scaled from H100" in optables.source_of(h200, "gemm")
    assert optables.source_of(h100, "gemm") == "vidur_H100.csv"


def test_between_two_measured_shapes_the_efficiency_lies_between():
    """An unmeasured shape's efficiency lies within those of the measured shapes of the two nearest weight sizes
    (4096 x 5504 and 8192 x 2752 below it, 6144 x 4096, 3072 x 8192 and 8192 x 3072 above)."""
    h100 = gpu("H100")
    below = ((4096, 5504), (5504, 4096), (8192, 2752))
    above = ((6144, 4096), (3072, 8192), (8192, 3072))
    for m in (1, 64, 1024, 4096):
        def eff(n, k):
            return 2 * m * n * k / optables.gemm_s(h100, m, n, k)
        known = [eff(n, k) for n, k in below + above]
        assert min(known) <= eff(6000, 4000) <= max(known)


def test_engine_step_and_allreduce_at_measured_points():
    a100 = gpu("A100-80G")
    rows = [r for r in optables.tables()["A100-80G"]["engine_step"] if (r["tp"], r["batch"]) == (1, 64)]
    assert optables.engine_step_s(a100, 64, 1) == pytest.approx(statistics.median(r["seconds"] for r in rows))
    # beyond the measured batches the last one holds (no extrapolation)
    assert optables.engine_step_s(a100, 4096, 1) == optables.engine_step_s(a100, 128, 1)
    h100 = gpu("H100")
    ar = [r for r in optables.tables()["H100"]["all_reduce"] if r["group"] == 8 and r["link"] == "nvlink"]
    big = max(ar, key=lambda r: r["bytes"])
    assert optables.allreduce_s(h100, big["bytes"], 8) == pytest.approx(big["seconds"], rel=1e-9)
    assert optables.allreduce_s(h100, 2 * big["bytes"], 8) == pytest.approx(2 * big["seconds"], rel=1e-9)
    assert optables.allreduce_s(h100, 1e6, 1) == 0.0


def test_a_decode_step_is_the_sum_of_its_operators():
    """A dense model: per layer qkv, o, gate+up, down at the step's rows and the small kernels; then the LM head;
    the engine's step time beside it."""
    h100, m, rows, tp = gpu("H100"), PRESETS["qwen3-8b"], 48.0, 2
    h, q, kv = m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim
    layer = (optables.gemm_s(h100, rows, (q + 2 * kv) / tp, h) + optables.gemm_s(h100, rows, h, q / tp)
             + optables.gemm_s(h100, rows, 2 * m.intermediate / tp, h)
             + optables.gemm_s(h100, rows, h, m.intermediate / tp) + optables.small_ops_s(h100, rows, h,
                                                                                        m.intermediate / tp))
    want = m.layers * layer + optables.gemm_s(h100, rows, m.vocab / tp, h)
    kernels, engine = _step_ops_s(h100, m, tp, 1, rows, 2)
    assert kernels == pytest.approx(want, rel=1e-12)
    assert engine == pytest.approx(optables.engine_step_s(h100, rows, tp), rel=1e-12)
    # a 1-row step of an 8B model on H100 costs about its weights over the HBM bandwidth (Vidur: ~0.8 of it)
    one, _ = _step_ops_s(h100, m, 1, 1, 1.0, 2)
    assert 1.0 < one / (m.params * 2 / h100.hbm_bytes_per_s) < 1.6


def test_a_users_own_tables_come_first_and_must_name_their_source(own_tables):
    own_tables([{"op": "gemm", "m": 1, "n": 4096, "k": 4096, "seconds": 1e-3, "source": "my H100, 2026-11-26"},
                {"op": "gemm", "m": 4096, "n": 4096, "k": 4096, "seconds": 2e-3, "source": "my H100, 2026-11-26"}])
    h100 = gpu("H100")
    assert optables.gemm_s(h100, 1, 4096, 4096) == pytest.approx(1e-3)
    assert optables.source_of(h100, "gemm") == "mine_H100.csv, vidur_H100.csv"   # its shape, Vidur's others
    assert optables.source_of(h100, "engine_step").startswith("vidur")    # ops it lacks come from the others
    own_tables([{"op": "gemm", "m": 1, "n": 8, "k": 8, "seconds": 1e-3, "source": ""}], name="bad_H100.csv")
    with pytest.raises(ValueError, match="no source"):
        optables.tables()


def test_a_users_series_replace_the_same_series_and_join_the_rest(own_tables):
    vidur = [r for r in optables.tables()["H100"]["gemm"]]
    shapes = {(r["n"], r["k"]) for r in vidur}
    mine_shape = (4096, 4096)
    assert mine_shape in shapes
    mine = [{"op": "gemm", "dtype": "bfloat16", "m": m, "n": 4096, "k": 4096, "seconds": s, "source": "my H100"}
            for m, s in ((1, 5e-6), (4096, 2e-4))]
    mine.append({"op": "gemm", "dtype": "bfloat16", "m": 64, "n": 3, "k": 5, "seconds": 1e-6, "source": "my H100"})
    mine.append({"op": "attention_decode", "dtype": "bfloat16", "batch": 1, "context": 64, "heads": 8, "kv_heads": 8,
                 "head_dim": 64, "seconds": 7e-6, "source": "my H100"})
    h100 = gpu("H100")
    other = next(s for s in sorted(shapes) if s != mine_shape)
    before = optables.gemm_s(h100, 256, *other)
    own_tables(mine, name="hetrl-measured_H100.csv")
    rows = optables.tables()["H100"]["gemm"]
    by_shape = {}
    for r in rows:
        by_shape.setdefault((r["n"], r["k"]), set()).add(r["file"])
    assert by_shape[mine_shape] == {"hetrl-measured_H100.csv"}          # the same series: mine only
    assert by_shape[(3, 5)] == {"hetrl-measured_H100.csv"}              # a new series joins
    assert set(by_shape) == shapes | {(3, 5)}                           # and every other Vidur series stays
    assert len(rows) == 3 + sum((r["n"], r["k"]) != mine_shape for r in vidur)
    assert optables.gemm_s(h100, 4096, 4096, 4096) == pytest.approx(2e-4)
    assert optables.gemm_s(h100, 256, *other) == pytest.approx(before, rel=1e-12)   # Vidur's series as it was
    # decode attention is one curve over every shape (by bytes): a file's kernel prices it whole, never mixed
    assert {r["file"] for r in optables.tables()["H100"]["attention_decode"]} == {"hetrl-measured_H100.csv"}


def test_a_gpus_own_few_shapes_leave_its_architectures_others_in_place(own_tables):
    """A lent H200's measured file (hetrl-measured_H200.csv) holds a few GEMM shapes. Those shapes are priced from
    it; every other shape keeps what priced the H200 before it had a table (the H100 profile's efficiency on the
    H200's roofline), rather than being interpolated from the few shapes by weight size."""
    h200 = gpu("H200")
    mine_shape = (4096, 4096)
    others = sorted({(r["n"], r["k"]) for r in optables.tables()["H100"]["gemm"]} - {mine_shape})
    probe = [(m, *shape) for shape in (others[0], others[len(others) // 2], others[-1]) for m in (1, 300, 8192)]
    probe += [(64, 5000, 3000), (64, 50_000, 8192)]                        # shapes no table measured
    before = {x: optables.gemm_s(h200, *x) for x in probe}
    own_tables([{"op": "gemm", "dtype": "bfloat16", "m": m, "n": 4096, "k": 4096, "seconds": sec,
                 "source": "measured: NVIDIA H200"} for m, sec in ((1, 9e-6), (4096, 1.5e-4))],
               name="hetrl-measured_H200.csv")
    assert optables.nearest_measured(h200, "gemm") == "H200"
    assert optables.gemm_s(h200, 1, *mine_shape) == pytest.approx(9e-6, rel=1e-12)
    assert optables.gemm_s(h200, 4096, *mine_shape) == pytest.approx(1.5e-4, rel=1e-12)
    for x in probe[:9]:
        assert optables.gemm_s(h200, *x) == pytest.approx(before[x], rel=1e-12), x
    for x in probe[9:]:   # interpolated by weight size over both tables' shapes: finite, near what it was
        assert 0.5 < optables.gemm_s(h200, *x) / before[x] < 2, x
    assert optables.source_of(h200, "gemm") == ("hetrl-measured_H200.csv; the shapes it lacks from vidur_H100.csv, "
                                                "scaled from H100 by peak FLOP/s and HBM bandwidth")
    assert optables.gemm_s(gpu("H100"), 1, *mine_shape) == pytest.approx(_measured("H100", *mine_shape, 1))


def test_only_graph_timed_gemms_of_whole_series_price_the_engine():
    """hetrl-measured_GPU.csv holds what prices an inference engine's kernels: CUDA-graph GEMMs of shapes measured at
    every M; a shape the budget cut part-way, launch-timed rows, and torch's SDPA decode and grouped-GEMM MoE (not
    the engine's paged and fused kernels) stay out."""
    from hetrl.bench.operators import engine_rows

    graph, launched = "measured: H100; a CUDA graph of 8 calls", "measured: H100; 8 calls back to back"
    whole = [dict(op="gemm", m=m, n=8, k=4, seconds=1e-5, source=graph) for m in (1, 64)]
    cut = [dict(op="gemm", m=1, n=16, k=4, seconds=1e-5, source=graph)]
    slow = [dict(op="gemm", m=m, n=32, k=4, seconds=1e-5, source=launched) for m in (1, 64)]
    others = [dict(op=op, m=1, n=8, k=4, seconds=1e-5, source=graph) for op in ("attention_decode", "moe_layer")]
    assert engine_rows(whole + cut + slow + others, tokens=(1, 64)) == whole


def test_a_missing_folder_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("HETRL_OPERATOR_TABLES", str(tmp_path / "nowhere"))
    optables.reload()
    try:
        with pytest.raises(ValueError, match="not a folder"):
            optables.tables()
    finally:
        monkeypatch.delenv("HETRL_OPERATOR_TABLES")
        optables.reload()


def test_a_clusters_own_type_uses_the_tables_it_names_or_none():
    base = dict(name="H100-mine", dense_bf16_flops=989e12, memory_bytes=80e9, hbm_bytes_per_s=3.35e12,
                nvlink_bytes_per_s=450e9, source="test")
    assert optables.nearest_measured(GPUType(**base), "gemm") is None          # roofline constants
    named = GPUType(**base, operator_tables="H100")
    assert optables.nearest_measured(named, "gemm") == "H100"
    assert math.isclose(optables.gemm_s(named, 64, 4096, 4096), optables.gemm_s(gpu("H100"), 64, 4096, 4096))
    cluster = cluster_from_dict({"name": "c", "gpu_types": [{**base, "operator_tables": "H100"}],
                                 "nodes": [{"name": "n", "region": "r", "gpu": "H100-mine", "count": 8}]})
    assert cluster.gpus[0].type.operator_tables == "H100"


def test_tables_off_prices_by_the_roofline_constants(roofline_only):
    assert optables.gemm_s(gpu("H100"), 64, 4096, 4096) is None
    assert optables.pricing([gpu("H100")])["H100"]["kernels"] == "no table (roofline constants)"


def test_a_plan_priced_before_the_tables_change_is_priced_again(monkeypatch):
    """The plan space's caches (a group's configurations, a task's options, transfers, syncs) hold seconds priced
    from the tables: reading the tables again forgets them (a group configured with tables, then the same group
    with HETRL_OPERATOR_TABLES=off, kept the tables' seconds)."""
    from hetrl.planner import load_cluster, load_workload, space

    c = load_cluster("examples/clusters/h100-2x8.yaml")
    w = load_workload("examples/workloads/qwen3-8b-grpo-sync.yaml")
    with_tables = space.group_seconds(space.configure(c, w, ("actor_gen",), (1,)))
    monkeypatch.setenv("HETRL_OPERATOR_TABLES", "off")
    optables.reload()
    try:
        off = space.group_seconds(space.configure(c, w, ("actor_gen",), (1,)))
        space.configurations.cache_clear()
        space._ranked.cache_clear()
        assert off == space.group_seconds(space.configure(c, w, ("actor_gen",), (1,)))
        assert off != with_tables
    finally:
        monkeypatch.delenv("HETRL_OPERATOR_TABLES")
        optables.reload()


def test_a_measured_cuda_device_is_named_as_the_catalog_names_it():
    """One rule (catalog.device_type) for the operator tables' file name and the train-split benchmark's MFU peak;
    the latter had its own, which read an A100 40GB as the 80GB type and an H200 as whichever of H20 / H200 the
    catalog listed first."""
    import sys
    import types

    from benchmarks import train_split
    from hetrl.planner.catalog import device_type
    assert device_type("NVIDIA H100 80GB HBM3") == "H100"
    assert device_type("NVIDIA A100-SXM4-40GB") == "A100-40G"
    assert device_type("NVIDIA A100-SXM4-80GB") == "A100-80G"
    assert device_type("NVIDIA H200") == "H200"
    assert device_type("NVIDIA H20") == "H20"
    assert device_type("NVIDIA GeForce RTX 4090") is None
    for name, want in (("NVIDIA A100-SXM4-40GB", "A100-40G"), ("NVIDIA H200", "H200"), ("NVIDIA H20", "H20")):
        fake = types.SimpleNamespace(cuda=types.SimpleNamespace(get_device_name=lambda _d, n=name: n),
                                     device=lambda d: d)
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(sys.modules, "torch", fake)
            peak, source = train_split.peak_flops("cuda", "bf16-mixed")
        assert peak == GPUS[want].dense_bf16_flops and source.startswith(f"catalog {want} ")


def test_a_measured_fused_moe_layer_comes_back_as_measured_and_other_gpus_scale_by_their_roofline():
    """vLLM PR #44818's fused-MoE layer (E=128, N=704, K=2816, top-8, bf16, H200): each measured batch comes back
    as its median; H100 (same FLOP/s, 0.7x the HBM) at a bandwidth-bound batch takes the HBM ratio longer."""
    h200, h100 = gpu("H200"), gpu("H100")
    rows = optables.tables()["H200"]["moe_layer"]
    for r in rows:
        e, topk, m = r["experts"], r["topk"], r["m"]
        touched = e * (1 - (1 - topk / e) ** m)
        got = optables.moe_layer_s(h200, m * topk / touched, touched, r["n"], r["k"])
        assert got == pytest.approx(r["seconds"], rel=1e-9), m
    assert optables.nearest_measured(h100, "moe_layer") == "H200"
    ratio = optables.moe_layer_s(h100, 2.0, 100, 704, 2816) / optables.moe_layer_s(h200, 2.0, 100, 704, 2816)
    assert ratio == pytest.approx(h200.hbm_bytes_per_s / h100.hbm_bytes_per_s, rel=1e-9)


def test_an_moe_decode_step_runs_its_routed_experts_as_one_fused_layer():
    """The routed experts of a layer are the engine's one fused kernel (vLLM fused_moe), not a GEMM launch per
    expert: at the same touched weights, twice the experts of half the width cost about the same, where 16
    launches would have cost twice the launch floors of 8."""
    from hetrl.planner.spec import ModelSpec
    h100 = gpu("H100")
    base = dict(layers=4, hidden=2048, heads=16, kv_heads=4, head_dim=128, intermediate=0, vocab=32000, experts=128,
                experts_per_token=8, moe_intermediate=768)
    a = ModelSpec(name="a", **base)
    b = ModelSpec(name="b", **{**base, "experts": 256, "experts_per_token": 16, "moe_intermediate": 384})
    ta, _ = _step_ops_s(h100, a, 1, 1, 1.0, 2)
    tb, _ = _step_ops_s(h100, b, 1, 1, 1.0, 2)
    assert tb / ta == pytest.approx(1.0, abs=0.1)


def test_the_measured_moe_layer_is_the_routed_experts_it_says():
    """hetrl.bench.operators' moe_layer (grouped GEMMs over tokens sorted by expert) equals the layer computed token
    by token, expert by expert (bf16 rounding apart)."""
    import torch

    from hetrl.bench.operators import moe_layer
    g = torch.Generator().manual_seed(0)
    m, e, f, h, k = 16, 8, 32, 64, 2
    x, router = torch.randn(m, h, generator=g).bfloat16(), torch.randn(h, e, generator=g).bfloat16()
    w13, w2 = (torch.randn(e, h, 2 * f, generator=g) / 8).bfloat16(), (torch.randn(e, f, h, generator=g) / 6).bfloat16()
    got = moe_layer(x, router, w13, w2, k).float()
    weights, experts = torch.softmax(x @ router, dim=-1, dtype=torch.float32).topk(k, dim=-1)
    want = torch.zeros(m, h)
    for t in range(m):
        for j in range(k):
            i = experts[t, j]
            gate, up = (x[t].float() @ w13[i].float()).chunk(2)
            want[t] += weights[t, j] * ((torch.nn.functional.silu(gate) * up) @ w2[i].float())
    assert torch.allclose(got, want, atol=0.03 * want.abs().max().item())


def test_an_operator_row_is_a_pass_of_calls_over_rotated_inputs_divided_by_its_calls(monkeypatch):
    """hetrl.bench.operators times kernels, not launches: every timed pass runs at least CALLS calls, cycling over
    the input copies; the row is a pass's median over its calls. Copies together exceed any catalog GPU's L2."""
    import torch

    from hetrl.bench import operators

    counts = [0, 0, 0]

    def call(i):
        def f():
            counts[i] += 1
        return f

    s, how = operators._per_call([call(0), call(1), call(2)], torch.device("cpu"), repeats=3)
    assert how == "3 calls back to back" and s > 0
    assert counts == [4, 4, 4]          # on a CPU a pass is the calls given: a warm-up pass and 3 timed ones
    counts[:] = [0, 0, 0]
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(operators, "seconds", lambda fn, device: (fn(), 1.0)[1])
    s, how = operators._per_call([call(0), call(1), call(2)], torch.device("cuda"), repeats=3, graph=False)
    # on CUDA every pass runs at least CALLS calls, cycling over the copies: 3 + 3 + 2 of 8; the row is a pass / 8
    assert how == f"{operators.CALLS} calls back to back" and s == 1.0 / operators.CALLS
    assert counts == [4 * 3, 4 * 3, 4 * 2]
    assert operators.copies_for(32 << 20) * (32 << 20) >= operators.ROTATE_BYTES > 50 << 20   # H100's L2: 50 MiB
    assert operators.copies_for(8 << 30) == 1 and operators.copies_for(16) == operators.MAX_COPIES


@pytest.mark.gpu
def test_operator_rows_on_cuda_replay_a_cuda_graph_where_they_can(tmp_path):
    """On a GPU, GEMM, copy and inference attention rows are CUDA graph replays (no host launch in the time); the
    MoE layer (its routing syncs with the host), training attention (autograd) and the HF decode step (eager, as
    hetrl's loop runs it) are launched back to back; every row says which."""
    from hetrl.bench import operators

    res = operators.measure("cuda", tmp_path, ["qwen3-4b"], budget_s=60, quick=True)
    assert res["rows"] and not res["stopped_at_budget"]
    for r in res["rows"]:
        graphed = r["op"] in ("copy", "gemm", "attention_decode", "attention_prefill")
        want = "a CUDA graph of" if graphed else "back to back"
        assert want in r["source"] and r["seconds"] > 0, r


def test_ep_tables_keep_the_measured_fractions_and_latencies():
    """DeepEP's published numbers (hetrl/planner/data/operators/deepep_H800.csv) come back as measured: the normal
    kernels' bandwidth as a fraction of the H800's line rate by span (nearest measured), the low-latency kernels'
    dispatch + combine time at the measured call size, held as a floor below it and bandwidth-bound above it."""
    h800, h100 = gpu("H800"), gpu("H100")
    assert optables.ep_link_fraction(h800, 8, "nvlink") == pytest.approx((153 + 158) / 2 / 200)
    assert optables.ep_link_fraction(h100, 16, "rdma") == pytest.approx(43 / 50)
    assert optables.ep_link_fraction(h100, 32, "rdma") == pytest.approx((58 + 57) / 2 / 50)
    assert optables.ep_link_fraction(h100, 40, "rdma") == pytest.approx((58 + 57) / 2 / 50)   # nearest: 32
    assert optables.ep_lowlatency_s(h800, 8, 1.0, 1.0, 50e9) == pytest.approx(77e-6 + 114e-6)
    assert optables.ep_lowlatency_s(h800, 256, 1.0, 1.0, 50e9) == pytest.approx(194e-6 + 360e-6)
    between = optables.ep_lowlatency_s(h800, 24, 1.0, 1.0, 50e9)
    assert 118e-6 + 195e-6 < between < 155e-6 + 273e-6
    big = optables.ep_lowlatency_s(h800, 8, 1e9, 1e9, 50e9)
    assert big == pytest.approx(1e9 / 98e9 + 1e9 / 127e9)
    assert optables.ep_lowlatency_s(h800, 8, 1e9, 1e9, 100e9) == pytest.approx(big / 2)   # twice the network


def test_decode_under_expert_parallelism_pays_the_low_latency_floor_per_layer_and_step(monkeypatch):
    """With the tables a decode step's dispatch + combine in each MoE layer costs at least DeepEP's measured
    low-latency call (191 us at EP 8); the alpha-beta all-to-all without them charges only link latencies."""
    from hetrl.planner.cost import task_costs
    from hetrl.planner.plan import Parallelism
    from tests.planner.test_moe_long_megatron import _group, _h100, _workload
    c, w = _h100(), _workload()
    par = Parallelism(1, 1, 8, ep=8)
    terms = task_costs(c, w, _group(c, w, par, gen=par))["actor_gen"].terms
    monkeypatch.setenv("HETRL_OPERATOR_TABLES", "off")
    optables.reload()
    try:
        without = task_costs(c, w, _group(c, w, par, gen=par))["actor_gen"].terms["ep_comm"]
    finally:
        monkeypatch.delenv("HETRL_OPERATOR_TABLES")
        optables.reload()
    steps = w.response_tokens.max
    assert terms["ep_comm"] >= w.actor.moe_layers * steps * (77e-6 + 114e-6) * (1 - 1e-9)
    assert terms["ep_comm"] > 5 * without


def test_decode_attention_table_keeps_its_measured_points_floor_and_bandwidth():
    """The decode-attention rows (hetrl/planner/data/operators/decode-attention_H100.csv: FlashAttention-2 and -3
    paged decode on H100) price one layer's call by the K and V bytes it reads: measured points come back, below
    the smallest the kernel's floor holds, above the largest time grows in proportion, and another GPU scales by
    its HBM bandwidth."""
    h100 = gpu("H100")
    assert optables.attention_decode_s(h100, 9 * 2**20) == pytest.approx(21.135e-6)
    assert optables.attention_decode_s(h100, 16 * 4000 * 32 * 128 * 4) == pytest.approx(567.2e-6)
    assert optables.attention_decode_s(h100, 1e3) == pytest.approx(21.135e-6)          # the floor
    big = 16 * 4000 * 32 * 128 * 4
    assert optables.attention_decode_s(h100, 4 * big) == pytest.approx(4 * 567.2e-6)  # bandwidth-bound
    sizes = [2**k for k in range(20, 33)]
    times = [optables.attention_decode_s(h100, b) for b in sizes]
    assert times == sorted(times)
    h200 = gpu("H200")
    assert optables.attention_decode_s(h200, big) == pytest.approx(567.2e-6 * h100.hbm_bytes_per_s
                                                                    / h200.hbm_bytes_per_s)


def test_decode_attention_from_the_table_in_the_rollout():
    """With the tables the rollout's KV reads are the decode-attention table's time per layer call (steps x layers
    calls of an even share of the bytes); without them the HBM roofline at HBM_EFF prices them."""
    from hetrl.planner.cost import HBM_EFF, task_costs
    from hetrl.planner.plan import Parallelism
    from tests.planner.test_moe_long_megatron import _group, _h100, _workload
    c = _h100()
    w = _workload(actor="qwen3-8b", models={"actor": "qwen3-8b", "reference": "qwen3-8b"})
    par = Parallelism(1, 1, 8)
    hbm_s = task_costs(c, w, _group(c, w, par))["actor_gen"].terms["hbm"]
    m = w.actor
    batch = w.generated_samples / 8
    p, r = w.prompt_tokens.mean, w.response_tokens.mean
    steps = w.response_tokens.max
    kv_bytes = batch * r * (p + r / 2) * m.kv_bytes_per_token
    want = steps * m.full_attention_layers * optables.attention_decode_s(
        gpu("H100"), kv_bytes / (steps * m.full_attention_layers))
    assert hbm_s == pytest.approx(want, rel=1e-9)
    assert hbm_s > kv_bytes / (gpu("H100").hbm_bytes_per_s * HBM_EFF)   # the measured kernel is below the roofline


def test_decode_allreduce_is_vllms_measured_kernels_up_to_8_ranks_then_nccl():
    """vllm-allreduce_H100.csv (vLLM PR #24111's H100 TP=4 benchmark, the fastest backend per size): measured points
    come back; another group size scales the part above the floor by the ring's 2(k-1)/k; above the largest size
    measured vLLM falls back to NCCL, whose table prices it (never below the largest measured call); more than 8
    ranks (beyond vLLM's own kernels) and GPUs without NVLink get no price from it."""
    h100 = gpu("H100")
    rows = sorted(optables.tables()["H100"]["decode_all_reduce"], key=lambda r: r["bytes"])
    assert [r["group"] for r in rows] == [4] * 6
    for r in rows:
        assert optables.decode_allreduce_s(h100, r["bytes"], 4) == pytest.approx(r["seconds"], rel=1e-9)
    floor, top = rows[0], rows[-1]
    assert optables.decode_allreduce_s(h100, floor["bytes"] / 8, 4) == pytest.approx(floor["seconds"])
    k8 = optables.decode_allreduce_s(h100, top["bytes"], 8)
    assert k8 == pytest.approx(floor["seconds"] + (top["seconds"] - floor["seconds"]) * (14 / 8) / (6 / 4))
    big = 4 * top["bytes"]
    assert optables.decode_allreduce_s(h100, big, 4) == pytest.approx(
        max(top["seconds"], optables.allreduce_s(h100, big, 4)))
    assert optables.decode_allreduce_s(h100, top["bytes"], 16) is None
    assert optables.decode_allreduce_s(gpu("L20"), top["bytes"], 4) is None   # PCIe: no NVLink
    assert optables.pricing([gpu("A100-80G")])["A100-80G"]["decode_all_reduce"] == \
        "vllm-allreduce_H100.csv, scaled from H100 by NVLink bandwidth"


def test_a_rollouts_tp_allreduces_in_one_node_are_vllms_measured_calls():
    """A TP-4 rollout inside one H100 node: its tp_comm is steps x layers x 2 calls of decode_allreduce_s at each
    call's bytes (the rows a replica decodes per step x hidden x 2 bytes), not the ring's 2(k-1) latencies."""
    from hetrl.planner.cost import allreduce_s, task_costs
    from hetrl.planner.plan import Parallelism
    from hetrl.planner.spec import INTRA_NODE_LATENCY_S
    from tests.planner.test_moe_long_megatron import _group, _h100, _workload
    c = _h100()
    w = _workload(actor="qwen3-8b", models={"actor": "qwen3-8b", "reference": "qwen3-8b"})
    group = _group(c, w, Parallelism(1, 1, 8), gen=Parallelism(4, 1, 2))
    tp_comm = task_costs(c, w, group)["actor_gen"].terms["tp_comm"]
    m = w.actor
    steps = w.response_tokens.max
    calls = 2 * m.layers * steps
    nbytes = 2 * m.layers * (w.generated_samples / 2) * w.response_tokens.mean * m.hidden * 2
    want = calls * optables.decode_allreduce_s(gpu("H100"), nbytes / calls, 4)
    assert tp_comm == pytest.approx(want, rel=1e-9)
    assert tp_comm < allreduce_s(nbytes, 4, (INTRA_NODE_LATENCY_S, gpu("H100").nvlink_bytes_per_s), calls)
