import pathlib

import pytest

from hetrl.data import RewardSet, TaskSource, extract_answer, prompt_ids
from hetrl.models import tiny_tokenizer
from hetrl.trainer.config import ALGORITHMS, RunConfig, load_config, parse_overrides

ARITH = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=["+", "-"], allow_negation=False,
             allow_parentheses=False)


def test_unknown_key_lists_valid_keys(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 3\nlearning_rate: 0.1\n")
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['learning_rate'\].*valid keys: model, dtype"):
        load_config(str(path))
    with pytest.raises(ValueError,
                       match=r"the command line: unknown config key\(s\) \['stpes'\] \(did you mean 'steps'\?\)"):
        load_config(None, ["stpes=3"])


def test_overrides_parse_numbers_and_nested_task_options():
    assert parse_overrides(["lr=2e-5", "steps=3", "dynamic_sampling=true", "task_config.max_digits=1"]) == {
        "lr": 2e-5, "steps": 3, "dynamic_sampling": True, "task_config": {"max_digits": 1}}
    with pytest.raises(ValueError, match="must look like key=value"):
        parse_overrides(["steps"])
    with pytest.raises(ValueError, match=r"'run.yaml' must look like key=value .*given with --config run.yaml"):
        parse_overrides(["run.yaml"])


def test_a_rule_between_fields_names_both_places_they_came_from(tmp_path):
    """max_leaves set on the command line against the YAML's responses_per_prompt: neither place alone is to
    blame, so the message names both (it named only the YAML)."""
    path = tmp_path / "run.yaml"
    path.write_text("responses_per_prompt: 8\ntools: x.py:f\nbranches: 2\n")
    with pytest.raises(ValueError, match=r"run.yaml with the command line: max_leaves \(4\) counts"):
        load_config(str(path), ["max_leaves=4"])
    with pytest.raises(ValueError, match=r"^the command line: max_leaves \(4\) counts"):
        load_config(None, ["responses_per_prompt=8", "tools=x.py:f", "branches=2", "max_leaves=4"])


def test_algorithm_presets_fill_unset_knobs():
    grpo, dapo = RunConfig(algorithm="grpo"), RunConfig(algorithm="dapo")
    assert (grpo.clip_high, grpo.kl_coef, grpo.loss_agg, grpo.dynamic_sampling) == \
        (0.2, 0.0, "seq-mean-token-mean", False)
    assert (dapo.clip_high, dapo.kl_coef, dapo.loss_agg, dapo.dynamic_sampling, dapo.overlong_filter) == \
        (0.28, 0.0, "token-mean", True, True)
    assert RunConfig(algorithm="grpo", kl_coef=0.001).kl_coef == 0.001 and RunConfig(algorithm="ppo").kl_coef == 0.001


@pytest.mark.parametrize("kwargs, match", [
    (dict(reward="exact_matc"), r"reward 'exact_matc' is not a built-in .* \(did you mean 'exact_match'\?\)"),
    (dict(algorithm="reinforce"),
     r"algorithm must be one of grpo, dapo, ppo, gspo, dr_grpo, rloo, reinforce_pp, cispo, got 'reinforce'"),
    (dict(data="x.jsonl"), r"reward 'verifier' is a reasoning-gym task's own check, and this run trains on "
                           r"data=x.jsonl \(and that path does not exist\); use exact_match"),
    (dict(data=__file__), r"test_config_and_tasks.py; use exact_match"),   # a file that exists: no remark
    (dict(reward="exactmatch"), "reward 'exactmatch' is not a built-in"),
    (dict(reward=("verifier", "format"), reward_weights=(1.0,)), "reward_weights has 1 weights for 2 rewards"),
    (dict(eval_data="e.jsonl"), "eval_data is the held-out part of your data"),
    (dict(report_to="mlflow"), "report_to must be one of none, tensorboard, wandb"),
    (dict(responses_per_prompt=1), "must be >= 2: group-relative"),
    (dict(mini_batches=9, prompts_per_step=8), r"mini_batches \(9\) cannot exceed prompts_per_step \(8\)"),
    (dict(algorithm="dapo", kl_coef=0.1), "DAPO has no KL term"),
    (dict(lr=0), "lr must be a finite number > 0"),
    (dict(top_p=1.5), r"top_p must be a finite number in \(0, 1\]"),
    (dict(steps="ten"), "steps must be an int >= 1"),
    (dict(impl="triton"), "impl must be one of"),
    (dict(clip_low=1.5), "clip_low"),
    (dict(loss_mode="clip_cov", loss_options={"clip_cov_ratio": 2}), r"clip_cov_ratio is the share .* in \(0, 1\]"),
    (dict(loss_mode="kl_cov", loss_options={"kl_cov_ratio": 0}), r"kl_cov_ratio is the share .* got 0"),
    (dict(loss_mode="clip_cov", loss_options={"clip_cov_lb": 5.0}), r"clip_cov_lb \(5.0\) must be below clip_cov_ub"),
])
def test_bad_values_say_what_is_wrong(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RunConfig(**kwargs)


def test_yaml_must_be_a_mapping(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("- steps\n")
    with pytest.raises(ValueError, match=r"run.yaml \(a run config\) must be a mapping"):
        load_config(str(path))


def test_extract_answer():
    assert extract_answer("12 + 30 = 42") == "42"
    assert extract_answer("The answer is -7.") == "-7"
    assert extract_answer("<answer>3.5</answer> and 9") == "3.5"
    assert extract_answer("no digits") == ""


def _task(**kw):
    return TaskSource("basic_arithmetic", kw.pop("options", ARITH), seed=kw.pop("seed", 0),
                      eval_size=kw.pop("eval_size", 10), tokenizer=tiny_tokenizer(), **kw)


def _score(task, names, reply, weights=None, example=None):
    example = example or task.eval_examples[0]
    scores = RewardSet(list(names), weights, builtins=task.builtin_rewards()).score(
        [example.row], [example.row["prompt"]], [reply])
    return scores.total[0], scores.correct[0] if scores.correct is not None else None


def test_rewards_on_known_right_and_wrong_answers():
    task = _task()
    gold = task.eval_examples[0].row["answer"]
    assert _score(task, ["verifier"], gold) == (1.0, True)
    assert _score(task, ["verifier"], f"so the result is {gold}") == (1.0, True)
    assert _score(task, ["verifier"], str(int(gold) + 1)) == (0.0, False)
    assert _score(task, ["verifier"], "I do not know") == (0.0, False)
    assert _score(task, ["verifier", "format"], gold, [1.0, 0.5]) == (1.5, True)
    assert _score(task, ["verifier", "format"], f"It is {gold}", [1.0, 0.5]) == (1.0, True)
    assert 0 < _score(task, ["partial"], gold + "00")[0] < 1
    assert _score(task, ["exact_match"], f"= {gold}") == (1.0, True)


def test_math_verify_reward():
    task = _task()
    gold = task.eval_examples[0].row["answer"]
    assert _score(task, ["math_verify"], f"The result is {gold}.") == (1.0, True)
    assert _score(task, ["math_verify"], f"The result is {int(gold) + 3}.") == (0.0, False)


def test_training_stream_is_deterministic_and_disjoint_from_eval():
    a, b = _task(seed=3, eval_size=50), _task(seed=3, eval_size=50)
    first, nxt, too_long = a.train_examples(0, 20)
    assert [e.row["question"] for e in first] == [e.row["question"] for e in b.train_examples(0, 20)[0]]
    assert nxt >= 20 and too_long == 0
    assert first[0].prompt_ids == prompt_ids(tiny_tokenizer(), first[0].row["prompt"])
    eval_q = {e.row["question"] for e in a.eval_examples}
    assert not eval_q & {e.row["question"] for e in a.train_examples(0, 300)[0]}


def test_prompts_longer_than_the_limit_are_skipped_and_counted():
    lengths = [len(e.prompt_ids) for e in _task().train_examples(0, 50)[0]]
    limit = sorted(lengths)[len(lengths) // 2]
    task = _task(max_prompt_tokens=limit)
    kept, _, too_long = task.train_examples(0, 50)
    assert len(kept) == 50 and too_long > 0 and all(len(e.prompt_ids) <= limit for e in kept)


def test_unknown_task_and_bad_options():
    with pytest.raises(ValueError, match="unknown task 'arithmetics'; reasoning-gym has: .*basic_arithmetic"):
        TaskSource("arithmetics", {}, 0, 10, tiny_tokenizer())
    with pytest.raises(ValueError, match=r"task_config for 'basic_arithmetic': unknown option\(s\) \['max_digitz'\] "
                                         r"\(did you mean 'max_digits'\?\)"):
        _task(options={"max_digitz": 2})


def test_config_models_are_the_real_architectures_with_random_weights(tmp_path):
    """`model=config:NAME`: the architecture as its config.json gives it (parameter counts: SmolLM2-135M's as the
    embedded model has them, Qwen2.5-0.5B's published 0.49B), the tiny tokenizer's special tokens; an unknown
    name is one line, from `hetrl validate` too."""
    import torch

    from hetrl.cli import main
    from hetrl.models import config_model, load_model, tiny_tokenizer, unknown_model

    tok = tiny_tokenizer()
    with torch.device("meta"):
        counts = {n: sum(p.numel() for p in config_model(n, tok).parameters())
                  for n in ("smollm2-135m", "qwen2.5-0.5b")}
        qwen = config_model("qwen2.5-0.5b", tok)
    assert counts == {"smollm2-135m": 134_515_008, "qwen2.5-0.5b": 494_032_768}
    assert type(qwen).__name__ == "Qwen2ForCausalLM" and qwen.config.eos_token_id == tok.eos_token_id
    assert unknown_model("config:smollm2-135m") is None and unknown_model("tiny") is None
    assert "config:qwen2.5-0.5b" in unknown_model("config:nope")
    with pytest.raises(ValueError, match="no such architecture"):
        load_model("config:nope")
    with pytest.raises(FileNotFoundError, match="nor a local Hugging Face model directory"):
        load_model(str(tmp_path))                     # a directory without config.json
    run = tmp_path / "run.yaml"
    run.write_text("model: config:llama-9b\n")
    assert main(["validate", str(run)]) == 2


def test_prompts_are_kept_within_the_models_context(caplog):
    """max_prompt_tokens + the longest reply past the model's max_position_embeddings: prompts are capped at the
    context minus the reply (said in the log), and a reply that fills the context is refused (both went through
    silently, the positions past the context being ones the model never saw)."""
    from types import SimpleNamespace

    from hetrl.trainer.run import prompt_cap

    model = SimpleNamespace(max_position_embeddings=2048)
    assert prompt_cap(RunConfig(max_prompt_tokens=512), model) == 512
    assert prompt_cap(RunConfig(max_prompt_tokens=512), SimpleNamespace()) == 512   # a model that does not say
    with caplog.at_level("WARNING", logger="hetrl.trainer.run"):
        assert prompt_cap(RunConfig(max_prompt_tokens=4096, max_new_tokens=48, micro_batch_tokens=4144), model) == 2000
    assert "prompts longer than 2000 tokens are skipped as too long (max_prompt_tokens=4096" in caplog.text
    with pytest.raises(ValueError, match=r"eval_max_new_tokens=5000 fills model .*context of 2048 tokens"):
        prompt_cap(RunConfig(eval_max_new_tokens=5000), model)


def test_tool_knobs_without_tools_are_refused():
    """max_tool_calls, tool_timeout_s and tool_isolation set on a run without tools did nothing, silently (branches
    without tools was refused)."""
    with pytest.raises(ValueError, match=r"max_tool_calls=7 shapes tool calls, and the run has no tools"):
        load_config(None, ["max_tool_calls=7"])
    with pytest.raises(ValueError, match=r"tool_timeout_s=3.0, tool_isolation=thread shape tool calls"):
        RunConfig(tool_timeout_s=3, tool_isolation="thread")
    assert RunConfig(tools="x.py:f", max_tool_calls=7).max_tool_calls == 7


def test_ray_fields_on_a_local_run_say_how_to_leave_them_out():
    """A Ray run resumed with executor=local keeps its run_config's emulate_cluster: the refusal says =null."""
    with pytest.raises(ValueError, match=r"emulate_cluster places the run's roles on Ray and needs executor=ray; "
                                         r"for a local run leave it out \(emulate_cluster=null\)"):
        load_config(None, ["emulate_cluster=examples/clusters/cpu-2x2.yaml"])
    with pytest.raises(ValueError, match=r"plan, emulate_cluster place .* \(plan=null emulate_cluster=null\)"):
        RunConfig(plan="p.json", emulate_cluster="c.yaml")


def test_a_saved_run_config_says_where_its_relative_paths_are_from(tmp_path, monkeypatch):
    """A run's run_config.yaml records the directory it ran in; a resume from elsewhere whose relative tools path
    is not found from there is told where it is found (it was a bare 'no such file')."""
    import os

    from hetrl.trainer.config import RAN_IN

    root = pathlib.Path(__file__).parents[2]
    saved = tmp_path / "run" / "run_config.yaml"
    saved.parent.mkdir()
    saved.write_text(f"{RAN_IN}{root}\n" + "model: tiny\ntools: examples/tools/calculator.py:multiply\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=rf"tools: examples/tools/calculator.py is not found from the current "
                                         rf"directory \({os.getcwd()}\).* found from {root}: run hetrl there"):
        load_config(str(saved))
    monkeypatch.chdir(root)
    assert load_config(str(saved)).tools == "examples/tools/calculator.py:multiply"


def test_a_spec_field_says_what_it_takes():
    """tools=FILE.py: (its name missing) was read as YAML's mapping {FILE.py: null}, and a wrong type was said as
    'str or tuple'."""
    assert parse_overrides(["tools=bad.py:"]) == {"tools": "bad.py:"}
    with pytest.raises(ValueError, match=r"tools must be a string or a list of strings, got 5"):
        RunConfig(tools=5)


def test_knobs_that_would_crash_or_do_nothing_are_refused_up_front():
    """use_kl_in_reward with kl_coef 0 crashed in the first step (AttributeError on the reference's log-probs it
    never computed) after validate said ok."""
    with pytest.raises(ValueError, match=r"use_kl_in_reward=true subtracts kl_coef x the KL .* kl_coef is 0"):
        RunConfig(use_kl_in_reward=True)
    assert RunConfig(algorithm="ppo", use_kl_in_reward=True).kl_coef == 0.001   # ppo's preset has one


@pytest.mark.parametrize("kwargs, match", [
    (dict(kl_loss_type="k2"), r"kl_loss_type=k2 has no effect in this run: .* kl_coef is 0 .*give kl_coef > 0"),
    (dict(loss_scale_factor=100.0), r"loss_scale_factor=100.0 has no effect .* aggregates by seq-mean-token-mean"),
    (dict(loss_mode="sapo", clip_high=0.28), r"clip_high=0.28 has no effect .* loss_mode=sapo does not clip"),
    (dict(loss_mode="gpg", clip_low=0.1), r"clip_low=0.1 has no effect .* loss_mode=gpg does not clip"),
    (dict(lam=0.9, critic_lr=1e-3), r"lam=0.9, critic_lr=0.001 have no effect .* algorithm=grpo has no critic; use "
                                    r"algorithm=ppo, or leave them out"),
    (dict(vf_clip=0.1), r"vf_clip=0.1 has no effect .* no critic"),
    (dict(gamma=0.99), r"gamma=0.99 has no effect .* adv_estimator=grpo does not"),
    (dict(adv_estimator="rloo", scale_advantages=False), r"scale_advantages=False has no effect .* adv_estimator=rloo"),
    (dict(max_sampling_rounds=5), r"max_sampling_rounds=5 has no effect .* dynamic_sampling is off"),
    (dict(kl_target=0.2), r"kl_target=0.2 has no effect .* kl_ctrl is fixed"),
    (dict(use_kl_in_reward=True, kl_coef=0.1, kl_horizon=50), r"kl_horizon=50 has no effect .* kl_ctrl is fixed"),
])
def test_a_knob_that_does_nothing_in_the_run_is_refused(kwargs, match):
    """Each was accepted and silently ignored: the loss, estimator or controller that reads it is not in the run."""
    with pytest.raises(ValueError, match=match):
        RunConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(kl_coef=0.01, kl_loss_type="k2"), dict(algorithm="reinforce_pp", kl_coef=0.0),   # its preset's k2
    dict(algorithm="dr_grpo", loss_scale_factor=100.0), dict(algorithm="ppo", lam=0.9, gamma=0.99, vf_clip=0.1),
    dict(algorithm="reinforce_pp", gamma=0.9), dict(algorithm="dapo", max_sampling_rounds=5),
    dict(use_kl_in_reward=True, kl_coef=0.1, kl_ctrl="adaptive", kl_target=0.2),
    dict(algorithm="gspo", loss_mode="sapo"), dict(algorithm="cispo", loss_mode="gpg"),   # a preset's clip, unused
    *(dict(algorithm=a) for a in ALGORITHMS),
])
def test_a_knob_that_counts_and_a_presets_own_value_are_kept(kwargs):
    """A saved run_config.yaml holds every knob resolved (the preset's values too): it loads again as it was."""
    cfg = RunConfig(**kwargs)
    assert RunConfig(**cfg.to_dict()) == cfg


def test_trls_names_follow_trl():
    """TRL's epsilon_high defaults to epsilon (epsilon=0.3 gave a 0.3 / 0.2 clip); num_generations and
    max_completion_length are TRL's names for responses_per_prompt and max_new_tokens."""
    assert (load_config(None, ["epsilon=0.3"]).clip_low, load_config(None, ["epsilon=0.3"]).clip_high) == (0.3, 0.3)
    cfg = load_config(None, ["epsilon=0.3", "epsilon_high=0.4"])
    assert (cfg.clip_low, cfg.clip_high) == (0.3, 0.4)
    cfg = load_config(None, ["num_generations=4", "max_completion_length=12"])
    assert (cfg.responses_per_prompt, cfg.max_new_tokens) == (4, 12)


def test_a_loss_with_its_own_aggregation_names_the_knob_the_user_typed():
    with pytest.raises(ValueError, match=r"loss_agg \(verl's loss_agg_mode\)=token-mean does not apply to it: leave "
                                         r"loss_agg unset"):
        load_config(None, ["loss_mode=sapo", "loss_agg=token-mean"])


def test_the_command_line_wins_over_the_yaml_under_another_name(tmp_path):
    """YAML kl_coef: 0.02 with beta=0.01 on the command line was refused as given twice; the command line wins, as
    it does for the same name. Both names in one place are still refused."""
    path = tmp_path / "run.yaml"
    path.write_text("kl_coef: 0.02\nclip_ratio_high: 0.3\n")
    cfg = load_config(str(path), ["beta=0.01", "clip_high=0.28"])
    assert (cfg.kl_coef, cfg.clip_high) == (0.01, 0.28)
    with pytest.raises(ValueError, match="beta sets kl_coef to 0.01, but kl_coef is also given as 0.02"):
        load_config(None, ["beta=0.01", "kl_coef=0.02"])
