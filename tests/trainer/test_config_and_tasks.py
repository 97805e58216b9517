import pytest

from hetrl.trainer.config import RunConfig, load_config, parse_overrides
from hetrl.trainer.tasks import Task, extract_answer

ARITH = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=["+", "-"], allow_negation=False,
             allow_parentheses=False)


def test_unknown_key_lists_valid_keys(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 3\nlearning_rate: 0.1\n")
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['learning_rate'\].*valid keys: model, dtype"):
        load_config(str(path))
    with pytest.raises(ValueError, match=r"the command line: unknown config key\(s\) \['stpes'\] \(did you mean 'steps'\?\)"):
        load_config(None, ["stpes=3"])


def test_overrides_parse_numbers_and_nested_task_options():
    assert parse_overrides(["lr=2e-5", "steps=3", "dynamic_sampling=true", "task_config.max_digits=1"]) == {
        "lr": 2e-5, "steps": 3, "dynamic_sampling": True, "task_config": {"max_digits": 1}}
    with pytest.raises(ValueError, match="must look like key=value"):
        parse_overrides(["steps"])


def test_algorithm_presets_fill_unset_knobs():
    grpo, dapo = RunConfig(algorithm="grpo"), RunConfig(algorithm="dapo")
    assert (grpo.clip_high, grpo.kl_coef, grpo.loss_agg, grpo.dynamic_sampling) == (0.2, 0.001, "seq-mean-token-mean", False)
    assert (dapo.clip_high, dapo.kl_coef, dapo.loss_agg, dapo.dynamic_sampling, dapo.overlong_filter) == \
        (0.28, 0.0, "token-mean", True, True)
    assert RunConfig(algorithm="grpo", kl_coef=0.0).kl_coef == 0.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(algorithm="ppo"), r"algorithm must be one of grpo, dapo, got 'ppo'"),
    (dict(responses_per_prompt=1), "must be >= 2: group-relative"),
    (dict(mini_batches=9, prompts_per_step=8), r"mini_batches \(9\) cannot exceed prompts_per_step \(8\)"),
    (dict(algorithm="dapo", kl_coef=0.1), "DAPO has no KL term"),
    (dict(lr=0), "lr must be a finite number > 0"),
    (dict(top_p=1.5), r"top_p must be a finite number in \(0, 1\]"),
    (dict(steps="ten"), "steps must be an int >= 1"),
    (dict(impl="triton"), "impl must be one of"),
    (dict(clip_low=1.0), "clip_low"),
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


def test_rewards_on_known_right_and_wrong_answers():
    task = Task("basic_arithmetic", ARITH, seed=0, eval_size=10)
    problem = task.eval_problems[0]
    gold = problem["answer"]
    right = task.score(problem, gold)
    assert right.correct and right.formatted and right.reward == 1.0
    assert task.score(problem, f"so the result is {gold}").correct
    wrong = task.score(problem, str(int(gold) + 1))
    assert not wrong.correct and wrong.reward == 0.0
    assert task.score(problem, "I do not know").reward == 0.0
    with_format = Task("basic_arithmetic", ARITH, seed=0, eval_size=10, format_reward=0.5)
    assert with_format.score(problem, gold).reward == 1.5
    assert with_format.score(problem, f"It is {gold}").reward == 1.0
    partial = Task("basic_arithmetic", ARITH, seed=0, eval_size=10, reward="partial")
    assert 0 < partial.score(problem, gold + "00").reward < 1


def test_math_verify_reward():
    task = Task("basic_arithmetic", ARITH, seed=0, eval_size=10, reward="math_verify")
    problem = task.eval_problems[0]
    assert task.score(problem, f"The result is {problem['answer']}.").correct
    assert not task.score(problem, f"The result is {int(problem['answer']) + 3}.").correct


def test_training_stream_is_deterministic_and_disjoint_from_eval():
    a = Task("basic_arithmetic", ARITH, seed=3, eval_size=50)
    b = Task("basic_arithmetic", ARITH, seed=3, eval_size=50)
    first, nxt = a.train_problems(0, 20)
    assert [p["question"] for p in first] == [p["question"] for p in b.train_problems(0, 20)[0]]
    assert nxt >= 20
    eval_q = {p["question"] for p in a.eval_problems}
    assert not eval_q & {p["question"] for p in a.train_problems(0, 300)[0]}


def test_unknown_task_and_bad_options():
    with pytest.raises(ValueError, match="unknown task 'arithmetics'; reasoning-gym has: .*basic_arithmetic"):
        Task("arithmetics", {}, seed=0, eval_size=10)
    with pytest.raises(ValueError, match="bad task_config for 'basic_arithmetic'"):
        Task("basic_arithmetic", {"max_digitz": 2}, seed=0, eval_size=10)
