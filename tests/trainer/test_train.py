"""End-to-end tiny runs, exact resume, Ctrl-C, refusals, and the DualKV update against the standard one."""

import copy
import json
import math
import os
import pathlib
import signal

import pytest
import torch
from safetensors.torch import load_file

import hetrl
from hetrl.algo import token_weights
from hetrl.cli import main
from hetrl.models import load_model
from hetrl.trainer import loop
from hetrl.trainer.learner import Learner
from hetrl.trainer.metrics import TIMING_KEYS

from ..dualkv.oracle import _use_float64_norms

TINY = str(pathlib.Path(__file__).parents[2] / "examples" / "runs" / "tiny.yaml")


def _weights(run_dir, step):
    return load_file(pathlib.Path(run_dir) / "checkpoints" / f"step_{step:06d}" / "model.safetensors")


def _rows(run_dir, name="metrics.jsonl"):
    return [json.loads(line) for line in (pathlib.Path(run_dir) / name).read_text().splitlines()]


def _spread_reward(tmp_path) -> str:
    """reward=: beside the task's own check, one that differs within every group of a random model's replies
    (distinct characters): the task's reward alone often leaves a random tiny model's groups all 0, nothing to
    learn from."""
    (tmp_path / "spread.py").write_text("def distinct(completions, **kwargs):\n"
                                        "    return [len(set(c[-1]['content'])) / 8 for c in completions]\n")
    return f"reward=[partial, {tmp_path / 'spread.py'}:distinct]"


def test_tiny_run_learns_in_every_parameter_and_writes_its_files(tmp_path):
    out = tmp_path / "tiny"
    assert main(["train", "--config", TINY, f"out_dir={out}", _spread_reward(tmp_path)]) == 0
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert all(r["grad_norm"] > 0.01 for r in rows)
    assert all(r["rho"] > 1 for r in rows)  # the update ran on packed groups
    initial, _ = load_model("tiny", seed=0)
    final = _weights(out, 3)
    unchanged = [n for n, p in initial.named_parameters() if torch.equal(p.detach(), final[n])]
    assert not unchanged, f"parameters that did not move: {unchanged}"
    evals = _rows(out, "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 3]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_problems"] == 100 and 0 <= summary["sign_test_p"] <= 1
    assert (out / "curves.png").stat().st_size > 0
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000003"


def test_eval_size_0_trains_without_a_held_out_evaluation_and_resumes(tmp_path, capsys):
    """eval_size=0 (a smoke run): no greedy evaluation before, between or after training, for a task and for the
    user's rows; the summary says why nothing is paired; a resume continues without one too."""
    out = tmp_path / "no_eval"
    assert main(["train", "--config", TINY, "eval_size=0", "steps=1", f"out_dir={out}"]) == 0
    assert main(["train", "--config", TINY, "eval_size=0", "steps=2", f"out_dir={out}", "--resume"]) == 0
    said = capsys.readouterr()
    text = said.out + said.err
    assert "before training" not in text and not (out / "eval_step_0.jsonl").exists()
    assert f"trained 2 steps; no held-out evaluation (eval_size=0); results in {out}" in text
    assert _rows(out, "eval.jsonl") == [] and [r["step"] for r in _rows(out)] == [1, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_problems"] == 0 and summary["gained"] is None and summary["steps"] == 2
    assert summary["not_paired"] == "eval_size=0: no held-out evaluation"
    assert not any(k.startswith("eval_accuracy") for k in summary) and (out / "curves.png").stat().st_size > 0

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "answer": str(i + 1)}) + "\n" for i in range(6)))
    data_out = tmp_path / "rows_no_eval"
    assert main(["train", "--config", TINY, f"data={rows}", "reward=exact_match", "eval_size=0", "steps=1",
                 f"out_dir={data_out}"]) == 0
    assert "6 training rows" in json.loads((data_out / "summary.json").read_text())["data"]

    for also in ("eval_every=1", f"eval_data={rows}"):
        assert main(["train", "--config", TINY, f"data={rows}", "eval_size=0", also, f"out_dir={tmp_path / 'x'}"]) \
            == 2
        assert f"{also} has no effect in this run: eval_size=0 runs no held-out evaluation" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^eval_dataset \(from Python\) has no effect in this run: eval_size=0"):
        hetrl.train(TINY, train_dataset=[{"prompt": "1+1=", "answer": "2"}] * 8, eval_size=0,
                    eval_dataset=[{"prompt": "1+2=", "answer": "3"}], reward_funcs="exact_match")


def test_dapo_tiny_run(tmp_path):
    out = tmp_path / "dapo"
    assert main(["train", "--config", TINY, "algorithm=dapo", "kl_coef=0", f"out_dir={out}"]) == 0
    rows = _rows(out)
    assert len(rows) == 3 and all(r["groups_sampled"] >= r["groups_kept"] for r in rows)


def test_resume_reproduces_the_next_step_exactly(tmp_path):
    straight, resumed = tmp_path / "a", tmp_path / "b"
    assert main(["train", "--config", TINY, "steps=2", f"out_dir={straight}"]) == 0
    assert main(["train", "--config", TINY, "steps=1", f"out_dir={resumed}"]) == 0
    assert main(["train", "--config", TINY, "steps=2", f"out_dir={resumed}", "--resume"]) == 0
    a, b = _weights(straight, 2), _weights(resumed, 2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    timing = TIMING_KEYS
    same = [{k: v for k, v in r.items() if k not in timing} for r in (_rows(straight)[1], _rows(resumed)[1])]
    assert same[0] == same[1]
    assert [r["step"] for r in _rows(resumed)] == [1, 2]


def test_ctrl_c_finishes_the_step_saves_and_resumes(tmp_path, monkeypatch):
    out = tmp_path / "int"
    real = loop.collect_rollouts
    calls = []

    def interrupting(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "collect_rollouts", interrupting)
    assert main(["train", "--config", TINY, f"out_dir={out}"]) == 130
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert [r["step"] for r in _rows(out)] == [1, 2]
    monkeypatch.setattr(loop, "collect_rollouts", real)
    assert main(["train", "--config", TINY, f"out_dir={out}", "--resume"]) == 0
    assert [r["step"] for r in _rows(out)] == [1, 2, 3]


def test_refusals_say_what_to_do(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["train", "--config", TINY, "steps=1", f"out_dir={out}"]) == 0
    assert main(["train", "--config", TINY, "steps=1", f"out_dir={out}"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert main(["train", "--config", TINY, f"out_dir={tmp_path / 'none'}", "--resume"]) == 2
    assert "does not exist, so there is no run to resume" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["train", "--config", TINY, f"out_dir={tmp_path / 'empty'}", "--resume"]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert main(["train", "--config", TINY, "memory_limit_gib=0.001", f"out_dir={tmp_path / 'm'}"]) == 2
    assert "Lower micro_batch_tokens" in capsys.readouterr().err
    assert main(["train", "--config", TINY, "warmup=3"]) == 2
    assert "unknown config key(s) ['warmup']" in capsys.readouterr().err


def _fp64_batch(shape):
    """The tiny model in fp64 and random groups of `shape` [(prompt length, [response lengths])], with per-token
    advantages and seq-mean-token-mean loss weights."""
    model, _ = load_model("tiny", dtype=torch.float64, seed=1)
    _use_float64_norms(model)
    g = torch.Generator().manual_seed(0)
    groups = [(torch.randint(4, 100, (p,), generator=g).tolist(),
               [torch.randint(4, 100, (r,), generator=g).tolist() for r in rs]) for p, rs in shape]
    lens = torch.tensor([len(r) for _, rs in groups for r in rs])
    advantages = torch.repeat_interleave(torch.randn(lens.numel(), generator=g, dtype=torch.float64), lens)
    return model, groups, advantages, token_weights(lens, torch.ones_like(lens, dtype=torch.bool),
                                                    "seq-mean-token-mean")


def test_one_dualkv_update_equals_the_standard_update():
    model, groups, advantages, weights = _fp64_batch([(20, [5, 0, 9, 1]), (7, [12, 3])])
    results = {}
    for impl in ("sdpa", "reference"):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01)
        learner = Learner(m, opt, impl=impl, temperature=0.9, micro_batch_tokens=40, kl_coef=0.1)
        old = learner.logprobs(groups)
        ref = old - 0.05  # any fixed reference log-probs
        learner.update(groups, advantages, weights, old + 0.01, ref)
        results[impl] = dict(m.named_parameters())
    for name, p in results["reference"].items():
        diff = (results["sdpa"][name] - p).abs().max().item()
        assert diff <= 1e-8 * p.abs().max().item(), f"{name}: {diff:.3e}"
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, results["sdpa"][n])]
    assert len(moved) == len(list(model.parameters()))


def test_an_on_policy_update_needs_no_old_log_prob_pass():
    """Sync mode's first mini-batch: the old log-probs are the update forward's own, detached. The step equals the
    step against old log-probs from a separate pass (fp64), and update_policy runs the old pass only on the groups
    of the later mini-batches."""
    from hetrl.data import Example
    from hetrl.trainer.config import load_config
    from hetrl.trainer.loop import Rollout, update_policy
    from hetrl.trainer.rollout import Sample

    model, groups, advantages, weights = _fp64_batch([(20, [5, 9]), (7, [12, 3]), (9, [4, 6])])
    results = {}
    for how in ("separate pass", "on-policy"):
        m = copy.deepcopy(model)
        learner = Learner(m, torch.optim.AdamW(m.parameters(), lr=1e-2), impl="reference", micro_batch_tokens=40,
                          kl_coef=0.1)
        old = learner.logprobs(groups)
        stats = learner.update(groups, advantages, weights, old if how == "separate pass" else None, old - 0.05)
        results[how] = (dict(m.named_parameters()), stats)
    for name, p in results["separate pass"][0].items():
        diff = (results["on-policy"][0][name] - p).abs().max().item()
        assert diff <= 1e-10 * p.abs().max().item(), f"{name}: {diff:.3e}"
    assert results["on-policy"][1].loss == pytest.approx(results["separate pass"][1].loss, rel=1e-10, abs=1e-12)

    class Counting(Learner):
        def logprobs(self, gs):
            asked.append([len(rs) for _, rs in gs])
            return super().logprobs(gs)

    kept = [Rollout(Example({"prompt": "p"}, p), [Sample(r, "", False) for r in rs], [1.0] * len(rs))
            for p, rs in groups]
    # 3 groups in mini-batches [0 1 2] | [0 1] [2] | [0] [1] [2]: the old pass covers the groups after the first part
    for mini_batches, want in ((1, []), (2, [[2]]), (3, [[2, 2]])):
        asked = []
        cfg = load_config(TINY, [f"mini_batches={mini_batches}", "kl_coef=0"])
        learner = Counting(copy.deepcopy(model), torch.optim.AdamW(model.parameters(), lr=0.0), impl="reference")
        update_policy(cfg, learner, kept, None)
        assert asked == want


def test_a_local_hugging_face_directory_trains(tmp_path):
    model, tokenizer = load_model("tiny", seed=3)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    out = tmp_path / "run"
    assert main(["train", "--config", TINY, f"model={tmp_path / 'model'}", "steps=1", f"out_dir={out}"]) == 0
    assert len(_rows(out)) == 1
    assert main(["train", "--config", TINY, f"model={tmp_path / 'nothing'}", f"out_dir={tmp_path / 'x'}"]) == 2


def test_gradient_checkpointing_gives_the_same_run(tmp_path):
    """The recompute goes through the same DualKV attention: every logged number of the run is unchanged."""
    plain, checkpointed = tmp_path / "plain", tmp_path / "ckpt"
    assert main(["train", "--config", TINY, f"out_dir={plain}", "eval_size=8"]) == 0
    assert main(["train", "--config", TINY, f"out_dir={checkpointed}", "eval_size=8",
                 "gradient_checkpointing=true"]) == 0
    timing = TIMING_KEYS
    a, b = ([{k: v for k, v in r.items() if k not in timing} for r in _rows(d)] for d in (plain, checkpointed))
    assert a == b
    w_plain, w_ckpt = _weights(plain, 3), _weights(checkpointed, 3)
    assert w_plain.keys() == w_ckpt.keys() and all(torch.equal(w_plain[k], w_ckpt[k]) for k in w_plain)


def test_the_optimizer_is_adamw_fused_where_it_can_be():
    """build.adamw: torch's fused AdamW kernel for plain tensors (TRL's adamw_torch_fused), the same update as the
    foreach kernel to fp64 rounding; foreach for what the fused kernel does not take."""
    from hetrl.trainer.build import adamw

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
    twin = copy.deepcopy(model)
    fused = adamw(list(model.parameters()), lr=1e-2, weight_decay=0.01)
    assert fused.param_groups[0]["fused"] is True
    plain = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.01, foreach=True)
    for step in range(5):
        x = torch.randn(4, 8, dtype=torch.float64)
        for m, opt in ((model, fused), (twin, plain)):
            opt.zero_grad()
            m(x).square().sum().backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)
    assert not adamw([torch.nn.Parameter(torch.zeros(2, device="meta"))], 1e-3, 0.0).param_groups[0]["fused"]


def test_adamw_states_made_up_front_are_torchs_own():
    """build.adamw makes the fused AdamW's states before the first step (where the update's activations would
    otherwise be in the heap): the same keys, dtypes, devices and shapes as torch's own first step makes, and the
    same parameters, bit for bit, after steps that leave one parameter without a gradient."""
    from hetrl.trainer.build import adamw

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3),
                                torch.nn.Linear(3, 3))   # the last layer is never used: its gradient stays None
    twin = copy.deepcopy(model)
    made = adamw(list(model.parameters()), lr=1e-2, weight_decay=0.01)
    assert len(made.state) == len(list(model.parameters()))
    lazy = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    assert not lazy.state
    for _ in range(3):
        x = torch.randn(4, 8)
        for m, opt in ((model, made), (twin, lazy)):
            opt.zero_grad(set_to_none=True)
            m[:3](x).square().sum().backward()
            opt.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        if q in lazy.state:
            ours, theirs = made.state[p], lazy.state[q]
            assert ours.keys() == theirs.keys()
            for k in theirs:
                assert (ours[k].dtype, ours[k].device, ours[k].shape) == (theirs[k].dtype, theirs[k].device,
                                                                          theirs[k].shape)
                assert torch.equal(ours[k], theirs[k]), k
        else:
            assert int(made.state[p]["step"]) == 0 and not made.state[p]["exp_avg"].any()


def test_old_logprobs_from_the_rollout_give_the_recomputed_run(tmp_path, monkeypatch):
    """old_logprobs=rollout (auto on an fp32/fp64 local run) takes the later mini-batches' old log-probs from the
    rollout's own logits: no learner pass, and the same run as recomputing them (fp64, to 1e-9)."""
    calls = []
    original = Learner.logprobs
    monkeypatch.setattr(Learner, "logprobs", lambda self, gs: calls.append(len(gs)) or original(self, gs))
    runs = {}
    for how in ("rollout", "recompute"):
        out = tmp_path / how
        calls.clear()
        assert main(["train", "--config", TINY, f"out_dir={out}", "eval_size=8", "dtype=float64",
                     f"old_logprobs={how}", _spread_reward(tmp_path)]) == 0
        runs[how] = (_rows(out), _weights(out, 3), list(calls))
    (a, wa, calls_a), (b, wb, calls_b) = runs["rollout"], runs["recompute"]
    assert calls_a == [] and calls_b == [2, 2, 2]       # 4 groups in 2 mini-batches: the second's 2, each step
    assert all(r["grad_norm"] > 0.01 for r in a)       # the ratio against the old log-probs mattered
    for ra, rb in zip(a, b):
        for k, v in ra.items():
            if k not in TIMING_KEYS and isinstance(v, float):
                assert v == pytest.approx(rb[k], rel=1e-8, abs=1e-10), k
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=0, atol=1e-9), k
    assert main(["train", "--config", TINY, "old_logprobs=rollout", "executor=ray",
                 "emulate_cluster=examples/clusters/cpu-2x2.yaml", f"out_dir={tmp_path / 'x'}"]) == 2


def test_the_kl_in_the_reward_costs_one_old_log_prob_pass():
    """use_kl_in_reward with recomputed old log-probs: one no-grad pass over every group gives both the KL's
    behaviour log-probs and the later mini-batches' old log-probs (it was two: the later groups, then all)."""
    from hetrl.data import Example
    from hetrl.trainer.config import load_config
    from hetrl.trainer.loop import Rollout, update_policy
    from hetrl.trainer.rollout import Sample

    model, groups, _, _ = _fp64_batch([(20, [5, 9]), (7, [12, 3]), (9, [4, 6])])
    asked = []

    class Counting(Learner):
        def logprobs(self, gs):
            asked.append([len(rs) for _, rs in gs])
            return super().logprobs(gs)

    class Reference:
        def logprobs(self, gs):
            return torch.zeros(sum(len(r) for _, rs in gs for r in rs), dtype=torch.float64)

    kept = [Rollout(Example({"prompt": "p"}, p), [Sample(r, "", False) for r in rs], [1.0, 0.0]) for p, rs in groups]
    cfg = load_config(TINY, ["mini_batches=2", "use_kl_in_reward=true", "kl_coef=0.01"])
    learner = Counting(copy.deepcopy(model), torch.optim.AdamW(model.parameters(), lr=0.0), impl="reference")
    row = update_policy(cfg, learner, kept, Reference(), kl_ctrl=loop.KLController(0.01, "fixed", 0.1, 10000))
    assert asked == [[2, 2, 2]] and "reward_kl_penalty" in row
