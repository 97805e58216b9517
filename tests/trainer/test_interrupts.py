"""Ctrl-C as a terminal sends it: SIGINT to the whole process group, the reward workers included
(reward_workers=1). The first one finishes the step, leaves a checkpoint and prints the resume command, and the
resumed run's metrics equal an uninterrupted run's; a second one aborts within seconds even while a reward
sleeps, with one line and no process left behind."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from hetrl.trainer.metrics import TIMING_KEYS

ROOT = pathlib.Path(__file__).parents[2]
TINY = str(ROOT / "examples" / "runs" / "tiny.yaml")
REWARD = """
import pathlib, time
HERE = pathlib.Path(__file__).parent
def slow(completions, answer, **kw):
    calls = HERE / "calls"
    n = len(calls.read_text()) if calls.exists() else 0
    calls.write_text("x" * (n + 1))
    if (HERE / "hang_at").exists() and n + 1 == int((HERE / "hang_at").read_text()):
        (HERE / "hanging").write_text("")
        time.sleep(600)
    time.sleep(0.3)
    return [float(len(c[0]["content"]) % 3) / 2 for c in completions]
"""
RUN = ["reward_workers=1", "steps=5", "checkpoint_every=0", "eval_size=4"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _start(args):
    return subprocess.Popen([sys.executable, "-m", "hetrl", *args], cwd=ROOT, env=ENV, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(cond, proc, limit_s=300):
    t0 = time.monotonic()
    while not cond():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < limit_s
        time.sleep(0.05)


def _rows(out):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def _errors(err: str) -> list[str]:
    return [s for s in err.replace("\r", "\n").splitlines() if s.strip() and not s.startswith("train:")]


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_saves_and_the_resume_equals_an_uninterrupted_run(tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    reward = f"reward={tmp_path / 'reward.py'}:slow"
    straight = tmp_path / "straight"
    # in a process like the interrupted one (ENV: one thread): float sums differ between thread counts
    done = _start(["train", "--config", TINY, f"out_dir={straight}", reward, *RUN])
    _, err = done.communicate(timeout=600)      # reads the pipes as it waits: a full pipe never blocks the run
    assert done.returncode == 0, err

    out = tmp_path / "run"
    proc = _start(["train", "--config", TINY, f"out_dir={out}", reward, *RUN])
    _wait_for(lambda: (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().count("\n") >= 1,
              proc)
    os.killpg(proc.pid, signal.SIGINT)      # as a terminal does: the trainer and its reward worker
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and not _errors(stderr), stderr
    stopped = len(_rows(out))
    assert 1 <= stopped < 5
    assert f"stopped at step {stopped}; continue with: hetrl train --resume out_dir={out}" in stdout
    assert (out / "checkpoints" / f"step_{stopped:06d}").is_dir()

    proc = _start(["train", "--resume", f"out_dir={out}"])
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert _rows(out) == _rows(straight)


@pytest.mark.slow
def test_a_second_ctrl_c_aborts_within_seconds_while_a_reward_sleeps(tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    (tmp_path / "hang_at").write_text("3")          # evaluation, step 1, then step 2's call sleeps 600 s
    out = tmp_path / "run"
    proc = _start(["train", "--config", TINY, f"out_dir={out}", f"reward={tmp_path / 'reward.py'}:slow", *RUN])
    _wait_for(lambda: (tmp_path / "hanging").exists(), proc)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.5)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 10
    assert proc.returncode == 130
    errors = _errors(stderr)
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    assert errors[0].startswith("hetrl train: second Ctrl-C: aborted without saving this step; continue from the "
                                f"last checkpoint with: hetrl train --resume out_dir={out}"), errors
    time.sleep(1)
    left = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-g", str(proc.pid)], capture_output=True, text=True).stdout
    alive = [line for line in left.splitlines() if line.split()[1][0] != "Z"]   # a zombie is dead, not reaped
    assert not alive, left      # the sleeping worker is gone too
