"""The benchmark's layouts compute the same log-probs as the oracle before anyone times them."""

import json

import pytest
import torch

from hetrl.bench import dualkv_grid
from hetrl.bench.dualkv_grid import Case, build_model, make_group, variant_logprobs


def test_every_layout_gives_the_oracle_logprobs():
    model = build_model("qwen3-shaped")
    case = Case("qwen3-shaped", 3, 17, 5)
    prompt, responses = make_group(case, model.config.vocab_size)
    with torch.no_grad():
        ref = variant_logprobs("reference", model, prompt, responses)()
        for v in ("padded", "packed", "prefix_grouper", "dualkv"):
            assert (variant_logprobs(v, model, prompt, responses)() - ref).abs().max() < 1e-4, v


def test_flop_ratio_is_rho_for_linear_layers_and_more_with_attention():
    model = build_model("qwen3-shaped")
    case = Case("qwen3-shaped", 8, 1024, 64)
    assert dualkv_grid.flop_ratio(model, case) > 1
    assert abs(case.rho - 8 * 1088 / (1024 + 512)) < 1e-12


def test_a_grid_run_appends_each_case_and_skips_what_is_done(tmp_path, monkeypatch):
    calls = []

    def fake_times(model, case, repeats):
        calls.append((case.n, case.p, case.r))
        times = {v: 2.0 for v in dualkv_grid.VARIANTS}
        return {"update_s": times, "logprob_s": times,
                "errors": {}, "max_abs_logprob_diff": {}}

    monkeypatch.setattr(dualkv_grid, "measure_times", fake_times)
    rows = tmp_path / "rows.jsonl"
    cases = [dualkv_grid.parse_case("3x17x5"), dualkv_grid.parse_case("2x9x4")]
    first = dualkv_grid.run(False, 2, memory=False, cases=cases[:1], rows_path=str(rows))
    again = dualkv_grid.run(False, 2, memory=False, cases=cases, rows_path=str(rows))
    assert calls == [(3, 17, 5), (2, 9, 4)]             # the first case was not measured twice
    assert len(first["rows"]) == 1 and len(again["rows"]) == 2 and len(rows.read_text().splitlines()) == 2
    assert f"Partial: 0 of the {len(dualkv_grid.all_cases(False))} grid cases" in dualkv_grid.markdown(again)


def test_rows_missing_a_variant_are_measured_again(tmp_path, monkeypatch):
    old = {"model": "qwen3-shaped", "n": 3, "p": 17, "r": 5, "repeats": 2, "update_s": {"packed": 1.0, "dualkv": 1.0}}
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(old) + "\n")
    calls = []
    monkeypatch.setattr(dualkv_grid, "measure_times", lambda model, case, repeats: calls.append(case) or
                        {"update_s": {v: 1.0 for v in dualkv_grid.VARIANTS}, "logprob_s": {}, "errors": {},
                         "max_abs_logprob_diff": {}})
    res = dualkv_grid.run(False, 2, memory=False, cases=[dualkv_grid.parse_case("3x17x5")], rows_path=str(rows))
    assert len(calls) == 1 and len(res["rows"]) == 1 and set(res["rows"][0]["update_s"]) == set(dualkv_grid.VARIANTS)


def test_prefix_grouper_inner_attention_skips_padding_like_flash_attn():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 4, dtype=torch.float64) for n in (3, 5, 5))
    left_padded = torch.tensor([[False, True, True, True, True]])      # one pad key, then 4 real ones
    got, _ = dualkv_grid._flash_like_sdpa(None, q, k, v, left_padded)
    causal = torch.tril(torch.ones(3, 4, dtype=torch.bool), diagonal=1)  # bottom-right over the real keys
    want = torch.nn.functional.scaled_dot_product_attention(q, k[:, :, 1:], v[:, :, 1:], attn_mask=causal)
    assert (got.transpose(1, 2) - want).abs().max() < 1e-12


@pytest.mark.slow   # a minute of processes; the slow tier runs it
def test_memory_is_measured_per_variant_in_fresh_processes_side_by_side():
    mem = dualkv_grid.measure_memory(Case("qwen3-shaped", 2, 16, 8), jobs=2)
    assert set(mem) == set(dualkv_grid.VARIANTS)
    for v, m in mem.items():
        assert "error" not in m, (v, m)
        assert m["resident_kb"] > 100_000 and m["increase_kb"] == m["peak_kb"] - m["resident_kb"] >= 0, (v, m)


# ----------------------------------------------------------------------------- the layer benchmark (#20 item 6)


def test_the_layer_benchmark_runs_at_tiny_sizes_on_cpu_and_writes_its_table(tmp_path):
    """`hetrl bench dualkv --layer tiny`: the paper's Table 2 procedure at CPU sizes, every layout that runs on
    CPU through the model's own code, their log-probs equal to DualKV's, FLOPs counted per layout, the cost
    model's prediction beside, rows written as they finish, files written."""
    from hetrl.bench import dualkv_layer
    from hetrl.cli import main

    assert main(["bench", "dualkv", "--layer", "tiny", "--repeats", "1", "--checkpointing", "--out",
                 str(tmp_path)]) == 0
    res = json.loads((tmp_path / "dualkv_layer_tiny_cpu.json").read_text())
    assert [(r["p"], r["mb"]) for r in res["rows"]] == [(64, 2), (64, 4), (128, 2), (128, 4)]
    for r in res["rows"]:
        assert all(8 <= x <= 32 for x in r["responses"]) and len(r["responses"]) == r["mb"]
        lay = r["layouts"]
        assert lay["dualkv_ckpt"]["max_abs_logprob_diff"] <= 1e-6       # the same pass, recomputed
        for k in ("packed_sdpa", "prefix_grouper"):
            assert lay[k]["max_abs_logprob_diff"] < 1e-4, k
        assert "skipped" in lay["packed_varlen"] and "skipped" in lay["packed_flex"]    # CUDA-only kernels
        assert r["packed"] == "packed_sdpa" and r["speedup"] > 0 and r["speedup_vs_prefix_grouper"] > 0
        assert lay["dualkv"]["seconds"] > 0 and lay["dualkv"]["flops"] < lay["packed_sdpa"]["flops"]
        assert lay["dualkv_ckpt"]["flops"] > lay["dualkv"]["flops"]
        assert 0 < lay["dualkv"]["predicted_h100_s"] < lay["packed_sdpa"]["predicted_h100_s"]
    text = (tmp_path / "dualkv_layer_tiny_cpu.md").read_text()
    assert "| 128 | 4 |" in text and "predicted ms" in text and "packed_varlen (flash varlen is CUDA-only)" in text
    assert len((tmp_path / "dualkv_layer_tiny_cpu.jsonl").read_text().splitlines()) == 4
    again = dualkv_layer.from_rows(str(tmp_path / "dualkv_layer_tiny_cpu.jsonl"), repeats=1)   # a run cut short
    assert again["rows"] == res["rows"] and dualkv_layer.markdown(again) == text
    # the same lengths for the same seed; the full grid is the paper's
    assert dualkv_layer.cases("full")[0].responses == dualkv_layer.cases("full")[0].responses
    assert {(c.p, c.mb) for c in dualkv_layer.cases("full")} >= set(dualkv_layer.PAPER_MS)
    assert all(131 <= x <= 2048 for c in dualkv_layer.cases("full") for x in c.responses)


def test_the_layer_benchmark_runs_the_cases_asked_in_that_order_and_refuses_others():
    from hetrl.bench import dualkv_layer

    res = dualkv_layer.run("tiny", repeats=1, only=[dualkv_layer.parse_case("128x4"), (64, 2)])
    assert [(r["p"], r["mb"]) for r in res["rows"]] == [(128, 4), (64, 2)]
    assert dualkv_layer.parse_case("8Kx8") == (8192, 8) and dualkv_layer.parse_case("16384x8") == (16384, 8)
    with pytest.raises(ValueError, match="8192x8 not in the tiny grid"):
        dualkv_layer.run("tiny", only=[(8192, 8)])
    with pytest.raises(ValueError, match="PxMB"):
        dualkv_layer.parse_case("8x8x8")


def test_the_flex_document_mask_packed_layout_gives_the_same_logprobs_forward_on_cpu():
    """packed_flex runs forward + backward on CUDA only; its forward (hetrl's flex path with a document-causal
    mask) is checked here against the per-sequence SDPA layout."""
    from hetrl.bench import dualkv_layer

    model = dualkv_layer.build_layer("tiny", torch.device("cpu"), torch.float32)
    case = dualkv_layer.cases("tiny")[3]
    prompt, responses = dualkv_layer._group(case, torch.device("cpu"))
    with torch.no_grad():
        flex = dualkv_layer.layout_logprobs("packed_flex", model, prompt, responses, torch.device("cpu"))()
        sdpa = dualkv_layer.layout_logprobs("packed_sdpa", model, prompt, responses, torch.device("cpu"))()
    assert flex.shape == (sum(case.responses),) and (flex - sdpa).abs().max().item() < 1e-5


def test_flash_varlen_is_called_causal_in_either_spelling_of_the_api():
    from hetrl.bench.dualkv_layer import _varlen_kwargs

    def older(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None):
        pass

    def newer(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
              enable_gqa=False):
        pass

    assert _varlen_kwargs(older) == {"is_causal": True}
    assert _varlen_kwargs(newer) == {"window_size": (-1, 0), "enable_gqa": True}


def test_the_layer_prediction_is_the_cost_models_compute_term():
    """What the planner would charge for the layer pass on an H100: its FLOPs (mean response length, DualKV or
    not, checkpointing's extra forward) over the catalog's peak at the cost model's training MFU."""
    from hetrl.bench import dualkv_layer
    from hetrl.planner.cost import MFU_TRAIN
    from hetrl.trainer.placement import model_spec_from_hf

    model = dualkv_layer.build_layer("tiny", torch.device("cpu"), torch.float32)
    spec = model_spec_from_hf(model.config)
    case = dualkv_layer.LayerCase(100, 4, (10, 20, 30, 40))
    at = 989e12 * MFU_TRAIN
    attn = 4 * 1 * 4 * 16
    dual_pairs, packed_pairs = 100 * 100 / 2 + 4 * (25 * 100 + 25 * 25 / 2), 4 * 125 * 125 / 2
    assert dualkv_layer.predicted_seconds(model, case, "dualkv") == pytest.approx(
        (6 * spec.active_params * 200 + 3 * attn * dual_pairs) / at)
    assert dualkv_layer.predicted_seconds(model, case, "dualkv_ckpt") == pytest.approx(
        (8 * spec.active_params * 200 + 4 * attn * dual_pairs) / at)
    assert dualkv_layer.predicted_seconds(model, case, "packed_varlen") == pytest.approx(
        (6 * spec.active_params * 500 + 3 * attn * packed_pairs) / at)


def test_the_layer_flop_count_is_the_papers_rho_on_linear_layers():
    from hetrl.bench import dualkv_layer

    model = dualkv_layer.build_layer("tiny", torch.device("cpu"), torch.float32)
    case = dualkv_layer.LayerCase(100, 4, (10, 20, 30, 40))
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)

    def attn(pairs):
        return 3 * 4 * 4 * 16 * pairs

    assert dualkv_layer.executed_flops(model, case, "packed") == 6 * params * 500 + attn(sum((100 + r) ** 2 / 2
                                                                                             for r in case.responses))
    assert dualkv_layer.executed_flops(model, case, "dualkv") == 6 * params * 200 + attn(
        100 * 100 / 2 + sum(r * 100 + r * r / 2 for r in case.responses))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU; tests/dualkv/test_gpu.py runs it there")
def test_the_layer_benchmark_on_cuda_without_a_gpu_is_one_line(capsys):
    from hetrl.cli import main

    assert main(["bench", "dualkv", "--layer", "tiny", "--device", "cuda"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_no_packed_kernel_is_registered_under_a_name_transformers_reads_as_flash_attention():
    """transformers loads any attention name containing "flash" as a flash-attn hub kernel; the first lent GPU
    found `packed_varlen` registered as `hetrl_bench_flash_varlen` and every cell of it failed that way."""
    from transformers.utils.generic import is_flash_attention_requested

    from hetrl.bench import dualkv_layer

    for layout, name in dualkv_layer._PACKED_ATTN.items():
        assert not is_flash_attention_requested(requested_attention_implementation=name), (layout, name)
