"""A user's own data and reward functions, from the user's side: `hetrl train data=... reward=FILE.py:NAME` and
`hetrl.train(config, train_dataset=..., reward_funcs=[...])` on the tiny model. The rewards record what they were
given, and the tests check it by value against the rows the prompts came from."""

import json
import pathlib
import textwrap

import pytest

import hetrl
from hetrl.cli import main
from hetrl.data import RowSource
from hetrl.models import tiny_tokenizer

datasets = pytest.importorskip("datasets")     # absent on the device machine: `pytest -m gpu` must still collect

TINY = str(pathlib.Path(__file__).parents[2] / "examples" / "runs" / "tiny.yaml")
QUICK = ["steps=2", "eval_size=4", "checkpoint_every=0", "prompts_per_step=4", "responses_per_prompt=2",
         "mini_batches=1"]


def _chat_rows(n=24):
    return [{"prompt": [{"role": "user", "content": f"{i} + {i}?"}], "answer": str(2 * i), "level": i % 3,
             "tag": f"row{i}"} for i in range(n)]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _recording_reward(tmp_path, body: str, name="reward.py") -> pathlib.Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(f"""
        import json, pathlib
        LOG = pathlib.Path(__file__).with_suffix(".calls.jsonl")
        def record(**what):
            with open(LOG, "a") as f:
                f.write(json.dumps(what) + "\\n")
        {textwrap.indent(textwrap.dedent(body), '        ').strip()}
    """))
    return path


def _calls(reward_path):
    return [json.loads(line) for line in reward_path.with_suffix(".calls.jsonl").read_text().splitlines()]


def test_a_jsonl_chat_dataset_with_a_trl_reward_that_receives_each_rows_columns(tmp_path):
    rows = _chat_rows()
    data = _write_jsonl(tmp_path / "data.jsonl", rows)
    reward = _recording_reward(tmp_path, """
        def score(completions, prompts, answer, level, tag, completion_ids, **kwargs):
            record(prompts=prompts, answer=answer, level=level, tag=tag, completions=completions,
                   ids=completion_ids, other=sorted(kwargs))
            return [float(len(c[0]["content"]) % 2) for c in completions]
    """)
    out = tmp_path / "run"
    assert main(["train", "--config", TINY, f"out_dir={out}", f"data={data}", f"reward={reward}:score", *QUICK]) == 0
    by_prompt = {json.dumps(r["prompt"]): r for r in rows}
    calls = _calls(reward)
    assert len(calls) == 2 + 2   # eval before and after, 2 training steps
    for call in calls:
        for i, prompt in enumerate(call["prompts"]):
            row = by_prompt[json.dumps(prompt)]          # every column is this row's value at the same position
            assert (call["answer"][i], call["level"][i], call["tag"][i]) == (row["answer"], row["level"], row["tag"])
            assert call["completions"][i][0]["role"] == "assistant" and isinstance(call["ids"][i], list)
        assert call["other"] == ["log_extra", "log_metric", "trainer_state"]   # no column left out; TRL's extras
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all("reward/score" in m for m in metrics)
    assert all("accuracy" not in m for m in metrics)     # a user's reward has no notion of "correct"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["paired_on"] == "reward" and "eval_reward_before" in summary and "eval_reward/score_after" in summary
    evals = [json.loads(x) for x in (out / "eval_step_2.jsonl").read_text().splitlines()]
    assert len(evals) == 4 and all({"prompt", "answer", "reply", "reward", "rewards"} <= set(e) for e in evals)


def test_a_verl_parquet_with_compute_score_receiving_ground_truth_from_reward_model(tmp_path):
    rows = [{"prompt": r["prompt"], "data_source": "toy",
             "reward_model": {"style": "rule", "ground_truth": r["answer"]},
             "extra_info": {"index": i}} for i, r in enumerate(_chat_rows())]
    data = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(data))
    reward = _recording_reward(tmp_path, """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            record(data_source=data_source, solution=solution_str, ground_truth=ground_truth, extra_info=extra_info)
            return {"score": float(solution_str.strip() == ground_truth), "length": len(solution_str)}
    """)
    out = tmp_path / "run"
    assert main(["train", "--config", TINY, f"out_dir={out}", f"data={data}", f"reward={reward}:compute_score",
                 *QUICK]) == 0
    truth_of_index = {i: r["reward_model"]["ground_truth"] for i, r in enumerate(rows)}
    calls = _calls(reward)
    assert len(calls) == 4 + 2 * 8 + 4              # eval rows, 2 steps x 4 prompts x 2 responses, eval rows
    for c in calls:
        assert c["data_source"] == "toy" and c["ground_truth"] == truth_of_index[c["extra_info"]["index"]]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("reward/compute_score/length" in m for m in metrics)   # a dict's other keys are logged


def test_answer_key_reaches_nested_ground_truth_for_the_builtin_checks(tmp_path):
    rows = [{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}, {"prompt": "2+2=", "reward_model": {}}]
    source = RowSource(rows, rows[:1], eval_size=1, seed=0, tokenizer=tiny_tokenizer())
    from hetrl.data import RewardSet

    rewards = RewardSet(["exact_match"], builtins=source.builtin_rewards("reward_model.ground_truth"))
    assert rewards.score(rows, [r["prompt"] for r in rows], ["so 2", "4"]).total == [1.0, 0.0]


def test_two_weighted_rewards_with_a_none_from_python(tmp_path, capsys):
    seen = []

    def first(completions, level, **kwargs):
        seen.append(list(level))
        return [1.0 if lv == 0 else None for lv in level]

    def second(completions, **kwargs):
        return [0.5] * len(completions)

    out = tmp_path / "py"
    summary = hetrl.train(TINY, train_dataset=datasets.Dataset.from_list(_chat_rows()), reward_funcs=[first, second],
                          out_dir=str(out), steps=2, eval_size=4, checkpoint_every=0, prompts_per_step=4,
                          responses_per_prompt=2, mini_batches=1, reward_weights=[2.0, 4.0])
    assert summary["steps"] == 2 and seen
    evals = [json.loads(x) for x in (out / "eval_step_2.jsonl").read_text().splitlines()]
    for e in evals:   # None is left out of the weighted sum: 2 * 1.0 + 4 * 0.5 where it applies, else 4 * 0.5
        assert e["reward"] == (4.0 if e["rewards"]["first"] is not None else 2.0)
    config = (out / "run_config.yaml").read_text()
    assert "data: <python>" in config and "<python>:first" in config
    # the CLI cannot resume (to train further) a run whose data and rewards came from Python: it says how, before
    # anything loads (the reward recorded as <python>:first was imported first and failed as a module name)
    capsys.readouterr()
    assert main(["train", "--resume", f"out_dir={out}", "steps=3"]) == 2
    assert "this run was given train_dataset, reward_funcs from Python; resume it from Python with the same: " \
           "hetrl.train(..., train_dataset=..., reward_funcs=..., resume=True)" in capsys.readouterr().err
    from hetrl.trainer.checkpoint import resume_command
    from hetrl.trainer.config import load_config

    assert resume_command(load_config(str(out / "run_config.yaml"))) == \
        f"hetrl.train(..., train_dataset=..., reward_funcs=..., out_dir={str(out)!r}, resume=True)"


def test_the_held_out_split_is_never_trained_on_across_epochs():
    rows = _chat_rows(30) + [_chat_rows(30)[0] | {"tag": "copy of row0"}]   # a duplicate prompt
    source = RowSource(rows, None, eval_size=6, seed=3, tokenizer=tiny_tokenizer())
    held = {json.dumps(e.row["prompt"]) for e in source.eval_examples}
    trained, index = [], 0
    for _ in range(12):        # > 2 epochs of 24-25 rows
        got, index, _ = source.train_examples(index, 7)
        trained += got
    assert not held & {json.dumps(e.row["prompt"]) for e in trained}
    assert len(source.eval_examples) == 6 and len(source.train_rows) + 6 + source.dropped_as_eval == 31
    first_epoch = [json.dumps(e.row) for e in trained[:len(source.train_rows)]]
    assert len(set(first_epoch)) == len(source.train_rows)     # an epoch visits every training row once
    again = RowSource(rows, None, eval_size=6, seed=3, tokenizer=tiny_tokenizer())
    assert [e.row for e in again.train_examples(0, 40)[0]] == [e.row for e in trained[:40]]   # by seed


@pytest.mark.parametrize("suffix", [".json", ".csv", "dir"])
def test_every_file_form_reads_the_same_rows(tmp_path, suffix):
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(5)]
    ds = datasets.Dataset.from_list(rows)
    path = tmp_path / ("saved" if suffix == "dir" else f"d{suffix}")
    if suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".csv":
        ds.to_csv(str(path), index=False)
    else:
        ds.save_to_disk(str(path))
    from hetrl.data import load_rows

    got = load_rows(str(path))
    assert [{k: str(v) for k, v in r.items()} for r in got] == rows


def test_a_dataset_dict_trains_on_its_train_split_and_evaluates_on_its_test_split(tmp_path):
    """A save_to_disk DatasetDict: data= reads its 'train' split; eval_data= its 'test' (or 'validation') split,
    the one meant for evaluation (it read 'train' as the held-out rows)."""
    from hetrl.data.sources import read_checked
    from hetrl.schema import InputError

    train = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(5)]
    test = [{"prompt": f"{i}*2=", "answer": str(2 * i)} for i in range(3)]
    path = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list(test)}).save_to_disk(str(path))
    assert read_checked(str(path), "data", "prompt") == train
    assert read_checked(str(path), "eval_data", "prompt") == test
    only_val = tmp_path / "val"
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(test)}).save_to_disk(str(only_val))
    assert read_checked(str(only_val), "eval_data", "prompt") == test
    with pytest.raises(InputError, match="without a 'train' split"):
        read_checked(str(only_val), "data", "prompt")


def test_a_dataset_dict_given_as_data_alone_holds_out_its_test_split(tmp_path, capsys):
    """data= a saved DatasetDict with a test (else validation) split and no eval_data: the held-out rows are that
    split, as its author meant (it was ignored and eval_size rows were drawn out of the train split), said in the
    run's description; hetrl validate checks the same split; with a train split only, eval_size rows are drawn."""
    from hetrl.data.sources import held_out_data
    from hetrl.trainer import run
    from hetrl.trainer.config import load_config

    train = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(12)]
    test = [{"prompt": f"{i}*2=", "answer": str(2 * i)} for i in range(3)]
    for split in ("test", "validation"):
        path = tmp_path / split
        datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                              split: datasets.Dataset.from_list(test)}).save_to_disk(str(path))
        cfg = load_config(TINY, [f"data={path}", "eval_size=4", "reward=exact_match"])
        assert held_out_data(cfg.data, cfg.eval_data) == str(path)
        source = run.build_source(cfg, tiny_tokenizer())
        assert [e.row for e in source.eval_examples] == test and len(source.train_rows) == 12
        assert f"3 held out (the DatasetDict's {split} split; eval_data=PATH for others)" in source.description
        other = _write_jsonl(tmp_path / "other.jsonl", train[:2])   # eval_data= still chooses
        cfg = load_config(TINY, [f"data={path}", f"eval_data={other}", "reward=exact_match"])
        assert [e.row for e in run.build_source(cfg, tiny_tokenizer()).eval_examples] == train[:2]
    bad = tmp_path / "bad"   # validate reads that split too: its rows' problems are said
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list([{"question": "1+1="}])}).save_to_disk(str(bad))
    assert main(["validate", TINY, f"data={bad}", "reward=exact_match"]) == 2
    said = capsys.readouterr().err   # named as the user gave it: data=, not an eval_data= they never typed
    assert f"data={bad} (its held-out split)" in said and "eval_data=" not in said, said
    only_train = tmp_path / "train_only"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train)}).save_to_disk(str(only_train))
    cfg = load_config(TINY, [f"data={only_train}", "eval_size=4", "reward=exact_match"])
    assert held_out_data(cfg.data, cfg.eval_data) is None
    source = run.build_source(cfg, tiny_tokenizer())
    assert len(source.eval_examples) == 4 and "eval_size=4 rows drawn by seed" in source.description


def test_train_and_validate_say_every_problem_of_the_data_and_rewards_together(tmp_path, capsys):
    """One check (sources.input_problems) for both: hetrl train, before the model loads, says each problem
    hetrl validate says (a reward file that is not there, a row without a prompt, held-out rows without the
    reward's column), in one line, where it stopped at the first."""
    data = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"question": "2+2="}])
    evals = _write_jsonl(tmp_path / "e.jsonl", [{"prompt": "3+3="}])
    args = [f"data={data}", f"eval_data={evals}", f"reward=[{tmp_path / 'missing.py'}:score, exact_match]"]
    assert main(["train", "--config", TINY, f"out_dir={tmp_path / 'run'}", *args]) == 2
    trained = capsys.readouterr().err.strip().splitlines()
    assert main(["validate", TINY, *args]) == 2
    validated = capsys.readouterr().err.strip().splitlines()
    assert len(trained) == len(validated) == 1
    for needle in ("missing.py", f"data={data}: row 1", f"eval_data={evals}", "exact_match needs the column(s) answer"):
        assert needle in trained[0] and needle in validated[0], (trained, validated)
    assert trained[0].split(": ", 1)[1] in validated[0]   # the same problems, validate's line names the file first


BAD_REWARDS = {
    "syntax": ("def f(completions, **kw)\n    return [1.0]\n", "f", r"reward\.py:1: syntax error"),
    "import": ("import not_a_module_anywhere\n", "f", r"importing it failed at .*reward\.py:1: ModuleNotFoundError"),
    "raises": ("def f(completions, **kw):\n    raise KeyError('answer')\n", "f",
               r"reward f: raised KeyError: 'answer' \(.*reward\.py:2\) on a batch of 4 completions \(rows 0\.\.3\)"),
    "count": ("def f(completions, **kw):\n    return [1.0]\n", "f", "reward f: returned 1 rewards for 4 completions"),
    "nan": ("def f(completions, **kw):\n    return [float('nan')] * len(completions)\n", "f",
            "reward f: row 0: returned nan, not a finite number"),
    "text": ("def f(completions, **kw):\n    return ['good'] * len(completions)\n", "f",
             "reward f: row 0: returned the text 'good', not a number"),
    "missing": ("def g(completions, **kw):\n    return []\n", "f", r"has no 'f' \(callables there: g\)"),
    "signature": ("def f(x, y):\n    return []\n", "f", "fit none of TRL's"),
    "sys_exit_0": ("import sys\ndef f(completions, **kw):\n    sys.exit(0)\n", "f",
                   r"reward f: raised SystemExit\(0\) .* \(rows 0\.\.3\); fix the function, or set reward_errors=skip"),
    "exit_at_import": ("import sys\nsys.exit(0)\n", "f", r"importing it failed at .*reward\.py:2: SystemExit\(0\)"),
    "verl_raises": ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return 1 / 0\n", "compute_score", r"reward compute_score: row 0: raised ZeroDivisionError"),
}


@pytest.mark.parametrize("case", sorted(BAD_REWARDS))
def test_a_bad_reward_is_one_line(tmp_path, capsys, case):
    source, name, message = BAD_REWARDS[case]
    (tmp_path / "reward.py").write_text(source)
    data = _write_jsonl(tmp_path / "data.jsonl", _chat_rows())
    assert main(["train", "--config", TINY, f"out_dir={tmp_path / 'run'}", f"data={data}",
                 f"reward={tmp_path / 'reward.py'}:{name}", *QUICK]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    import re

    assert re.search(message, err[0]), err[0]


@pytest.mark.parametrize("setup, message", [
    (lambda d: _write_jsonl(d / "x.jsonl", [{"question": "q", "answer": "1"}] * 10),
     "rows 0, 1, 2, 3, 4 (and 5 more) have no prompt column 'prompt' (row 0's columns: question, answer); set "
     "prompt_key=COLUMN"),
    (lambda d: (d / "x.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n') and d / "x.jsonl",
     "x.jsonl: line 2 is not JSON (Expecting value at column 11)"),
    (lambda d: d / "missing.parquet", "missing.parquet: no such file or directory"),
    (lambda d: (d / "x.txt").write_text("hi") and d / "x.txt", "unknown file type '.txt'"),
    (lambda d: _write_jsonl(d / "x.jsonl", [{"prompt": 3}] * 10), "the prompt must be a string or a list of chat"),
    (lambda d: _write_jsonl(d / "x.jsonl", [{"prompt": "a", "answer": "1"}] * 3), "data has 3 rows, and eval_size=4"),
])
def test_bad_data_is_one_line(tmp_path, capsys, setup, message):
    data = setup(tmp_path)
    assert main(["train", "--config", TINY, f"out_dir={tmp_path / 'run'}", f"data={data}", "reward=exact_match",
                 *QUICK]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_reward_worker_that_calls_os_exit_is_one_line_and_skip_goes_on(tmp_path, capsys):
    (tmp_path / "reward.py").write_text("import os\ndef f(completions, **kw):\n    os._exit(0)\n")
    data = _write_jsonl(tmp_path / "data.jsonl", _chat_rows())
    args = ["train", "--config", TINY, f"data={data}", f"reward={tmp_path / 'reward.py'}:f", "reward_workers=1", *QUICK]
    assert main([*args, f"out_dir={tmp_path / 'a'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reward f: rows 0..3: its worker process exited (exit code 0) without returning" in err[0]
    # reward_errors=skip: every row fails, so every group is dropped and nothing is trained, said in metrics
    assert main([*args, f"out_dir={tmp_path / 'b'}", "reward_errors=skip"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward_errors"] for r in rows] == [8, 8] and all(r["groups_kept"] == 0 for r in rows)
    printed = capsys.readouterr().out
    assert "no step kept a group to learn from" in printed and "after none (no reward function scored" in printed


def test_verls_own_gsm8k_scorer_copied_unchanged_trains(tmp_path, capsys, caplog):
    """verl 0.9.1's gsm8k.compute_score(solution_str, ground_truth, method, format_score, score), as verl ships it
    (tests/data/fixtures/verl_gsm8k.py), on verl's data layout."""
    rows = [{"prompt": r["prompt"], "data_source": "openai/gsm8k",
             "reward_model": {"style": "rule", "ground_truth": r["answer"]}} for r in _chat_rows()]
    data = _write_jsonl(tmp_path / "train.jsonl", rows)
    scorer = pathlib.Path(__file__).parents[1] / "data" / "fixtures" / "verl_gsm8k.py"
    out = tmp_path / "run"
    assert main(["train", "--config", TINY, f"out_dir={out}", f"data={data}", f"reward={scorer}:compute_score",
                 *QUICK]) == 0, capsys.readouterr().err
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all("reward/compute_score" in m for m in metrics)
    # the tiny model never writes "#### N": the scorer is 0 for every row, and hetrl says so at the first step
    assert any("warning: reward compute_score is 0 for every one of the 8 rows of the first step" in r.getMessage()
               for r in caplog.records)


def test_a_trl_reward_using_log_metric_trains_and_its_metric_lands_in_metrics_jsonl(tmp_path):
    (tmp_path / "trl_reward.py").write_text(textwrap.dedent("""
        def length_reward(completions, trainer_state, log_metric, **kwargs):
            lengths = [len(c[0]["content"]) for c in completions]
            log_metric("completion_len", sum(lengths) / len(lengths))
            log_metric("step_seen", float(trainer_state.global_step))
            return [float(n % 3) for n in lengths]
    """))
    data = _write_jsonl(tmp_path / "data.jsonl", _chat_rows())
    out = tmp_path / "run"
    assert main(["train", "--config", TINY, f"out_dir={out}", f"data={data}",
                 f"reward={tmp_path / 'trl_reward.py'}:length_reward", "reward_workers=1", *QUICK]) == 0
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step_seen"] for m in metrics] == [0.0, 1.0]
    assert all(0 < m["completion_len"] for m in metrics)


def test_strict_makes_a_reward_that_is_none_for_every_row_an_error(tmp_path, capsys):
    (tmp_path / "reward.py").write_text("def f(completions, **kw):\n    return [None] * len(completions)\n")
    data = _write_jsonl(tmp_path / "data.jsonl", _chat_rows())
    assert main(["train", "--config", TINY, f"out_dir={tmp_path / 'run'}", f"data={data}",
                 f"reward={tmp_path / 'reward.py'}:f", "strict=true", *QUICK]) == 2
    err = [s for s in capsys.readouterr().err.replace("\r", "\n").splitlines() if s.strip() and
           not s.startswith("train:")]
    assert len(err) == 1 and "strict=true: reward f returned None (not applicable) for every one of the 8 rows" \
        in err[0], err


def test_one_reward_given_from_python_as_a_string_is_one_reward(tmp_path):
    rows = [{"prompt": f"{i} + {i} =", "answer": str(2 * i)} for i in range(24)]
    summary = hetrl.train(TINY, train_dataset=rows, reward_funcs="exact_match", out_dir=str(tmp_path / "py"),
                          steps=1, eval_size=4, checkpoint_every=0, prompts_per_step=4, responses_per_prompt=2,
                          mini_batches=1)
    assert summary["config"]["reward"] == ["exact_match"]


def test_a_response_prefix_starts_every_reply_and_a_last_assistant_message_is_continued():
    """response_prefix: chat prompts end with an assistant message holding it, which the reply continues (TRL's
    continue_final_message); string prompts end with it. Rows whose prompt already ends with an assistant message
    are continued as they are (TRL's rule), and are refused with response_prefix beside them."""
    from hetrl.data.sources import TaskSource, prompt_ids
    from hetrl.schema import InputError

    tok = tiny_tokenizer()
    chat = [{"prompt": [{"role": "user", "content": f"q{i}"}]} for i in range(4)]
    text = [{"prompt": f"q{i}:"} for i in range(4)]
    src = RowSource(chat, None, eval_size=1, seed=0, tokenizer=tok, prompt_suffix="!", response_prefix="<think>")
    (ex,), _, _ = src.train_examples(0, 1)
    assert ex.row["prompt"][-1] == {"role": "assistant", "content": "<think>"}
    assert ex.row["prompt"][0]["content"].endswith("!")
    fresh = prompt_ids(tok, ex.row["prompt"][:-1])
    assert ex.prompt_ids[:len(fresh)] == fresh and tok.decode(ex.prompt_ids[len(fresh):]) == "<think>"
    (ex,), _, _ = RowSource(text, None, eval_size=1, seed=0, tokenizer=tok, response_prefix=" A:").train_examples(0, 1)
    assert ex.row["prompt"].endswith(": A:")
    continued = [{"prompt": r["prompt"] + [{"role": "assistant", "content": "Sure"}]} for r in chat]
    (ex,), _, _ = RowSource(continued, None, eval_size=1, seed=0, tokenizer=tok).train_examples(0, 1)
    assert tok.decode(ex.prompt_ids).endswith("Sure")
    with pytest.raises(InputError, match="already ends with an assistant message"):
        RowSource(continued, None, eval_size=1, seed=0, tokenizer=tok, response_prefix="x")
    task = TaskSource("basic_arithmetic", {}, 0, 2, tok, 1024, response_prefix="The answer is")
    assert task.eval_examples[0].row["prompt"][-1]["content"] == "The answer is"
    assert task.fingerprint != TaskSource("basic_arithmetic", {}, 0, 2, tok, 1024).fingerprint


def test_a_reward_that_needs_a_column_the_data_lacks_is_refused_before_the_model_loads(tmp_path, capsys):
    """A built-in check without an answer column, and a TRL reward whose required `answer` the rows lack: one line
    naming the reward, the column and the data's columns, before the model loads (nothing evaluated); `hetrl
    validate` says the same."""
    data = _write_jsonl(tmp_path / "noans.jsonl", [{"prompt": f"{i} + 1 =", "level": i} for i in range(12)])
    (tmp_path / "r.py").write_text("def correct(completions, answer, **kw):\n    return [0.0] * len(completions)\n")
    for reward, needle in (("exact_match", "reward exact_match needs the column(s) answer"),
                           (f"{tmp_path / 'r.py'}:correct", "reward correct needs the column(s) answer")):
        args = ["train", "--config", TINY, f"out_dir={tmp_path / 'run'}", f"data={data}", f"reward={reward}", *QUICK]
        assert main(args) == 2
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert len(err) == 1 and needle in err[0] and "its columns: level, prompt" in err[0], err
        assert "held-out" not in captured.out
        run = tmp_path / "run.yaml"
        run.write_text(f"model: tiny\ndata: {data}\nreward: {reward}\n")
        assert main(["validate", str(run)]) == 2
        assert needle in capsys.readouterr().err


def test_a_column_named_as_a_reward_argument_is_refused_before_the_model_loads(tmp_path, capsys):
    """A data column called completions (or prompts, completion_ids) would reach every TRL-style reward twice: the
    call failed after the model loaded with 'got multiple values for keyword argument', blaming the function."""
    data = _write_jsonl(tmp_path / "cols.jsonl", [{"prompt": f"{i} + 1 =", "answer": str(i + 1),
                                                   "completions": "x"} for i in range(12)])
    assert main(["train", "--config", TINY, f"out_dir={tmp_path / 'run'}", f"data={data}", "reward=exact_match",
                 *QUICK]) == 2
    captured = capsys.readouterr()
    assert "has the column(s) completions" in captured.err and "rename" in captured.err
    assert "held-out" not in captured.out
    run = tmp_path / "run.yaml"
    run.write_text(f"model: tiny\ndata: {data}\nreward: exact_match\n")
    assert main(["validate", str(run)]) == 2
    assert "has the column(s) completions" in capsys.readouterr().err


def test_a_held_out_set_no_reward_scores_has_no_score_not_zero(tmp_path, capsys):
    """A reward that is None (not applicable) for every row: the held-out reward is null, not 0.0, before and
    after, each reply's reward is null, and the run says it learned nothing."""
    (tmp_path / "r.py").write_text("def nones(completions, **kw):\n    return [None] * len(completions)\n")
    data = _write_jsonl(tmp_path / "data.jsonl", _chat_rows())
    out = tmp_path / "run"
    assert main(["train", "--config", TINY, f"out_dir={out}", f"data={data}", f"reward={tmp_path / 'r.py'}:nones",
                 *QUICK]) == 0
    printed = capsys.readouterr().out
    assert "held-out reward before training: none (no reward function scored any held-out reply)" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_reward_before"] is None and summary["eval_reward_after"] is None
    assert summary["gained"] == summary["lost"] == 0
    assert all(r["eval_reward"] is None for r in map(json.loads, (out / "eval.jsonl").read_text().splitlines()))
    replies = [json.loads(line) for line in (out / "eval_step_2.jsonl").read_text().splitlines()]
    assert replies and all(r["reward"] is None for r in replies)


def test_an_unknown_keyword_of_hetrl_train_gets_the_command_lines_message(tmp_path):
    with pytest.raises(hetrl.schema.InputError, match=r"hetrl.train's keyword arguments: unknown config key\(s\) "
                                                      r"\['stepz'\] \(did you mean 'steps'\?\)"):
        hetrl.train(TINY, out_dir=str(tmp_path / "run"), stepz=1)
    with pytest.raises(hetrl.schema.InputError, match="unknown config key"):
        hetrl.train({"model": "tiny", "lerning_rate": 1.0}, out_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_a_reward_given_in_the_config_and_from_python_is_refused(tmp_path):
    """hetrl.train(reward=exact_match, reward_funcs=[f]) ran f alone without a word (data given both ways was
    refused); a config file's reward is what reward_funcs stands in for (TINY's partial, above)."""
    def f(completions, **kwargs):
        return [1.0] * len(completions)

    with pytest.raises(ValueError, match=r"give the reward once: reward=exact_match and reward_funcs from Python"):
        hetrl.train(TINY, reward="exact_match", reward_funcs=[f], out_dir=str(tmp_path / "r"))
    with pytest.raises(ValueError, match=r"give the data once: data=x.jsonl in the config and train_dataset"):
        hetrl.train(TINY, data="x.jsonl", train_dataset=_chat_rows(), out_dir=str(tmp_path / "r"))
    assert not (tmp_path / "r").exists()
