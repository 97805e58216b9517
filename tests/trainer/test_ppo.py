"""algorithm=ppo on the local executor: a critic trained beside the policy, its checkpoint, exact resume, refusals."""

import json
import math
import pathlib

import pytest
import torch

from hetrl.cli import main
from hetrl.trainer.config import load_config
from hetrl.trainer.metrics import TIMING_KEYS

from .test_train import TINY, _rows, _weights


def _critic(run_dir, step):
    path = pathlib.Path(run_dir) / "checkpoints" / f"step_{step:06d}" / "critic.pt"
    return torch.load(path, weights_only=True)


def test_tiny_ppo_run_trains_policy_and_critic(tmp_path):
    out = tmp_path / "ppo"
    assert main(["train", "--config", TINY, "algorithm=ppo", "critic_lr=1e-3", f"out_dir={out}"]) == 0
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert math.isfinite(r["value_loss"]) and r["value_loss"] >= 0 and r["policy_updated"] is True
        assert r["explained_variance"] is None or math.isfinite(r["explained_variance"])
    json.loads((out / "metrics.jsonl").read_text().splitlines()[0])      # strict JSON: no NaN
    state = _critic(out, 3)
    assert set(state) == {"model", "head", "optimizer"}
    head = state["head"]
    assert head["weight"].shape == (1, 64)
    if any(r["value_loss"] > 0 for r in rows):   # a non-zero return reached the critic: its head moved off zero
        assert head["weight"].abs().sum() > 0 or head["bias"].abs().sum() > 0


def test_ppo_resume_reproduces_the_next_step_exactly(tmp_path):
    args = ["algorithm=ppo", "critic_lr=1e-3", "responses_per_prompt=1", "prompts_per_step=6"]
    straight, resumed = tmp_path / "a", tmp_path / "b"
    assert main(["train", "--config", TINY, *args, "steps=2", f"out_dir={straight}"]) == 0
    assert main(["train", "--config", TINY, *args, "steps=1", f"out_dir={resumed}"]) == 0
    assert main(["train", "--config", TINY, *args, "steps=2", f"out_dir={resumed}", "--resume"]) == 0
    a, b = _weights(straight, 2), _weights(resumed, 2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    ca, cb = _critic(straight, 2), _critic(resumed, 2)
    for part in ("model", "head"):
        assert all(torch.equal(ca[part][k], cb[part][k]) for k in ca[part])
    timing = TIMING_KEYS
    same = [{k: v for k, v in r.items() if k not in timing} for r in (_rows(straight)[1], _rows(resumed)[1])]
    assert same[0] == same[1]


def test_critic_warmup_leaves_the_policy_alone(tmp_path, caplog):
    out = tmp_path / "w"
    with caplog.at_level("WARNING", logger="hetrl.trainer.run"):
        assert main(["train", "--config", TINY, "algorithm=ppo", "critic_warmup_steps=1", "steps=1",
                     f"out_dir={out}"]) == 0
    assert "critic_warmup_steps (1) covers all 1 steps of this run: only the critic is trained" in caplog.text
    assert _rows(out)[0]["policy_updated"] is False
    from hetrl.models import load_model

    initial, _ = load_model("tiny", seed=0)
    final = _weights(out, 1)
    assert all(torch.equal(p.detach(), final[n]) for n, p in initial.named_parameters())


def test_ppo_config_rules():
    base = ["task=basic_arithmetic"]
    assert load_config(None, [*base, "algorithm=ppo", "responses_per_prompt=1"]).responses_per_prompt == 1
    cfg = load_config(None, [*base, "algorithm=ppo"])
    assert (cfg.gamma, cfg.lam, cfg.vf_clip, cfg.loss_agg) == (1.0, 0.95, 0.2, "token-mean")
    with pytest.raises(ValueError, match="must be >= 2"):
        load_config(None, [*base, "responses_per_prompt=1"])
    assert load_config(None, [*base, "algorithm=ppo", "executor=ray",
                              "emulate_cluster=examples/clusters/cpu-2x2.yaml"]).algorithm == "ppo"
    with pytest.raises(ValueError, match="PPO's"):
        load_config(None, [*base, "critic_warmup_steps=2"])
    with pytest.raises(ValueError, match="lam"):
        load_config(None, [*base, "algorithm=ppo", "lam=1.5"])
