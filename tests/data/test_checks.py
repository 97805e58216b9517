"""The user's rows are read and checked once, up front (hetrl/data/checks.py): each problem names the file, the
row or line and the column; over-long lines are refused with bounded memory; values stay as written."""

import json
import tracemalloc

import pytest

from hetrl.cli import main
from hetrl.data import load_rows
from hetrl.data.checks import MAX_LINE_BYTES
from hetrl.data.sources import read_checked
from hetrl.schema import InputError


def test_an_over_long_line_is_refused_with_its_number_and_bounded_memory(tmp_path):
    path = tmp_path / "d.jsonl"
    with open(path, "w") as f:
        f.write('{"prompt": "ok"}\n')
        f.write('{"prompt": "' + "x" * (6 * MAX_LINE_BYTES) + '"}\n')     # 48 MiB in one line
    tracemalloc.start()
    try:
        with pytest.raises(InputError, match=rf"data={path}: line 2 is longer than 8 MiB"):
            load_rows(str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * MAX_LINE_BYTES, peak       # never the whole 48 MiB line


@pytest.mark.parametrize("name, content, needle", [
    ("d.jsonl", b'{"prompt": "a"}\n{"prompt": "\xff\xfe"}\n', "line 2: byte 13 is not UTF-8"),
    ("d.jsonl", b"", "holds no rows"),
    ("d.jsonl", b'{"prompt": "a"}\n[1, 2]\n', "line 2 is a JSON list, not an object of columns"),
    ("d.jsonl", b'{"prompt": "a"}\n{"prompt": \n', "line 2 is not JSON"),
    ("d.csv", b"prompt,answer\n\xff,1\n", "line 2: byte 1 is not UTF-8"),
    ("d.csv", b"prompt,answer\na,1,2\n", "line 2 has more cells than the header's 2 columns"),
    ("d.csv", b"", "holds no rows"),
    ("d.json", b'[{"prompt": "a"}, 3]', "element 1 is a JSON int"),
])
def test_unreadable_files_name_the_file_and_the_line(tmp_path, name, content, needle):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(InputError, match="data=" + str(path)) as e:
        load_rows(str(path))
    assert needle in str(e.value), str(e.value)


def test_values_are_kept_as_written(tmp_path):
    (tmp_path / "d.csv").write_text("prompt,code\nfirst,007\nsecond,x1\nthird,12\n")
    assert [r["code"] for r in load_rows(str(tmp_path / "d.csv"))] == ["007", "x1", "12"]
    rows = [{"prompt": "a", "code": "007"}, {"prompt": "b", "code": 7}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_rows(str(tmp_path / "d.jsonl")) == rows
    (tmp_path / "d.json").write_text(json.dumps(rows))
    assert load_rows(str(tmp_path / "d.json")) == rows
    (tmp_path / "lines.json").write_text("".join(json.dumps(r) + "\n" for r in rows))    # JSON lines in .json
    assert load_rows(str(tmp_path / "lines.json")) == rows
    # a UTF-8 byte-order mark (Windows editors write one) is read past, as in CSV (JSON said "Unexpected UTF-8 BOM")
    for name, text in (("bom.jsonl", "".join(json.dumps(r) + "\n" for r in rows)), ("bom.json", json.dumps(rows)),
                       ("bom.csv", "prompt,code\na,007\n")):
        (tmp_path / name).write_bytes("\ufeff".encode() + text.encode())
        assert load_rows(str(tmp_path / name))[0]["prompt"] == "a", name


def test_empty_prompts_are_named_by_file_row_and_column(tmp_path):
    rows = [{"q": "a"}, {"q": " "}, {"q": "c"}, {"q": [{"role": "user", "content": ""}]}, {"q": ""}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(InputError, match=rf"data={path}: column 'q' is empty in rows 1, 3, 4; a blank prompt"):
        read_checked(str(path), "data", "q")


def _data(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [{"prompt": f"{i} + {i} =", "answer": str(2 * i)} for i in range(30)]
QUICK = ["eval_size=4", "prompts_per_step=2", "responses_per_prompt=2", "mini_batches=1", "reward=exact_match"]


def test_bad_data_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    from hetrl.trainer import run

    monkeypatch.setattr(run, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    data = _data(tmp_path, ROWS[:5] + [{"prompt": ""}] + ROWS[5:])
    assert main(["train", "--config", "examples/runs/tiny.yaml", f"out_dir={tmp_path / 'r'}", f"data={data}",
                 *QUICK]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"data={data}: column 'prompt' is empty in row 5" in err[0], err
    (tmp_path / "r.py").write_text("def f(x, y):\n    return 0\n")
    assert main(["train", "--config", "examples/runs/tiny.yaml", f"out_dir={tmp_path / 'r2'}",
                 f"data={_data(tmp_path, ROWS)}", *QUICK, f"reward={tmp_path / 'r.py'}:f"]) == 2
    assert "fit none of TRL's" in capsys.readouterr().err


def test_validate_checks_every_file_and_every_reward_and_says_all_problems(tmp_path, capsys):
    (tmp_path / "quits.py").write_text("import sys\nsys.exit(0)\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"model: tiny\ndata: {_data(tmp_path, [{'prompt': ''}] * 5, 'a.jsonl')}\n"
                   f"eval_data: {tmp_path / 'missing.jsonl'}\nreward: {tmp_path / 'quits.py'}:f\n")
    good = tmp_path / "good.yaml"
    good.write_text(f"model: tiny\ndata: {_data(tmp_path, ROWS, 'b.jsonl')}\nreward: exact_match\neval_size: 4\n")
    assert main(["validate", str(bad), str(good)]) == 2
    out, err = capsys.readouterr()
    assert f"{good}: ok (run config: grpo on tiny, 16 steps, executor local, 30 rows of" in out
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    for needle in ("column 'prompt' is empty in rows 0, 1, 2, 3, 4", "missing.jsonl: no such file",
                   "SystemExit(0)"):
        assert needle in lines[0], lines[0]


def test_a_resume_on_fixed_data_proceeds_with_allow_config_change_and_is_logged(tmp_path, capsys):
    import hetrl

    data = _data(tmp_path, ROWS)
    out = tmp_path / "r"
    args = ["--config", "examples/runs/tiny.yaml", f"out_dir={out}", f"data={data}", *QUICK]
    assert main(["train", *args, "steps=1"]) == 0
    _data(tmp_path, [dict(r, answer=r["answer"] + " ") if i == 7 else r for i, r in enumerate(ROWS)])   # "fixed"
    assert main(["train", *args, "steps=2", "--resume"]) == 2
    assert "--allow-config-change (hetrl.train(..., resume=True, allow_config_change=True))" in \
        capsys.readouterr().err
    summary = hetrl.train("examples/runs/tiny.yaml", out_dir=str(out), data=str(data), steps=2, eval_size=4,
                          prompts_per_step=2, responses_per_prompt=2, mini_batches=1, reward="exact_match",
                          resume=True, allow_config_change=True)
    assert summary["steps"] == 2
    logged = [json.loads(x) for x in (out / "resumes.jsonl").read_text().splitlines()]
    assert logged[-1]["checkpoint"] == "step_000001" and "data_fingerprint" in logged[-1]["changed"]


def test_a_resume_refused_after_the_model_loads_leaves_the_runs_config_and_log_as_they_were(tmp_path, capsys):
    """run_config.yaml and resumes.jsonl are written once every check of a resume passed: a resume refused after
    its config check (here the data split; hetrl validate says it too) left run_config.yaml saying the refused
    values, and the next plain --resume was then refused as a change the user never made."""
    data = _data(tmp_path, ROWS)
    out = tmp_path / "r"
    assert main(["train", "--config", "examples/runs/tiny.yaml", f"out_dir={out}", f"data={data}", *QUICK,
                 "steps=1"]) == 0
    config = (out / "run_config.yaml").read_text()
    capsys.readouterr()
    assert main(["train", "--resume", f"out_dir={out}", "steps=2", "eval_size=30", "--allow-config-change"]) == 2
    captured = capsys.readouterr()
    assert "would hold out all of them" in captured.err and "held-out" not in captured.out   # before the model
    run = tmp_path / "run.yaml"
    run.write_text(f"model: tiny\ndata: {data}\nreward: exact_match\neval_size: 30\n")
    assert main(["validate", str(run)]) == 2
    assert "would hold out all of them" in capsys.readouterr().err
    assert (out / "run_config.yaml").read_text() == config and not (out / "resumes.jsonl").exists()
    assert main(["train", "--resume", f"out_dir={out}", "steps=2"]) == 0


def test_a_resume_allowed_other_rewards_is_logged_and_its_held_out_scores_are_not_paired(tmp_path, capsys):
    """Other reward functions on a resume: refused as a change, and with --allow-config-change continued and
    logged (they were refused even then, after the message offered the flag). The evaluation before training
    scored other rewards, so the summary does not pair it with the final one (gained / lost / p are null and
    not_paired says why) instead of pairing scores of different things."""
    data = _data(tmp_path, ROWS)
    out = tmp_path / "r"
    assert main(["train", "--config", "examples/runs/tiny.yaml", f"out_dir={out}", f"data={data}", *QUICK,
                 "steps=1"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", f"out_dir={out}", "steps=2", "reward=format"]) == 2
    assert "--allow-config-change" in capsys.readouterr().err
    assert main(["train", "--resume", f"out_dir={out}", "steps=2", "reward=format", "--allow-config-change"]) == 0
    assert "is not compared" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["not_paired"] and summary["gained"] is None and summary["sign_test_p"] is None
    logged = [json.loads(x)["changed"] for x in (out / "resumes.jsonl").read_text().splitlines()]
    assert logged == [{"reward": ["exact_match", "format"]}, {"reward_names": [["exact_match"], ["format"]]}]
    assert "reward: format" in (out / "run_config.yaml").read_text()
    assert main(["train", "--resume", f"out_dir={out}", "steps=3"]) == 0   # the run's own config now
    assert json.loads((out / "summary.json").read_text())["not_paired"]


def test_data_smaller_than_a_step_is_warned_about(tmp_path, caplog):
    """3 training rows for prompts_per_step=4: every step repeats prompts and epoch jumps by more than one; said
    once at the start (it ran without a word)."""
    data = _data(tmp_path, ROWS[:5])
    assert main(["train", "--config", "examples/runs/tiny.yaml", f"out_dir={tmp_path / 'r'}", f"data={data}",
                 "eval_size=2", "prompts_per_step=4", "responses_per_prompt=2", "mini_batches=1",
                 "reward=exact_match", "steps=1"]) == 0
    assert "3 training rows for prompts_per_step=4" in caplog.text


def test_validate_takes_the_key_value_overrides_train_takes(tmp_path, capsys):
    """hetrl validate RUN.yaml key=value checks the config as `hetrl train --config RUN.yaml key=value` runs it
    (it took files only); overrides given with a cluster, workload or plan file are refused for that file."""
    run = tmp_path / "run.yaml"
    run.write_text(f"model: tiny\ndata: {_data(tmp_path, ROWS)}\nreward: exact_match\n")
    assert main(["validate", str(run)]) == 2          # eval_size 100 of 30 rows
    assert "would hold out all of them" in capsys.readouterr().err
    assert main(["validate", str(run), "eval_size=4", "steps=3"]) == 0
    assert "3 steps" in capsys.readouterr().out
    assert main(["validate", str(run), "stepz=3"]) == 2
    assert "stepz" in capsys.readouterr().err
    assert main(["validate", "examples/clusters/cpu-local.yaml", "steps=3"]) == 2
    assert "apply to run configs, not to a cluster" in capsys.readouterr().err
    assert main(["validate", "steps=3"]) == 2
    assert "give at least one FILE" in capsys.readouterr().err


def test_a_bad_parquet_file_is_said_once(tmp_path):
    (tmp_path / "d.parquet").write_bytes(b"garbage")
    (tmp_path / "run.yaml").write_text(f"model: tiny\ndata: {tmp_path / 'd.parquet'}\nreward: exact_match\n")
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).parents[2]      # a process of its own: datasets' log handler writes to its stderr
    done = subprocess.run([sys.executable, "-m", "hetrl", "validate", str(tmp_path / "run.yaml")], cwd=root,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, err
    assert "d.parquet: cannot be read as .parquet (ArrowInvalid" in err[0], err
