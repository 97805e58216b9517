"""rollout_engine=vllm against the trainer as its oracle (vLLM installed: `bash scripts/install.sh --vllm`): the
samples' vLLM log-probs equal the trainer's DualKV log-probs of the same tokens at the same temperature (fp32), greedy
decoding equals hetrl's own, a weight sync makes vLLM sample from the new weights, and `hetrl train
rollout_engine=vllm` trains with the mismatch measured and corrected. One engine for the module (start-up is
20-130 s on 2 cores), used by the tests that come first: closing another engine in the same process tears down
vLLM's process-wide parallel state, so the tests that start and close their own come last."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from hetrl.cli import main  # noqa: E402
from hetrl.dualkv import pack_groups, shared_prompt_logprobs  # noqa: E402
from hetrl.models import tiny_model, tiny_tokenizer  # noqa: E402
from hetrl.trainer.precision import FP32  # noqa: E402
from hetrl.trainer.rollout import RolloutWorker  # noqa: E402
from hetrl.trainer.vllm_engine import VllmWorker  # noqa: E402

ROOT = pathlib.Path(__file__).parents[2]
TINY = str(ROOT / "examples" / "runs" / "tiny.yaml")
TEXTS = ["<|im_start|>user\n3+4=?<|im_end|>\n<|im_start|>assistant\n", "hello", "12 - 5 = ", "What is 9*9?"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer, seed=3).eval()
    worker = VllmWorker(model, tokenizer, FP32, tmp_path_factory.mktemp("vllm") / "model", max_model_len=256,
                        max_num_seqs=32, seed=0)
    yield model, tokenizer, worker
    worker.close()


def _prompts(tokenizer):
    return [tokenizer(t)["input_ids"] for t in TEXTS]


def _trainer_logprobs(model, prompts, groups, temperature):
    """The trainer's log-probs of the sampled tokens: hetrl.dualkv's shared-prompt path (what the update uses)."""
    batch = pack_groups([(p, [s.tokens for s in g]) for p, g in zip(prompts, groups)])
    with torch.no_grad():
        return batch.split_responses(shared_prompt_logprobs(model, batch, temperature=temperature))


def test_samples_carry_vllms_logprobs_equal_to_the_trainers(engine):
    model, tokenizer, worker = engine
    prompts = _prompts(tokenizer)
    torch.manual_seed(0)
    groups = worker.generate(prompts, 4, 12, temperature=0.7, logprobs=True)
    assert [len(g) for g in groups] == [4] * len(prompts)
    samples = [s for g in groups for s in g]
    assert all(1 <= len(s.tokens) <= 12 and len(s.logprobs) == len(s.tokens) for s in samples)
    assert all(s.truncated == (s.tokens[-1] != tokenizer.eos_token_id) for s in samples)
    assert all(tokenizer.eos_token_id not in s.tokens[:-1] for s in samples)    # stops at EOS, keeps it
    assert len({tuple(s.tokens) for s in samples}) > len(prompts)                # samples differ within a group
    want = _trainer_logprobs(model, prompts, groups, 0.7)
    got = [s.logprobs for s in samples]
    worst = max((g - w).abs().max().item() for g, w in zip(got, want))
    assert worst < 1e-4, f"vLLM's log-probs (after temperature) differ from the trainer's by {worst:.2e} in fp32"


def test_the_same_torch_seed_samples_the_same_tokens(engine):
    _, tokenizer, worker = engine
    prompts = _prompts(tokenizer)

    def tokens():
        torch.manual_seed(5)
        return [[s.tokens for s in g] for g in worker.generate(prompts, 3, 8, temperature=1.0)]

    first = tokens()
    assert tokens() == first
    assert first[1] != first[2]       # each request its own seed: two prompts do not share their draws


def test_greedy_decoding_equals_hetrls_own(engine):
    model, tokenizer, worker = engine
    prompts = _prompts(tokenizer)
    got = [g[0].tokens for g in worker.generate(prompts, 1, 10, greedy=True)]
    want = [g[0].tokens for g in RolloutWorker(model, tokenizer).generate(prompts, 1, 10, greedy=True)]
    assert got == want


def test_vllm_top_k_1_samples_the_greedy_tokens(engine):
    model, tokenizer, worker = engine
    prompts = _prompts(tokenizer)
    greedy = [g[0].tokens for g in worker.generate(prompts, 1, 8, greedy=True)]
    worker.top_k = 1
    try:
        sampled = worker.generate(prompts, 3, 8, temperature=1.3)
    finally:
        worker.top_k = 0
    assert all(s.tokens == want for g, want in zip(sampled, greedy) for s in g)


def test_after_a_weight_sync_vllm_samples_from_the_new_weights(engine, monkeypatch):
    """In buckets far smaller than a layer (many reload_weights calls): a bucket never splits a layer, which vLLM
    would load half (a layer's q_proj in one call and v_proj in the next came out NaN)."""
    from hetrl.trainer import vllm_engine

    model, tokenizer, worker = engine
    prompts = _prompts(tokenizer)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []
    monkeypatch.setattr(vllm_engine, "SYNC_BUCKET_BYTES", 20_000)
    monkeypatch.setattr(worker.llm, "collective_rpc", lambda fn, args: calls.append(args) or
                        type(worker.llm).collective_rpc(worker.llm, fn, args=args))
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        sync = worker.load_weights(model.state_dict())
        assert len(calls) >= 4          # embeddings, layer 0, layer 1, the final norm and head
        assert sync["weight_sync_bytes"] == sum(v.numel() * v.element_size() for v in model.state_dict().values())
        torch.manual_seed(1)
        groups = worker.generate(prompts, 2, 8, temperature=1.0, logprobs=True)
        want = _trainer_logprobs(model, prompts, groups, 1.0)
        worst = max((s.logprobs - w).abs().max().item() for s, w in zip([s for g in groups for s in g], want))
        assert worst < 1e-4, worst
    finally:
        model.load_state_dict(saved)
        worker.load_weights(model.state_dict())


def test_train_with_vllm_measures_and_corrects_the_mismatch(tmp_path):
    out = tmp_path / "v"
    assert main(["train", "--config", TINY, "rollout_engine=vllm", "steps=2", "precision=fp32", "eval_size=4",
                 "reward=partial", f"out_dir={out}"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert r["weight_sync_s"] > 0 and r["weight_sync_bytes"] > 0 and r["generate_s"] > 0
        assert r["loss"] == r["loss"]
        # fp32 on both sides: the engines differ by kernels alone
        assert r["mismatch/abs_diff_max"] < 1e-3 and r["mismatch/ratio_out_of_range_frac"] == 0
        assert abs(r["rollout_corr/rollout_is_mean"] - 1) < 1e-3
    assert not (out / ".vllm_model").exists()     # the exported weights are removed at the end
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["rollout_engine"] == "vllm"


def test_train_with_tools_on_vllm(tmp_path):
    """Multi-turn episodes on vLLM (hetrl.trainer.episodes._run_vllm; its rounds against the local loop's:
    tests/trainer/test_episodes.py): the run trains with the tool metrics logged and the mismatch measured on the
    model's tokens, and greedy evaluation's replies equal the hf engine's (fp32)."""
    calc = ROOT / "examples" / "tools" / "calculator.py"
    runs = {}
    for engine in ("vllm", "hf"):
        runs[engine] = tmp_path / engine
        assert main(["train", "--config", TINY, f"rollout_engine={engine}", f"tools={calc}:multiply", "steps=1",
                     "precision=fp32", "eval_size=4", "reward=partial", f"out_dir={runs[engine]}"]) == 0
    (row,) = [json.loads(line) for line in (runs["vllm"] / "metrics.jsonl").read_text().splitlines()]
    assert {"turns_mean", "tool_calls", "tokens_model", "tokens_tool", "tool_s", "generate_s"} <= set(row)
    assert row["mismatch/abs_diff_max"] < 1e-3 and row["loss"] == row["loss"]
    replies = {e: [json.loads(line)["reply"] for line in (runs[e] / "eval_step_0.jsonl").read_text().splitlines()]
               for e in runs}
    assert replies["vllm"] == replies["hf"]


@pytest.mark.parametrize("tools", [[], [f"tools={ROOT / 'examples' / 'tools' / 'calculator.py'}:multiply"]],
                         ids=["single-turn", "tools"])
def test_diagnose_mismatch_with_vllm(tmp_path, tools):
    out = tmp_path / "d"
    assert main(["diagnose", "mismatch", "--config", TINY, "--out", str(out), "rollout_engine=vllm",
                 "precision=fp32", "--prompts", "2", *tools]) == 0
    report = json.loads((out / "mismatch.json").read_text())
    engine = report["vs_fp64"]["rollout engine (vllm, float32)"]
    assert engine["abs_diff_max"] < 1e-4 and report["engine_vs_trainer"]["abs_diff_max"] < 1e-4


def test_train_with_vllm_in_ray_rollout_actors(tmp_path):
    """executor=ray: each rollout actor samples with its own vLLM engine, loads every weight version into it, and
    the driver measures and corrects the mismatch as the local loop does."""
    out = tmp_path / "r"
    assert main(["train", "--config", TINY, "rollout_engine=vllm", "executor=ray",
                 f"emulate_cluster={ROOT / 'examples' / 'clusters' / 'cpu-2x2.yaml'}", "steps=2", "precision=fp32",
                 "eval_size=4", f"out_dir={out}"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert r["mismatch/abs_diff_max"] < 1e-3 and "rollout_corr/rollout_is_mean" in r and r["loss"] == r["loss"]
    placed = json.loads((out / "placement.json").read_text())["actors"]
    assert any(a["role"] == "rollout" for a in placed)
    assert not list((out / ".vllm_model").glob("*/*.safetensors"))    # each actor removed its exported weights


def test_tools_on_vllm_in_ray_rollout_actors(tmp_path):
    """executor=ray with tools: each rollout actor runs its episodes' turns on its own vLLM engine and their tools
    itself; the driver measures the mismatch on the model's tokens."""
    out = tmp_path / "rt"
    assert main(["train", "--config", TINY, "rollout_engine=vllm", "executor=ray",
                 f"tools={ROOT / 'examples' / 'tools' / 'calculator.py'}:multiply",
                 f"emulate_cluster={ROOT / 'examples' / 'clusters' / 'cpu-2x2.yaml'}", "steps=1", "precision=fp32",
                 "eval_size=4", "reward=partial", f"out_dir={out}"]) == 0
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "turns_mean" in row and "tool_calls" in row and row["mismatch/abs_diff_max"] < 1e-3


def test_a_lora_policy_syncs_its_merged_weights(tmp_path):
    """LoRA: vLLM gets W + the adapter's delta (Policy.merged_weights), at start-up and at every sync; its log-probs
    then equal the peft model's (adapter on), and the trained base weights are left bit-identical."""
    from hetrl.trainer import build
    from hetrl.trainer.config import load_config

    cfg = load_config(TINY, ["lora_rank=4", f"out_dir={tmp_path}", "precision=fp32"])
    tokenizer = tiny_tokenizer()
    policy = build.policy(cfg, tiny_model(tokenizer, seed=4))
    base = {k: v.clone() for k, v in policy.module.state_dict().items() if ".lora_" not in k}
    worker = build.vllm_worker(cfg, policy, tokenizer, FP32)
    try:
        with torch.no_grad():
            for name, p in policy.module.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)      # a trained adapter (peft starts B at 0: no delta to see)
        worker.load_weights(policy.merged_weights())
        prompts = _prompts(tokenizer)
        torch.manual_seed(2)
        groups = worker.generate(prompts, 2, 8, temperature=1.0, logprobs=True)
        want = _trainer_logprobs(policy.module.eval(), prompts, groups, 1.0)
        worst = max((s.logprobs - w).abs().max().item() for s, w in zip([s for g in groups for s in g], want))
        assert worst < 1e-4, worst
        assert all(torch.equal(v, base[k]) for k, v in policy.module.state_dict().items() if k in base)
    finally:
        worker.close()

