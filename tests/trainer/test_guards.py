"""A run never trains on, saves or logs a non-finite number (hetrl/trainer/guards.py): a reward that turns huge
(±1e308, finite but overflowing the group's spread) stops the run with one line naming the quantity and the
rows, and the last good checkpoint is left as it was; nonfinite=skip drops the poisoned step instead; a
non-finite gradient never reaches the optimizer; metrics.jsonl is strict JSON."""

import json
import math
import pathlib

import pytest
import torch
from safetensors.torch import load_file

from hetrl.cli import main
from hetrl.trainer import guards
from hetrl.trainer.learner import Learner

ROOT = pathlib.Path(__file__).parents[2]
TINY = str(ROOT / "examples" / "runs" / "tiny.yaml")
DATA = [{"prompt": f"{i} + {i} =", "answer": str(2 * i)} for i in range(40)]
# in-process reward: call 1 is the held-out evaluation, call k + 1 step k; from step HUGE_FROM on, ±1e308
HUGE_REWARD = """
CALLS = [0]
def huge(completions, **kw):
    CALLS[0] += 1
    if CALLS[0] <= {good_calls}:
        return [float(len(c) % 3) for c in completions]
    return [1e308 if i % 4 else -1e308 for i in range(len(completions))]
"""
RUN = ["eval_size=4", "steps=3", "checkpoint_every=1", "prompts_per_step=2", "responses_per_prompt=4",
       "mini_batches=1"]


def _run(tmp_path, good_calls, *extra):
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in DATA))
    (tmp_path / "reward.py").write_text(HUGE_REWARD.format(good_calls=good_calls))
    out = tmp_path / "run"
    rc = main(["train", "--config", TINY, f"out_dir={out}", f"data={tmp_path / 'data.jsonl'}",
               f"reward={tmp_path / 'reward.py'}:huge", *RUN, *extra])
    return rc, out


def _error_lines(err: str) -> list[str]:
    """stderr without tqdm's progress bar."""
    return [s for s in err.replace("\r", "\n").splitlines() if s.strip() and not s.startswith("train:")]


def test_a_huge_reward_stops_the_run_and_the_last_good_checkpoint_is_intact(tmp_path, capsys):
    rc, out = _run(tmp_path, good_calls=2)        # evaluation + step 1 fine, step 2's rewards ±1e308
    err = _error_lines(capsys.readouterr().err)
    assert rc == 2
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert "step 2" in err[0] and "non-finite advantages for prompt 0" in err[0], err[0]
    saved = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert saved == ["step_000001"], saved
    weights = load_file(out / "checkpoints" / "step_000001" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    text = (out / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert [json.loads(line)["step"] for line in text.splitlines()] == [1]
    # the reward fixed, the run resumes from that checkpoint and finishes
    (tmp_path / "reward.py").write_text(HUGE_REWARD.format(good_calls=10**6))
    assert main(["train", "--resume", f"out_dir={out}"]) == 0, capsys.readouterr().err
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_nonfinite_skip_drops_the_poisoned_steps_and_finishes(tmp_path, capsys):
    rc, out = _run(tmp_path, 2, "nonfinite=skip")
    assert rc == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "skipped" not in rows[0] and "loss" in rows[0]
    for r in rows[1:]:
        assert "non-finite advantages" in r["skipped"][0] and "loss" not in r, r
    text = (out / "metrics.jsonl").read_text() + (out / "eval.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    a = load_file(out / "checkpoints" / "step_000001" / "model.safetensors")
    b = load_file(out / "checkpoints" / "step_000003" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)      # the skipped steps changed nothing


def test_a_nonfinite_gradient_never_reaches_the_weights():
    """Advantages finite in float64 (1e39) overflow in the fp32 loss: Learner.update reports the non-finite loss
    and gradient norm and leaves every weight as it was."""
    from hetrl.models import load_model

    model, _ = load_model("tiny", torch.float32, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    learner = Learner(model, torch.optim.AdamW(model.parameters(), lr=1e-2), impl="reference")
    groups = [([5, 6, 7], [[8, 9], [10, 11, 12]])]
    stats = learner.update(groups, torch.full((5,), 1e39, dtype=torch.float64), torch.full((5,), 0.2), None)
    assert not (math.isfinite(stats.loss) and math.isfinite(stats.grad_norm)), stats
    assert guards.check_update(4, "policy", 0, stats.loss, stats.grad_norm).startswith("step 4: policy mini-batch 0")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    stats = learner.update(groups, torch.full((5,), 1.0, dtype=torch.float64), torch.full((5,), 0.2), None)
    assert math.isfinite(stats.grad_norm) and guards.check_update(5, "policy", 0, stats.loss, stats.grad_norm) is None
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())   # a finite step is taken


@pytest.mark.parametrize("row, expected", [
    ({"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": -float("inf")}, "e": 2},
     {"a": None, "b": [1.0, None], "c": {"d": None}, "e": 2}),
])
def test_metrics_values_are_strict_json(row, expected):
    assert guards.finite_or_none(row) == expected
    assert guards.worst([1.0, float("nan")]) != guards.worst([1.0, float("nan")])   # NaN kept, whatever its place
    assert math.isinf(guards.worst([2.0, float("inf"), 1.0]))


def test_nonfinite_advantages_and_returns_name_their_prompts():
    values = torch.tensor([0.0, 1.0, float("nan"), 2.0, 3.0, float("inf")])
    why = guards.check_advantages(3, values, [2, 3, 1], "returns")
    assert why.startswith("step 3: 2 non-finite returns in prompt(s) 1, 2;"), why
    assert guards.check_advantages(3, torch.zeros(6), [2, 3, 1]) is None


def test_a_nan_gradient_norm_in_a_later_mini_batch_is_reported():
    """Python's max() drops a NaN that is not first: the step's gradient norm (policy and critic) is reduced
    with guards.worst, so nonfinite=skip's NaN in mini-batch 2 shows as NaN, not as mini-batch 1's number."""
    import math

    from hetrl.trainer.learner import UpdateStats
    from hetrl.trainer.loop import _update_stats

    stats = [UpdateStats(loss=1.0, policy_loss=1.0, kl=0.0, clip_frac=0.0, entropy=1.0, grad_norm=g,
                         packed_tokens=1, standard_tokens=1) for g in (0.5, float("nan"), 0.7)]
    assert math.isnan(_update_stats(stats, 0.0, 0.0)["grad_norm"])
    assert max(s.grad_norm for s in stats) == 0.7      # what the plain max reported


def test_scores_print_as_numbers_a_user_can_read():
    """The progress bar's reward and the held-out line: a reward of 1e30 printed 31 digits and a fraction."""
    from hetrl.trainer.evaluation import decimals, shown

    assert decimals(0.6412, 2) == "0.64" and decimals(2500.0, 2) == "2500.00" and decimals(1e30, 2) == "1e+30"
    assert decimals(-3.2e7, 3) == "-3.2e+07" and decimals(math.nan, 2) == "nan" and decimals(None, 2) == "none"
    assert shown({"eval_reward": 1e30}) == "1e+30" and shown({"eval_accuracy": 0.5, "eval_reward": 9.0}) == "0.500"
