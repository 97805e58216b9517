"""The rollout engine decided once (rollout_engine: auto | hf | vllm) and the loop's rollout correction, without
vLLM: what is refused in one line, and update_policy with another engine's log-probs (here: hetrl's own, shifted)
taking the trainer's log-probs as old ones, measuring the mismatch and applying verl's correction
(tests/trainer/test_vllm.py runs the real engine)."""

from __future__ import annotations

import copy
import json
import pathlib

import pytest
import torch

from hetrl.algo import rollout_correction, to_padded
from hetrl.cli import main
from hetrl.data import Example
from hetrl.trainer import vllm_engine
from hetrl.trainer.config import load_config
from hetrl.trainer.learner import Learner
from hetrl.trainer.loop import Rollout, update_policy
from hetrl.trainer.rollout import Sample

from .test_train import _fp64_batch

ROOT = pathlib.Path(__file__).parents[2]
TINY = str(ROOT / "examples" / "runs" / "tiny.yaml")


def test_without_vllm_rollout_engine_vllm_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(vllm_engine, "installed", lambda: False)
    assert main(["train", "--config", TINY, "rollout_engine=vllm", f"out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bash scripts/install.sh --vllm" in err and "rollout_engine=hf" in err


def test_auto_takes_vllm_only_on_cuda_where_it_is_installed(monkeypatch):
    cfg = load_config(TINY, [])
    for has in (True, False):
        monkeypatch.setattr(vllm_engine, "installed", lambda: has)
        assert vllm_engine.choose(cfg, torch.device("cpu")) == "hf"
        assert vllm_engine.choose(cfg, torch.device("cuda")) == ("vllm" if has else "hf")
        assert vllm_engine.choose(load_config(TINY, ["rollout_engine=hf"]), torch.device("cuda")) == "hf"


def test_what_vllm_does_not_run_is_refused_in_one_line(monkeypatch):
    """float64 on vLLM: refused by the config (so `hetrl validate` says it too; it said ok and train refused), and
    not what auto picks."""
    tools = f"tools={ROOT / 'examples' / 'tools' / 'calculator.py'}:multiply"
    load_config(TINY, ["rollout_engine=vllm", tools])   # multi-turn runs on vLLM
    with pytest.raises(ValueError, match="float64") as e:
        load_config(TINY, ["rollout_engine=vllm", "dtype=float64"])
    assert "\n" not in str(e.value) and "dtype=float32" in str(e.value)
    monkeypatch.setattr(vllm_engine, "installed", lambda: True)
    assert vllm_engine.choose(load_config(TINY, ["dtype=float64"]), torch.device("cuda")) == "hf"


def test_the_log_says_the_engine_and_its_correction():
    said = vllm_engine.describe(load_config(TINY, ["rollout_engine=vllm"]), "vllm")
    assert "token-level importance weights truncated at 2 (TIS)" in said and "(the default)" in said
    said = vllm_engine.describe(load_config(TINY, ["rollout_is=sequence", "rollout_is_threshold=0.5_2.0",
                                                   "rollout_rs=token_k1", "rollout_rs_threshold=1.5"]), "vllm")
    assert "sequence-level importance weights masked outside 0.5_2.0 (IcePop)" in said and "token_k1" in said
    assert "bypass_mode" in vllm_engine.describe(load_config(TINY, ["bypass_mode=true"]), "vllm")


def test_bad_correction_knobs_are_refused_up_front():
    for overrides, says in ((["rollout_is=tok"], "did you mean 'token'"),
                            (["rollout_is_threshold=abc"], "rollout_is_threshold"),
                            (["rollout_rs=token_k9", "rollout_rs_threshold=2"], "token_k9"),
                            (["bypass_mode=true", "old_logprobs=recompute"], "bypass_mode"),
                            # the rollout's log-probs as the old ones leave nothing to correct (it was ignored)
                            (["bypass_mode=true", "rollout_is=sequence"], r"rollout_is=sequence would do nothing"),
                            (["old_logprobs=rollout", "rollout_rs=token_k1", "rollout_rs_threshold=2"],
                             r"old_logprobs=rollout .* rollout_rs=token_k1 would do nothing")):
        with pytest.raises(ValueError, match=says):
            load_config(TINY, overrides)
    assert load_config(TINY, ["bypass_mode=true"]).old_logprobs == "rollout"
    assert load_config(TINY, ["vllm_importance_sampling_cap=3"]).rollout_is_threshold == 3.0   # TRL's name


def _counting_learner(model, asked):
    class Counting(Learner):
        def logprobs(self, gs):
            asked.append(len(gs))
            return super().logprobs(gs)

        def update(self, *args, is_weights=None, **kw):
            seen.append(is_weights)
            return super().update(*args, is_weights=is_weights, **kw)

    seen = []
    learner = Counting(model, torch.optim.AdamW(model.parameters(), lr=0.0), impl="reference")
    return learner, seen


def test_another_engines_logprobs_are_measured_and_corrected_never_taken_as_old():
    """Samples whose log-probs are the trainer's shifted by +0.3 or -0.1 per token (as another engine's would differ):
    update_policy recomputes the trainer's old log-probs of every token in one pass, reports the shift as the
    mismatch, and hands each mini-batch the importance weights rollout_correction gives (truncated at 1.05), with
    the tokens rejection drops out of the loss weights."""
    model, groups, _, _ = _fp64_batch([(9, [5, 7]), (6, [4, 8]), (8, [6, 3])])
    trainer = Learner(copy.deepcopy(model), torch.optim.AdamW(model.parameters(), lr=0.0), impl="reference")
    exact = trainer.logprobs(groups)
    shift = torch.where(torch.arange(exact.numel()) % 2 == 0, 0.3, -0.1).double()
    engine = exact + shift
    lens = torch.tensor([len(r) for _, rs in groups for r in rs])
    per_sample = engine.split(lens.tolist())
    it = iter(per_sample)
    kept = [Rollout(Example({"prompt": "p"}, p), [Sample(r, "", False, logprobs=next(it)) for r in rs], [1.0, 0.0])
            for p, rs in groups]
    cfg = load_config(TINY, ["mini_batches=2", "kl_coef=0", "rollout_is=token", "rollout_is_threshold=1.05",
                             "rollout_rs=token_k1", "rollout_rs_threshold=1.3"])
    options = cfg.rollout_correction_options()
    asked = []
    learner, seen = _counting_learner(copy.deepcopy(model), asked)
    row = update_policy(cfg, learner, kept, None, correction=options)
    assert asked == [3]                            # one pass over every group, for the mismatch and the old log-probs
    assert row["mismatch/abs_diff_mean"] == pytest.approx(float(shift.abs().mean()), abs=1e-9)
    assert row["mismatch/ratio_out_of_range_frac"] == 0
    want_w, want_mask, _ = rollout_correction(to_padded(exact, lens), to_padded(engine, lens),
                                              to_padded(torch.ones(exact.numel()).double(), lens), **options)
    assert 0 < row["rollout_corr/rollout_is_ratio_fraction_high"] < 1
    got = torch.cat([w for w in seen])
    assert torch.allclose(got.double(), (want_w[to_padded(torch.ones(exact.numel()), lens) > 0]), atol=1e-6)
    assert 0 < float(want_mask.sum()) < exact.numel()     # rejection dropped some tokens, kept others
    # without a correction the same samples' log-probs would be taken as old (the hf engine's rule)
    asked.clear()
    learner, seen = _counting_learner(copy.deepcopy(model), asked)
    row = update_policy(load_config(TINY, ["mini_batches=2", "kl_coef=0", "old_logprobs=rollout"]), learner, kept,
                        None)
    assert asked == [] and all(w is None for w in seen) and not any(k.startswith("mismatch/") for k in row)


def test_diagnose_mismatch_scores_one_batch_three_ways(tmp_path, capsys):
    """`hetrl diagnose mismatch` on the tiny config (hf engine, fp32): both sides within fp32 rounding of the fp64
    forward, the table, JSON and PNG written (by default in the run's out_dir/diagnose_mismatch: it went to
    runs/diagnose_mismatch under the current directory whatever out_dir said); the bf16-mixed run adds the trainer in
    fp32 and is farther off."""
    out = tmp_path / "run" / "diagnose_mismatch"
    assert main(["diagnose", "mismatch", "--config", TINY, f"out_dir={tmp_path / 'run'}", "precision=fp32"]) == 0
    said = capsys.readouterr().out
    assert "verdict:" in said and f"wrote {out}/mismatch.md, .json and .png" in said
    report = json.loads((out / "mismatch.json").read_text())
    assert set(report["vs_fp64"]) == {"rollout engine (hf, fp32)", "trainer (fp32)"}
    assert all(m["abs_diff_max"] < 1e-5 for m in report["vs_fp64"].values())
    assert (out / "mismatch.png").stat().st_size > 0 and "| side |" in (out / "mismatch.md").read_text()
    assert main(["diagnose", "mismatch", "--config", TINY, "--out", str(out), "precision=bf16-mixed",
                 "--prompts", "2"]) == 0
    mixed = json.loads((out / "mismatch.json").read_text())["vs_fp64"]
    assert mixed["trainer (bf16-mixed)"]["abs_diff_mean"] > 10 * mixed["trainer (fp32)"]["abs_diff_mean"]


def test_diagnose_mismatch_scores_a_tool_runs_model_tokens_only(tmp_path, monkeypatch):
    """With tools, the batch is the run's multi-turn episodes: a tiny model scripted (by position, a forward hook,
    so the fp64 copy carries it) to call multiply, read its result and answer. Both sides within fp32 rounding
    of the fp64 forward on the model's tokens; the tool result's tokens (log-prob 0 on the engine's side) are
    counted apart and not scored, which a score over every token would show as an |dlogp| of several nats."""
    from hetrl.data.tools import tool_suffix_ids
    from hetrl.trainer import diagnose, episodes, run

    calc = f"tools={ROOT / 'examples' / 'tools' / 'calculator.py'}:multiply"
    cfg = load_config(TINY, [calc, "precision=fp32"])
    model, tok = run.load_policy(cfg, torch.device("cpu"))
    agent = episodes.agent_from_config(cfg, tok, *episodes.resolve_tools(cfg, None, None))
    (example,), _, _ = run.build_source(cfg, agent.render_tokenizer(tok)).train_examples(0, 1)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]   # noqa: E731
    turn1 = enc('<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>') + [tok.eos_token_id]
    result = tool_suffix_ids(tok, [{"role": "tool", "name": "multiply", "content": "42"}], agent.template)
    turn2 = enc("42") + [tok.eos_token_id]
    P, Q = len(example.prompt_ids), len(example.prompt_ids) + len(turn1) + len(result)
    script = {P + i: t for i, t in enumerate(turn1)} | {Q + i: t for i, t in enumerate(turn2)}
    table = torch.zeros(max(script) + 1, model.config.vocab_size)
    for q, t in script.items():
        table[q - 1, t] = 30.0

    def follow_script(module, args, kwargs, out):
        pos, keep = kwargs["position_ids"], kwargs.get("logits_to_keep", 0)
        kept = pos[:, keep] if isinstance(keep, torch.Tensor) else pos[:, -keep:] if keep else pos
        bias = table.to(out.logits.dtype)[kept.clamp(max=len(table) - 1)] * (kept < len(table))[..., None]
        out.logits = out.logits + bias
        return out

    model.register_forward_hook(follow_script, with_kwargs=True)
    monkeypatch.setattr(run, "load_policy", lambda cfg, device: (model, tok))
    budget = len(turn1) + len(result) + len(turn2) + 2
    report = diagnose.mismatch(TINY, [calc, "precision=fp32", f"max_new_tokens={budget}"], out=tmp_path / "d",
                               prompts=1)
    n = cfg.responses_per_prompt
    assert report["tokens"] == n * (len(turn1) + len(turn2)) and report["tool_tokens"] == n * len(result)
    assert set(report["vs_fp64"]) == {"rollout engine (hf, fp32)", "trainer (fp32)"}
    assert all(m["abs_diff_max"] < 1e-5 for m in report["vs_fp64"].values())
    assert f"tool results' {n * len(result)} tokens not scored" in (tmp_path / "d" / "mismatch.md").read_text()


def test_a_plan_with_actor_gen_tp_above_1_is_refused_on_cpus():
    from hetrl.trainer.placement import Replica
    from hetrl.trainer.ray_executor import check_vllm_tp

    reps = [Replica("rollout", 0, 1, ("c:0", "c:1"), (), True, tp=2)]
    with pytest.raises(ValueError, match="actor_gen tp 2"):
        check_vllm_tp(reps, ray_has_gpus=False)
    check_vllm_tp(reps, ray_has_gpus=True)


def test_top_k_1_samples_the_greedy_tokens():
    """top_k (a run-wide knob): with k = 1 only the most likely token can be drawn, so sampling is greedy decoding."""
    from hetrl.models import tiny_model, tiny_tokenizer
    from hetrl.trainer.rollout import RolloutWorker

    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer, seed=2).eval()
    prompts = [tokenizer(t)["input_ids"] for t in ("1+2=", "hello there", "9-4 is")]
    greedy = [g[0].tokens for g in RolloutWorker(model, tokenizer).generate(prompts, 1, 8, greedy=True)]
    torch.manual_seed(0)
    sampled = RolloutWorker(model, tokenizer, top_k=1).generate(prompts, 3, 8, temperature=1.3)
    assert all(s.tokens == want for g, want in zip(sampled, greedy) for s in g)
    assert load_config(TINY, ["top_k=5"]).top_k == 5
    with pytest.raises(ValueError, match="top_k"):
        load_config(TINY, ["top_k=-1"])
