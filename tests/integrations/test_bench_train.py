"""`hetrl bench train` on the tiny model: both systems train on the same prompts, with TRL configured by hetrl's
run config (checked through TRL's own GRPOConfig), results appended per run and not run twice."""

import json

import pytest

pytest.importorskip("trl")

from hetrl.bench import train_vs_trl  # noqa: E402
from hetrl.trainer.config import load_config  # noqa: E402

TINY = ("model=tiny", "eval_size=4")


def test_trl_is_configured_as_the_hetrl_run(tmp_path):
    cfg = load_config(None, ["steps=3", "lr=3e-5", "kl_coef=0.01", "clip_low=0.1", "clip_high=0.3",
                             "prompts_per_step=4", "responses_per_prompt=6", "mini_batches=3", "max_new_tokens=20"])
    args = train_vs_trl.trl_args(cfg, 7, str(tmp_path))
    # TRL derives the generation batch itself: one rollout batch of hetrl's, prompts_per_step x N samples
    assert args.generation_batch_size == 24 and args.num_generations == 6
    assert args.max_steps == 9 and args.steps_per_generation == 3 and args.per_device_train_batch_size == 8
    assert (args.learning_rate, args.beta, args.epsilon, args.epsilon_high) == (3e-5, 0.01, 0.1, 0.3)
    assert args.loss_type == "grpo" and args.lr_scheduler_type == "constant" and args.warmup_steps == 0
    assert (args.temperature, args.top_p, args.top_k, args.max_completion_length) == (0.7, 1.0, 0, 20)
    assert args.scale_rewards == "group" and args.shuffle_dataset is False and args.seed == 7
    assert args.gradient_checkpointing is False and args.bf16 is False


def test_both_systems_run_fp32_unless_the_bench_is_told(tmp_path, monkeypatch):
    """precision=auto would be bf16-mixed on a CPU with bf16 instructions: the bench pins both systems to fp32 (the
    committed comparisons are fp32 on both sides); --set precision=bf16-mixed reaches both."""
    monkeypatch.setenv("HETRL_CPU_BF16", "1")
    case = train_vs_trl.CASES["default"]
    cfg = train_vs_trl.job(case, 0, 1, str(tmp_path / "a"), TINY)[0]
    assert cfg.precision == "fp32" and train_vs_trl.trl_args(cfg, 0, str(tmp_path)).bf16 is False
    cfg = train_vs_trl.job(case, 0, 1, str(tmp_path / "b"), (*TINY, "precision=bf16-mixed"))[0]
    assert cfg.precision == "bf16-mixed" and train_vs_trl.trl_args(cfg, 0, str(tmp_path)).bf16 is True
    cfg = train_vs_trl.job(case, 0, 1, str(tmp_path / "c"), (*TINY, "precision=auto"))[0]
    assert train_vs_trl.trl_args(cfg, 0, str(tmp_path)).bf16 is True   # auto: as hetrl resolves it on this CPU


def test_bench_train_runs_both_systems_on_the_same_prompts(tmp_path):
    out = tmp_path / "results"
    train_vs_trl.main(["default"], ["hetrl", "trl-dualkv", "trl"], [0], 2, out, tmp_path / "work", TINY)
    records = [json.loads(line) for line in open(out / "train_vs_trl.jsonl")]
    assert [r["system"] for r in records] == ["hetrl", "trl-dualkv", "trl"]
    for r in records:
        assert [s["step"] for s in r["steps"]] == [1, 2]
        for s in r["steps"]:
            assert s["step_s"] > 0 and s["rollout_s"] > 0 and s["logprob_s"] > 0 and s["update_s"] > 0
            assert s["sample_tokens"] > 8 * 8       # every sample's prompt + completion
        assert 0 <= r["eval_accuracy_before"] <= 1 and 0 <= r["eval_accuracy_after"] <= 1
    for r in records[1:]:
        # TRL trained on hetrl's prompts in hetrl's order: 8 per step from the start of the stream
        assert [s["rows"] for s in r["steps"]] == [list(range(8)), list(range(8, 16))]
    table = json.loads((out / "train_vs_trl.json").read_text())["table"]["default"]
    assert table["trl"]["step_time_vs_stock_trl"] == 1.0 and set(table) == {"hetrl", "trl-dualkv", "trl"}
    text = (out / "train_vs_trl.md").read_text()
    assert "| hetrl | 0 |" in text and "What differs" in text
    # a second call finds every run in the file and runs none
    train_vs_trl.main(["default"], ["hetrl", "trl"], [0], 2, out, tmp_path / "work2", TINY)
    assert len(open(out / "train_vs_trl.jsonl").readlines()) == 3
    assert not (tmp_path / "work2" / "hetrl-default-0").exists()
    # `again` (after a code change) runs it once more: the newer record is the one reported, both are kept
    train_vs_trl.main(["default"], ["hetrl"], [0], 2, out, tmp_path / "work3", TINY, again=True)
    records = [json.loads(line) for line in open(out / "train_vs_trl.jsonl")]
    assert [r["system"] for r in records] == ["hetrl", "trl-dualkv", "trl", "hetrl"]
    assert all(r["revision"] for r in records)          # the git commit each ran from
    newer = train_vs_trl.summarise(records)["default"]["hetrl"]
    assert (newer["seeds"] == [0]
            and newer["step_s"] == train_vs_trl.summarise(records[1:])["default"]["hetrl"]["step_s"])
    assert "1 earlier run(s) of this case were made again" in (out / "train_vs_trl.md").read_text()


def test_bench_train_rejects_unknown_names(tmp_path):
    with pytest.raises(ValueError, match="trl-dualkv"):
        train_vs_trl.main(["default"], ["verl"], [0], 1, tmp_path, None, TINY)
    with pytest.raises(ValueError, match="long"):
        train_vs_trl.main(["short"], ["hetrl"], [0], 1, tmp_path, None, TINY)


def test_the_long_prompt_case_runs_on_trl(tmp_path):
    """The few-shot case passes its rows from Python to both systems; TRL trains on them."""
    out = tmp_path / "results"
    train_vs_trl.main(["long"], ["trl-dualkv"], [0], 1, out, tmp_path / "work", TINY + ("max_new_tokens=4",))
    (rec,) = [json.loads(line) for line in open(out / "train_vs_trl.jsonl")]
    assert rec["case"] == "long" and rec["steps"][0]["rows"] == [0, 1]
    assert rec["steps"][0]["sample_tokens"] > 2 * 8 * 100     # each prompt carries the few-shot block


def test_back_to_back_pairs_only_runs_of_one_invocation():
    """A hetrl and a stock TRL run pair up when they share the case, the seed and the peaks measured at the start of
    their invocation; a run of another invocation (another peak) or of another seed does not."""
    def rec(system, seed, peak, steps):
        return {"case": "default", "system": system, "seed": seed, "date": "d", "revision": "r",
                "machine": {"matmul_gflops": {"fp32": peak, "bf16": 1.0}},
                "steps": [{"step_s": s} for s in steps]}
    records = [rec("hetrl", 0, 100.0, [99, 10, 12]), rec("trl", 0, 100.0, [99, 40, 44]),
               rec("hetrl", 0, 150.0, [99, 8]), rec("trl", 1, 100.0, [99, 50])]
    pairs = train_vs_trl.back_to_back(records)
    assert len(pairs) == 1
    assert (pairs[0]["hetrl_step_s"], pairs[0]["trl_step_s"]) == (11, 42)   # medians of steps 2..
    assert pairs[0]["ratio"] == pytest.approx(11 / 42)


def test_runs_with_and_without_the_kl_are_separate_comparisons():
    """The grpo preset lost its KL on 2026-11-28: a record without `kl_coef` ran 0.001 unless its overrides set one,
    and a run of the current preset (no KL) is neither skipped as done nor averaged with a KL run of that seed."""
    def rec(system, **extra):
        return {"case": "default", "system": system, "seed": 0, "steps_asked": 2, "date": "d", "revision": "r",
                "matmul_params": 10, "machine": {"matmul_gflops": {"fp32": 100.0, "bf16": 1.0}},
                "steps": [{"step_s": s, "rollout_s": 1, "logprob_s": 1, "update_s": 1, "sample_tokens": 5}
                          for s in (9, 10)], **extra}
    old, old_zero, new = rec("hetrl"), rec("hetrl", overrides=["kl_coef=0"]), rec("hetrl", kl_coef=0.0)
    assert [train_vs_trl.kl_of(r) for r in (old, old_zero, new)] == [0.001, 0.0, 0.0]
    assert train_vs_trl._key(old) != train_vs_trl._key(new)
    table = train_vs_trl.summarise([old, rec("trl"), new])
    assert set(table) == {"default, kl_coef=0.001", "default"}
    assert table["default"]["hetrl"]["seeds"] == [0] and "trl" not in table["default"]
    assert load_config(None, []).kl_coef == 0.0      # what the bench's default case runs today
