"""A user's reward functions (TRL and verl conventions) receive exactly their row's columns, weights skip None,
and every bad reward is one clear line."""

import math
import re
import textwrap

import pytest

from hetrl.data.rewards import RewardSet, convention, load_reward
from hetrl.schema import InputError

ROWS = [{"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4", "level": 1},
        {"prompt": [{"role": "user", "content": "3+3?"}], "answer": "6", "level": 2}]


def test_a_trl_reward_receives_each_rows_columns_by_value():
    seen = {}

    def correct(completions, answer, level, prompts, completion_ids, **kwargs):
        seen.update(completions=completions, answer=answer, level=level, prompts=prompts, ids=completion_ids,
                    extra=kwargs)
        return [1.0 if c[0]["content"] == a else 0.0 for c, a in zip(completions, answer)]

    s = RewardSet([correct]).score(ROWS, [r["prompt"] for r in ROWS], ["4", "5"], [[7], [8, 9]])
    assert s.total == [1.0, 0.0]
    assert seen["answer"] == ["4", "6"] and seen["level"] == [1, 2]
    assert seen["completions"] == [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]]
    assert seen["prompts"] == [r["prompt"] for r in ROWS] and seen["ids"] == [[7], [8, 9]]
    assert sorted(seen["extra"]) == ["log_extra", "log_metric", "trainer_state"]     # as TRL 1.16 passes them


def test_a_reward_that_changes_what_it_is_given_changes_nothing_of_the_run():
    """A judge that appends the reply to prompts[i] (to build the conversation it scores) or edits a column: each
    call has its own copies, as TRL's fresh rows per call; a group's samples, which share their dataset row, each
    get theirs too. The run's rows and token lists are as they were."""
    row = {"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4", "extra_info": {"k": [1]}}
    ids = [[7], [8]]

    def judge(prompts, completions, extra_info, completion_ids, **kwargs):
        for p, c, e, t in zip(prompts, completions, extra_info, completion_ids):
            p.append(c[0])
            e["k"].append(2)
            t.append(0)
        return [float(len(p)) for p in prompts]

    def verl_judge(data_source, solution_str, ground_truth, extra_info=None):
        extra_info["k"].clear()
        return 1.0

    for _ in range(2):
        assert RewardSet([judge]).score([row, row], [row["prompt"], row["prompt"]], ["4", "5"], ids).total == [2., 2.]
        assert RewardSet([verl_judge]).score([row, row], [row["prompt"]] * 2, ["4", "5"]).total == [1.0, 1.0]
    assert row == {"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4", "extra_info": {"k": [1]}}
    assert ids == [[7], [8]]


def test_string_prompts_get_string_completions():
    got = {}

    def f(completions, **kw):
        got["c"] = completions
        return [len(c) for c in completions]

    assert RewardSet([f]).score([{"prompt": "a"}], ["a"], ["xyz"]).total == [3.0]
    assert got["c"] == ["xyz"]


def test_a_verl_compute_score_receives_ground_truth_from_reward_model():
    calls = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        calls.append((data_source, solution_str, ground_truth, extra_info))
        return {"score": float(solution_str == ground_truth), "acc": solution_str == ground_truth}

    rows = [{"prompt": [{"role": "user", "content": "q"}], "data_source": "gsm8k",
             "reward_model": {"style": "rule", "ground_truth": "72"}, "extra_info": {"index": 3}}]
    s = RewardSet([compute_score]).score(rows, [rows[0]["prompt"]], ["72"])
    assert calls == [("gsm8k", "72", "72", {"index": 3})]
    assert s.total == [1.0] and s.extra == {"compute_score/acc": [True]}


def test_weighted_rewards_leave_none_out_of_the_sum():
    def a(completions, **kw):
        return [1.0, None, None]

    def b(completions, **kw):
        return [0.5, 0.25, None]

    s = RewardSet([a, b], weights=[2.0, 4.0]).score([{}] * 3, ["p"] * 3, ["x", "y", "z"])
    assert s.total == [2.0 + 2.0, 1.0, 0.0]
    assert s.per_function == {"a": [1.0, None, None], "b": [0.5, 0.25, None]}


def test_the_two_conventions_are_told_apart_by_signature():
    def trl(completions, **kwargs):
        return []

    def verl(data_source, solution_str, ground_truth, extra_info=None):
        return 0.0

    def neither(x, y):
        return 0.0

    def per_source(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
        return score if solution_str.endswith(f"#### {ground_truth}") else format_score

    assert convention(trl) == "trl" and convention(verl) == "verl" and convention(per_source) == "verl"
    with pytest.raises(InputError, match="fit none of"):
        convention(neither)
    rows = [{"reward_model": {"ground_truth": "7"}}] * 2
    assert RewardSet([per_source]).score(rows, ["p"] * 2, ["so #### 7", "#### 8"]).total == [1.0, 0.0]


def test_specs_load_from_a_file_and_a_module(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def r(completions, **kw):\n    return [1.0 for _ in completions]\n")
    assert load_reward(f"{f}:r")(completions=["a"]) == [1.0]
    assert load_reward("math:sqrt") is math.sqrt


@pytest.mark.parametrize("body, spec_name, match", [
    ("def r(completions, **kw):\n    return [1.0]\n", "nope", "has no 'nope' .*callables there: r"),
    ("def r(completions, **kw)\n    return []\n", "r", r"my_reward.py:1: syntax error"),
    ("import not_a_module_anywhere\n", "r", r"importing it failed at .*my_reward.py:1: ModuleNotFoundError"),
])
def test_a_reward_spec_that_does_not_load_says_where(tmp_path, body, spec_name, match):
    f = tmp_path / "my_reward.py"
    f.write_text(body)
    with pytest.raises(InputError, match=match):
        load_reward(f"{f}:{spec_name}")


def test_bad_spec_forms_are_refused(tmp_path):
    for spec in ("noseparator", "a:b:c", ":r", f"{tmp_path / 'missing.py'}:r"):
        with pytest.raises(InputError):
            load_reward(spec)
    # a package.module that is not importable: said as that, not where the import machinery failed (<frozen ...>)
    with pytest.raises(InputError, match=r"reward 'nosuchpkg.rewards:r': no module named 'nosuchpkg' is importable "
                                         r"from here .*path/to/file.py:NAME"):
        load_reward("nosuchpkg.rewards:r")


@pytest.mark.parametrize("ret, match", [
    ("[1.0]", "returned 1 rewards for 2 completions"),
    ("[1.0, float('nan')]", "row 1: returned nan, not a finite number"),
    ("[1.0, 'good']", "row 1: returned the text 'good', not a number"),
    ("'1111'", "reward bad: returned str '1111', expected a list of 2 numbers"),
    ("['1', '1']", "row 0: returned the text '1', not a number"),
    ("7", "returned int, expected a list of 2 numbers"),
    ("[1.0, 1 / 0]", r"raised ZeroDivisionError: division by zero \(.*:3\)"),
])
def test_a_reward_that_misbehaves_is_one_clear_line(tmp_path, ret, match):
    f = tmp_path / "bad.py"
    f.write_text(textwrap.dedent(f"""\
        def bad(completions, **kw):
            x = 1
            return {ret}
        """))
    with pytest.raises(InputError, match=match):
        RewardSet([f"{f}:bad"]).score([{}, {}], ["p", "p"], ["a", "b"])


def test_a_verl_reward_that_raises_names_the_row():
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0 / len(solution_str)

    with pytest.raises(InputError, match="row 1: raised ZeroDivisionError"):
        RewardSet([compute_score]).score([{}, {}], ["p", "p"], ["a", ""])
    with pytest.raises(InputError, match="2 weights for 1 reward functions"):
        RewardSet([compute_score], weights=[1, 2])


def test_reward_workers_run_a_users_functions_in_other_processes_with_the_same_results(tmp_path):
    import os

    path = tmp_path / "slow.py"
    path.write_text(textwrap.dedent("""
        import os
        def by_trl(completions, answer, **kw):
            return [float(c == a) + os.getpid() * 0 for c, a in zip(completions, answer)]
        def pid(completions, **kw):
            return [float(os.getpid())] * len(completions)
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": float(solution_str == ground_truth), "pid": os.getpid()}
    """))
    rows = [{"prompt": f"q{i}", "answer": str(i % 3), "data_source": "d", "reward_model": {"ground_truth": str(i % 2)}}
            for i in range(10)]
    completions = [str(i % 4) for i in range(10)]
    specs = [f"{path}:by_trl", f"{path}:compute_score", f"{path}:pid"]
    inline = RewardSet(specs).score(rows, [r["prompt"] for r in rows], completions)
    pooled_set = RewardSet(specs, workers=2)
    try:
        pooled = pooled_set.score(rows, [r["prompt"] for r in rows], completions)
    finally:
        pooled_set.close()
    assert pooled.per_function["by_trl"] == inline.per_function["by_trl"]
    assert pooled.per_function["compute_score"] == inline.per_function["compute_score"]
    pids = set(pooled.per_function["pid"]) | set(pooled.extra["compute_score/pid"])
    assert os.getpid() not in pids and len(pids) >= 1          # ran elsewhere
    assert set(inline.per_function["pid"]) == {float(os.getpid())}


def test_reward_workers_refuse_a_function_that_cannot_be_sent(tmp_path):
    with pytest.raises(InputError, match="reward_workers > 0 runs it in other processes"):
        RewardSet([lambda completions, **kw: [0.0] * len(completions)], workers=2)


def test_a_failing_function_in_a_worker_is_still_one_line(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("def f(completions, **kw):\n    raise RuntimeError('sandbox down')\n")
    rewards = RewardSet([f"{path}:f"], workers=2)
    try:
        with pytest.raises(InputError, match=r"reward f: raised RuntimeError: sandbox down .*bad\.py:2"):
            rewards.score([{}] * 4, ["p"] * 4, ["a"] * 4)
    finally:
        rewards.close()


# ------------------------------------------------------------------ containment (hetrl/data/containment.py)

MISBEHAVING = textwrap.dedent("""
    import os, sys, time
    def exits(completions, **kw):
        sys.exit(0)
    def interrupts(completions, **kw):
        raise KeyboardInterrupt
    def dies(completions, **kw):
        os._exit(0)
    def hangs(completions, **kw):
        time.sleep(600)
    def fine(completions, **kw):
        return [float(len(c)) for c in completions]
    def some_rows(completions, **kw):
        if any(c == "bad" for c in completions):
            raise ValueError("bad row")
        return [1.0] * len(completions)
""")


@pytest.mark.parametrize("name, workers, match", [
    ("exits", 0, r"reward exits: raised SystemExit\(0\) \(.*bad\.py:4\) on a batch of 4 completions \(rows 0\.\.3\)"),
    ("interrupts", 0, r"reward interrupts: raised KeyboardInterrupt .* \(rows 0\.\.3\)"),
    ("exits", 1, r"reward exits: raised SystemExit\(0\) .*\(rows 0\.\.3\)"),
    ("dies", 1, r"reward dies: rows 0\.\.3: its worker process exited \(exit code 0\) without returning"),
])
def test_exits_interrupts_and_dying_workers_are_that_rewards_error(tmp_path, name, workers, match):
    (tmp_path / "bad.py").write_text(MISBEHAVING)
    rewards = RewardSet([f"{tmp_path / 'bad.py'}:{name}", f"{tmp_path / 'bad.py'}:fine"], workers=workers)
    try:
        with pytest.raises(InputError, match=match):
            rewards.score([{}] * 4, ["p"] * 4, ["a", "bb", "ccc", "dddd"])
        if workers:     # the pool lives on: the next call gets a fresh worker
            assert RewardSet([f"{tmp_path / 'bad.py'}:fine"], workers=1).score(
                [{}] * 2, ["p"] * 2, ["a", "bb"]).total == [1.0, 2.0]
    finally:
        rewards.close()


def test_a_steps_reward_mean_and_accuracy_leave_out_the_rows_reward_errors_skip_dropped():
    """reward_errors=skip drops the rows a function failed on: they have no reward, so the step's reward_mean and
    accuracy are over the rows scored (they counted as 0, and reward_mean fell while every scored row got 1)."""
    from hetrl.data.rewards import Scores
    from hetrl.trainer.loop import _reward_stats

    def fail_even(completions, **kwargs):   # rows 0 and 2 fail (found row by row after the batch fails)
        return [1.0 if c in ("b", "d") else 1 / 0 for c in completions]

    s = RewardSet([fail_even], errors="skip").score([{}] * 4, ["p"] * 4, ["a", "b", "c", "d"])
    assert s.failed == [0, 2] and s.total[1] == s.total[3] == 1.0
    stats = _reward_stats([s])
    assert stats["reward_mean"] == 1.0 and stats["reward/fail_even"] == 1.0
    flags = Scores([0.0, 1.0, 0.0], {"f": [None, 1.0, 0.0]}, correct=[False, True, False], failed=[0])
    assert _reward_stats([flags])["accuracy"] == 0.5
    none = _reward_stats([Scores([0.0], {"f": [None]}, correct=[False], failed=[0])])
    assert math.isnan(none["reward_mean"]) and math.isnan(none["accuracy"])


def test_a_row_without_an_answer_is_neither_right_nor_wrong():
    """The built-in check returns None where a row has no answer: its `correct` flag is None (it counted as wrong,
    lowering accuracy and eval_accuracy), and the step's accuracy is over the rows judged."""
    from hetrl.data.rewards import builtin_rewards
    from hetrl.trainer.loop import _reward_stats

    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}, {"prompt": "3+3=", "answer": None}]
    s = RewardSet(["exact_match"], builtins=builtin_rewards()).score(rows, [r["prompt"] for r in rows],
                                                                   ["2", "4", "6"])
    assert s.correct == [True, None, None]
    assert _reward_stats([s])["accuracy"] == 1.0


def test_a_hung_reward_in_a_worker_times_out_and_the_worker_is_replaced(tmp_path):
    import time

    (tmp_path / "bad.py").write_text(MISBEHAVING)
    hangs = RewardSet([f"{tmp_path / 'bad.py'}:hangs"], workers=1, timeout_s=2.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(InputError, match=r"reward hangs: rows 0\.\.1: did not return within reward_timeout_s=2 s"):
            hangs.score([{}] * 2, ["p"] * 2, ["a", "b"])
        assert time.monotonic() - t0 < 30
    finally:
        hangs.close()
    with pytest.raises(InputError, match="reward_timeout_s=2 needs reward_workers >= 1"):
        RewardSet([f"{tmp_path / 'bad.py'}:hangs"], timeout_s=2.0)


@pytest.mark.parametrize("workers", [0, 2])
def test_reward_errors_skip_drops_only_the_rows_that_fail(tmp_path, workers):
    (tmp_path / "bad.py").write_text(MISBEHAVING)
    rewards = RewardSet([f"{tmp_path / 'bad.py'}:some_rows", f"{tmp_path / 'bad.py'}:fine"], workers=workers,
                        errors="skip")
    try:
        got = rewards.score([{}] * 4, ["p"] * 4, ["a", "bad", "ccc", "dd"])
    finally:
        rewards.close()
    assert got.failed == [1]
    assert len(got.errors) == 1 and "reward some_rows" in got.errors[0] and "bad row" in got.errors[0]
    assert got.per_function["some_rows"] == [1.0, None, 1.0, 1.0]
    assert got.total == [2.0, 3.0, 4.0, 3.0]


def test_a_module_that_exits_while_importing_is_one_line(tmp_path):
    (tmp_path / "quits.py").write_text("import sys\nsys.exit(0)\ndef f(completions, **kw):\n    return []\n")
    with pytest.raises(InputError, match=r"importing it failed at .*quits\.py:2: SystemExit\(0\)"):
        RewardSet([f"{tmp_path / 'quits.py'}:f"])


# ------------------------------------------------------------------ silent zeros (RewardSet.check_silent_zeros)

def _none(completions, **kw):
    return [None] * len(completions)


def _ones(completions, **kw):
    return [1.0] * len(completions)


def _varies(completions, **kw):
    return [float(len(c)) for c in completions]


def _verl(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth)


@pytest.mark.parametrize("funcs, rows, needle", [
    ([_none], [{}] * 3, "reward _none returned None (not applicable) for every one of the 3 rows"),
    ([_ones], [{}] * 3, "reward _ones is 1 for every one of the 3 rows of the first step"),
    ([_verl, _varies], [{"data_source": "x"}] * 3, "was called with ground_truth=None for 3 of 3 rows"),
    (["exact_match", _varies], [{"reward_model": {"x": 1}}] * 3,
     "answer_key=reward_model.ground_truth is missing in 3 of 3 rows"),
])
def test_silent_zeros_warn_at_the_first_step_and_fail_under_strict(funcs, rows, needle, caplog):
    from hetrl.data.rewards import builtin_rewards

    builtins = builtin_rewards("reward_model.ground_truth")
    args = (rows, ["p"] * len(rows), ["a", "bb", "ccc"][:len(rows)])
    with caplog.at_level("WARNING"):
        RewardSet(funcs, builtins=builtins).score(*args)          # not a checked call: nothing said
        assert not caplog.records
        quiet = RewardSet(funcs, builtins=builtins)
        quiet.score(*args, check=True)
        assert any(needle in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
        caplog.clear()
        quiet.score(*args, check=True)                            # once, at the first step
        assert not caplog.records
    with pytest.raises(InputError, match="^strict=true: .*" + re.escape(needle)):
        RewardSet(funcs, builtins=builtins, strict=True).score(*args, check=True)


def test_a_varying_reward_is_not_warned_about(caplog):
    with caplog.at_level("WARNING"):
        RewardSet([_varies]).score([{}] * 3, ["p"] * 3, ["a", "bb", "ccc"], check=True)
    assert not caplog.records


# ------------------------------------------------------------------ users' existing reward code

def test_trl_extras_reach_a_function_that_takes_them():
    seen = {}

    def logs(completions, trainer_state, log_metric, log_extra, **kw):
        seen["step"] = trainer_state.global_step
        log_metric("my/len", sum(len(c) for c in completions) / len(completions))
        log_extra("len", [len(c) for c in completions])
        return [0.0] * len(completions)

    def plain(prompts, completions, completion_ids):     # no **kwargs: none of the extras
        return [1.0] * len(completions)

    from hetrl.data.rewards import TrainerState

    rewards = RewardSet([logs, plain])
    rewards.trainer_state = TrainerState(global_step=3, max_steps=5)
    got = rewards.score([{}] * 2, ["p"] * 2, ["ab", "abcd"])
    assert seen["step"] == 3 and got.logged == {"my/len": [3.0]} and got.extra["logs/len"] == [2, 4]
    assert got.per_function["plain"] == [1.0, 1.0]


def test_a_verl_per_source_scorer_copied_from_verl_is_taken_as_written():
    from tests.data.fixtures import verl_gsm8k

    rows = [{"reward_model": {"ground_truth": "72"}}] * 3
    got = RewardSet([verl_gsm8k.compute_score]).score(rows, ["p"] * 3, ["so #### 72", "#### 7", "no answer"])
    assert got.total == [1.0, 0.0, 0.0]


def test_a_module_spec_imports_from_the_current_directory(tmp_path, monkeypatch):
    import os
    import sys

    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "scores.py").write_text("def f(completions, **kw):\n    return [2.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd(), str(tmp_path))])
    assert load_reward("mypkg.scores:f")(["a"]) == [2.0]
    assert str(tmp_path) not in sys.path           # the path is as it was


def test_a_bad_log_metric_value_is_the_rewards_error():
    def logs(completions, log_metric, **kw):
        log_metric("len", "long")
        return [0.0] * len(completions)

    with pytest.raises(InputError, match=r"^reward logs: log_metric\('len', 'long'\): the value must be a finite "
                                         r"number on a batch of 2 completions \(rows 0\.\.1\)"):
        RewardSet([logs]).score([{}] * 2, ["p"] * 2, ["a", "b"])


def test_a_reward_file_is_executed_once_per_version(tmp_path):
    import os

    f = tmp_path / "counted.py"
    f.write_text("import pathlib\nLOG = pathlib.Path(__file__).with_suffix('.runs')\n"
                 "LOG.write_text(LOG.read_text() + 'x' if LOG.exists() else 'x')\n"
                 "def f(completions, **kw):\n    return [0.0] * len(completions)\n")
    load_reward(f"{f}:f")
    load_reward(f"{f}:f")           # `hetrl train` checks it before the model loads, then the run loads it
    assert (tmp_path / "counted.runs").read_text() == "x"
    f.write_text(f.read_text() + "\n# changed\n")
    os.utime(f, ns=(1, 2))
    load_reward(f"{f}:f")
    assert (tmp_path / "counted.runs").read_text() == "xx"


def test_a_users_error_is_located_in_the_users_code_not_hetrls():
    """contained() names the innermost frame outside hetrl: the user's raising line; a call whose arguments do not
    fit the user's signature (it fails before entering it) is said as such, not as hetrl's call site."""
    from hetrl.data.containment import contained

    def needs_answer(completions, answer):
        return [float(a) for a in answer]

    def raises(completions):
        raise ValueError("bad row")

    got = contained(lambda: needs_answer(completions=["x"]))
    assert "missing 1 required positional argument: 'answer'" in got.why
    assert __file__ in got.why   # the lambda above is this file's: the innermost frame outside hetrl
    from hetrl.data.rewards import call_trl

    with pytest.raises(InputError) as e:
        call_trl(needs_answer, "needs_answer", [{"prompt": "p"}], ["p"], ["x"], None)
    assert "when hetrl called it: its parameters do not take that call" in str(e.value)
    assert "hetrl/data" not in str(e.value)
    with pytest.raises(InputError) as e:
        call_trl(lambda completions, **kw: raises(completions), "r", [{"prompt": "p"}], ["p"], ["x"], None)
    assert f"{__file__}:" in str(e.value) and "ValueError: bad row" in str(e.value)
