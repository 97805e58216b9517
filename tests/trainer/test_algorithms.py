"""The algorithm knobs of a run (docs/algorithms.md): every preset and the registry's other estimators and losses
run a tiny step with a finite loss; verl's and TRL's names map onto the same fields; a name that does not exist
is one line listing the valid ones; the learning-rate schedule is transformers'; the KL in the reward."""

from __future__ import annotations

import json
import math
import pathlib
import re

import pytest
import torch
import yaml

from hetrl.cli import main
from hetrl.schema import InputError
from hetrl.trainer import build
from hetrl.trainer.config import ALGORITHMS, load_config

TINY = str(pathlib.Path(__file__).parents[2] / "examples" / "runs" / "tiny.yaml")
FAST = ["eval_size=4", "checkpoint_every=0", "prompts_per_step=2", "mini_batches=2"]


def _reward(tmp_path) -> str:
    """A reward that differs within every group of a random tiny model's replies (distinct characters)."""
    (tmp_path / "spread.py").write_text("def distinct(completions, **kwargs):\n"
                                        "    return [len(set(c[-1]['content'])) / 8 for c in completions]\n")
    return f"reward={tmp_path / 'spread.py'}:distinct"


def _run(tmp_path, *overrides) -> list[dict]:
    out = tmp_path / "run"
    assert main(["train", "--config", TINY, f"out_dir={out}", _reward(tmp_path), *FAST, *overrides]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_preset_runs_a_step_with_a_finite_loss(tmp_path, algorithm):
    rows = _run(tmp_path, f"algorithm={algorithm}", "steps=1", "overlong_filter=false")
    assert len(rows) == 1 and math.isfinite(rows[0]["loss"]) and rows[0]["grad_norm"] > 0


@pytest.mark.parametrize("overrides", [
    ("adv_estimator=rloo", "loss_mode=gspo", "steps=2"),          # the acceptance line
    ("adv_estimator=opo", "loss_mode=sapo"), ("adv_estimator=gpg", "loss_mode=gpg"),
    ("adv_estimator=reinforce_plus_plus_baseline", "loss_mode=geo_mean"), ("adv_estimator=grpo_passk",),
    ("loss_mode=clip_cov", "loss_options={clip_cov_ratio: 0.2, clip_cov_lb: -1.0}"),
    ("loss_mode=kl_cov", "loss_options={kl_cov_ratio: 0.2}"), ("clip_ratio_c=3.0", "loss_agg_mode=token-sum"),
    ("use_kl_in_reward=true", "kl_ctrl=adaptive", "kl_coef=0.05", "steps=2"),
    ("loss_type=dr_grpo", "scale_rewards=none", "beta=0.01", "lr_scheduler_type=cosine", "warmup_steps=1"),
    ("entropy_coeff=0.01", "kl_coef=0.01", "kl_loss_type=k3+"), ("adv_estimator=remax",),
])
def test_estimators_and_losses_run_in_the_trainer(tmp_path, overrides):
    """Also ReMax, whose baseline is one more (greedy) rollout per prompt, scored by the run's rewards."""
    rows = _run(tmp_path, *(overrides if any(o.startswith("steps=") for o in overrides) else (*overrides, "steps=1")))
    assert all(math.isfinite(r["loss"]) for r in rows)
    if "use_kl_in_reward=true" in overrides:
        assert rows[0]["reward_kl_penalty_coeff"] == 0.05 and rows[1]["reward_kl_penalty_coeff"] != 0.05
        assert rows[0]["kl"] == 0     # the KL is in the reward, not the loss


def test_verl_and_trl_names_map_onto_the_same_fields():
    cfg = load_config(TINY, ["loss_type=dr_grpo", "scale_rewards=none", "beta=0.01", "epsilon=0.1",
                             "epsilon_high=0.3"])
    assert (cfg.loss_mode, cfg.aggregation, cfg.scale_advantages, cfg.kl_coef, cfg.clip_low, cfg.clip_high) == (
        "vanilla", "seq-mean-token-sum-norm", False, 0.01, 0.1, 0.3)
    assert load_config(TINY, ["importance_sampling_level=sequence"]).loss_mode == "gspo"
    cispo = load_config(TINY, ["loss_type=cispo", "epsilon_high=5.0"])
    assert (cispo.loss_mode, cispo.clip_low, cispo.clip_high, cispo.aggregation) == ("cispo", 1.0, 4.0, "token-mean")
    verl = load_config(TINY, ["loss_agg_mode=token-mean", "clip_ratio_low=0.1", "clip_ratio_high=0.28",
                              "kl_loss_coef=0.02", "norm_adv_by_std_in_grpo=false", "kl_penalty=k2"])
    assert (verl.loss_agg, verl.clip_low, verl.clip_high, verl.kl_coef, verl.scale_advantages, verl.kl_loss_type) == (
        "token-mean", 0.1, 0.28, 0.02, False, "k2")
    assert load_config(TINY, ["sapo_temperature_neg=1.2", "loss_mode=sapo"]).loss_options == {"tau_neg": 1.2}


@pytest.mark.parametrize("overrides,message", [
    (["adv_estimator=ppo"], "adv_estimator must be one of"),
    (["loss_mode=dppo"], "loss_mode must be one of"),
    (["kl_loss_type=k4"], "kl_loss_type must be one of"),
    (["loss_type=luspo"], "loss_type=luspo has no counterpart here; valid: grpo, bnpo, dapo, dr_grpo, cispo, sapo"),
    (["scale_rewards=batch"], "valid: group, none, true, false"),
    (["adv_estimator=gae"], "gae needs the critic of algorithm=ppo"),
    (["loss_mode=sapo", "loss_agg=token-mean"], "loss_mode=sapo aggregates by seq-mean-token-mean"),
    (["loss_options={kl_cov_ratio: 0.1}"], "loss_mode 'vanilla' takes no option kl_cov_ratio; its options:"),
    (["loss_mode=gspo", "clip_ratio_c=3"], "clip_ratio_c (dual-clip) is loss_mode=vanilla's"),
    (["lr_scheduler_type=polynomial"], "lr_scheduler_type must be one of"),
    (["beta=0.1", "kl_coef=0.2"], "beta sets kl_coef to 0.1, but kl_coef is also given as 0.2"),
])
def test_unknown_names_are_one_line_with_the_valid_ones(overrides, message):
    with pytest.raises((InputError, ValueError), match=re.escape(message)) as e:
        load_config(TINY, overrides)
    assert "\n" not in str(e.value)


def test_the_learning_rate_follows_transformers_schedule():
    from transformers import get_cosine_schedule_with_warmup

    cfg = load_config(TINY, ["lr_scheduler_type=cosine", "warmup_ratio=0.25", "lr=0.5"])
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    ref = get_cosine_schedule_with_warmup(opt, 2, cfg.steps * cfg.mini_batches)
    lr_at = build.lr_schedule(cfg)
    for n in range(cfg.steps * cfg.mini_batches):
        assert lr_at(n) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12)
        opt.step()
        ref.step()
    assert build.lr_schedule(load_config(TINY)) is None   # constant, no warmup: the optimizer's own rate


def test_python_train_takes_trl_names(tmp_path, monkeypatch):
    """hetrl.train(..., loss_type=..., beta=...) over a YAML whose preset already filled the fields."""
    import hetrl
    from hetrl.trainer import run

    seen = {}
    monkeypatch.setattr(run, "train", lambda cfg, **kw: seen.setdefault("cfg", cfg))
    hetrl.train(TINY, loss_type="dr_grpo", beta=0.01, scale_rewards="none", out_dir=str(tmp_path))
    cfg = seen["cfg"]
    assert (cfg.aggregation, cfg.kl_coef, cfg.scale_advantages) == ("seq-mean-token-sum-norm", 0.01, False)


@pytest.mark.parametrize("algorithm", ["gspo", "dapo", "dr_grpo", "rloo", "cispo", "ppo"])
def test_python_train_takes_the_algorithms_preset_as_the_command_line_does(tmp_path, monkeypatch, algorithm):
    """hetrl.train(config, algorithm=X) is the run `hetrl train [--config] algorithm=X` makes, whether config is
    None, a YAML path, a dict or a RunConfig: the config's resolved grpo values (loss, clip range, aggregation) do
    not stand in for X's preset. (They did: every algorithm run from Python, the algorithm benchmark's included,
    trained GRPO under X's name.)"""
    import hetrl
    from hetrl.trainer import run

    seen = []
    monkeypatch.setattr(run, "train", lambda cfg, **kw: seen.append(cfg))
    out = f"out_dir={tmp_path}"
    for config, cli in [(None, load_config(None, [f"algorithm={algorithm}", out])),
                        (TINY, load_config(TINY, [f"algorithm={algorithm}", out])),
                        (load_config(TINY), load_config(TINY, [f"algorithm={algorithm}", out])),
                        ({"steps": 3}, load_config(None, ["steps=3", f"algorithm={algorithm}", out]))]:
        hetrl.train(config, algorithm=algorithm, out_dir=str(tmp_path))
        assert seen.pop().to_dict() == cli.to_dict()
    over = load_config(TINY, ["algorithm=dapo"])   # from one preset to another: nothing of the first stays
    hetrl.train(over, algorithm=algorithm, out_dir=str(tmp_path))
    assert seen.pop().to_dict() == load_config(TINY, [f"algorithm={algorithm}", out]).to_dict()
    mine = load_config(TINY, ["clip_high=0.3"])    # a value the user set (not the preset's) is kept
    hetrl.train(mine, algorithm="dapo", out_dir=str(tmp_path))
    assert seen.pop().clip_high == 0.3
    saved = tmp_path / "run_config.yaml"   # the command line over a saved (resolved) config: the same rule
    saved.write_text(yaml.safe_dump(over.to_dict()))
    assert (load_config(str(saved), [f"algorithm={algorithm}", out]).to_dict()
            == load_config(TINY, [f"algorithm={algorithm}", out]).to_dict())


def test_remax_advantage_is_the_reward_less_the_greedy_baseline():
    """Every token of a response gets r - b (its reward sits on the last token; b: the prompt's greedy reward)."""
    from hetrl.data import Example
    from hetrl.trainer import loop
    from hetrl.trainer.rollout import Sample

    cfg = load_config(TINY, ["adv_estimator=remax"])
    rollouts = [loop.Rollout(Example({}, [1, 2]), [Sample([5, 6, 7], "x", False), Sample([8], "y", False)],
                             [1.0, 0.25], baseline=0.5),
                loop.Rollout(Example({}, [3]), [Sample([9, 9], "z", False), Sample([4, 4], "w", False)],
                             [0.0, 2.0], baseline=1.0)]
    adv, _ = loop._per_token(rollouts, cfg)
    assert adv.tolist() == [0.5, 0.5, 0.5, -0.25, -1.0, -1.0, 1.0, 1.0]
