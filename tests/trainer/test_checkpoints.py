"""Runs are never stranded and never write outside out_dir: a crash at any moment leaves a resumable run whose
next steps equal the uninterrupted run's; an unreadable checkpoint falls back to the previous one; a resume
that would silently change the run is refused; planted symlinks are never followed."""

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from hetrl.cli import main
from hetrl.trainer import checkpoint, loop
from hetrl.trainer.metrics import TIMING_KEYS

ROOT = pathlib.Path(__file__).parents[2]
TINY = str(ROOT / "examples" / "runs" / "tiny.yaml")
TIMING = TIMING_KEYS


def _rows(run_dir, name="metrics.jsonl"):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (pathlib.Path(run_dir) / name).read_text().splitlines()]


def _weights(run_dir, step):
    return load_file(pathlib.Path(run_dir) / "checkpoints" / f"step_{step:06d}" / "model.safetensors")


def _same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted tiny run every crash is compared with (3 steps, a checkpoint per step)."""
    out = tmp_path_factory.mktemp("straight") / "run"
    assert main(["train", "--config", TINY, f"out_dir={out}"]) == 0
    return out


def test_the_last_step_is_saved_once(tmp_path, monkeypatch):
    saves = []
    real = checkpoint.save
    monkeypatch.setattr(checkpoint, "save", lambda *a, **k: saves.append(a[1]) or real(*a, **k))
    assert main(["train", "--config", TINY, f"out_dir={tmp_path / 'r'}"]) == 0
    assert saves == [1, 2, 3]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["checkpoint"].endswith("step_000003")


def test_a_full_disk_while_saving_says_so_in_one_line_and_leaves_no_partial_checkpoint(tmp_path, monkeypatch,
                                                                                        capsys):
    """torch.save on a full disk raises a RuntimeError ('unexpected pos') while handling ENOSPC: the run said a
    traceback and left its half-written hidden folder holding the space. Now: one line that says the disk is full
    and how to go on, the earlier checkpoint intact, nothing half-written left."""
    import errno

    real, calls = torch.save, []

    def full_at_step_2(obj, f, *a, **k):
        calls.append(1)
        if isinstance(obj, dict) and obj.get("step") == 2:
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 193536 vs 193424")
        return real(obj, f, *a, **k)

    monkeypatch.setattr(checkpoint.torch, "save", full_at_step_2)
    out = tmp_path / "r"
    assert main(["train", "--config", TINY, f"out_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert "no space left on the device writing checkpoint step_000002 (the earlier checkpoints are intact); free " \
           "space and resume the run with --resume" in err and "Traceback" not in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000001"]


def test_a_run_that_failed_before_its_first_checkpoint_can_be_restarted(tmp_path, monkeypatch, capsys, straight):
    out = tmp_path / "r"
    real, calls = loop.collect_rollouts, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated crash in step 2")
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "collect_rollouts", failing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        main(["train", "--config", TINY, "checkpoint_every=0", f"out_dir={out}"])
    assert [r["step"] for r in _rows(out)] == [1]
    monkeypatch.setattr(loop, "collect_rollouts", real)
    assert main(["train", "--config", TINY, f"out_dir={out}"]) == 0      # no --resume needed, nothing lost
    assert "stopped before its first checkpoint; starting the run from step 0" in capsys.readouterr().out
    assert _rows(out) == _rows(straight)
    # the same run, resumed instead: also no dead end
    out2 = tmp_path / "r2"
    monkeypatch.setattr(loop, "collect_rollouts", failing)
    calls.clear()
    with pytest.raises(RuntimeError):
        main(["train", "--config", TINY, "checkpoint_every=0", f"out_dir={out2}"])
    monkeypatch.setattr(loop, "collect_rollouts", real)
    assert main(["train", "--resume", f"out_dir={out2}"]) == 0
    assert [r["step"] for r in _rows(out2)] == [1, 2, 3]


@pytest.mark.parametrize("damage", ["truncate-weights", "garbage-state", "delete-state", "latest-outside"])
def test_an_unreadable_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys, straight, damage):
    out = tmp_path / "r"
    assert main(["train", "--config", TINY, "steps=2", f"out_dir={out}"]) == 0
    last = out / "checkpoints" / "step_000002"
    if damage == "truncate-weights":
        f = last / "model.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif damage == "garbage-state":
        (last / "trainer_state.pt").write_bytes(os.urandom(4096))
    elif damage == "delete-state":
        (last / "trainer_state.pt").unlink()
    else:   # `latest` may only name a step directory inside checkpoints/
        outside = tmp_path / "elsewhere"
        outside.mkdir()
        (out / "checkpoints" / "latest").write_text("../../elsewhere\n")
    capsys.readouterr()
    assert main(["train", "--resume", f"out_dir={out}", "steps=3"]) == 0
    printed = capsys.readouterr().out
    if damage == "latest-outside":
        assert "resumed from" in printed and "step_000002" in printed
    else:
        assert f"checkpoint {last} cannot be resumed from" in printed and "resumed from" in printed
        assert (out / "checkpoints" / "step_000002.unreadable").is_dir()     # kept for inspection
    assert _rows(out) == _rows(straight)
    assert _same_weights(_weights(out, 3), _weights(straight, 3))


def test_resume_refuses_a_config_that_changes_the_run(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["train", "--config", TINY, "steps=1", f"out_dir={out}"]) == 0
    capsys.readouterr()
    rc = main(["train", "--config", TINY, "steps=2", "lr=0.5", "seed=3", f"out_dir={out}", "--resume"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "lr 0.001 -> 0.5" in err and "seed 0 -> 3" in err and "--allow-config-change" in err
    assert [r["step"] for r in _rows(out)] == [1]          # nothing ran
    # steps may change; without --config the run's own config is the base (no size-mismatch with the default)
    assert main(["train", "--resume", f"out_dir={out}", "steps=2"]) == 0
    assert [r["step"] for r in _rows(out)] == [1, 2]
    assert main(["train", "--resume", f"out_dir={out}", "steps=3", "lr=0.5", "--allow-config-change"]) == 0
    logged = [json.loads(line) for line in (out / "resumes.jsonl").read_text().splitlines()]
    assert logged == [{"checkpoint": "step_000002", "changed": {"lr": [0.001, 0.5]}}]
    # the changed lr is the one step 3 took (the optimizer's saved param_groups held 0.001, and torch's
    # load_state_dict restores them: with tiny's constant rate nothing set it again)
    _, state = checkpoint.read(out / "checkpoints" / "step_000003")
    assert [g["lr"] for g in state["optimizer"]["param_groups"]] == [0.5]
    # a damaged newest checkpoint: the resume falls back to step 2, saved before the allowed change, which is the
    # run's own history (resumes.jsonl), not a change to refuse with "resume with the run's own config"
    (out / "checkpoints" / "step_000003" / "model.safetensors").write_bytes(b"cut")
    capsys.readouterr()
    assert main(["train", "--resume", f"out_dir={out}", "steps=4"]) == 0
    assert "saved before changes this run was allowed later" in capsys.readouterr().out
    assert [r["step"] for r in _rows(out)] == [1, 2, 3, 4]
    summary = json.loads((out / "summary.json").read_text())   # the same held-out prompts and rewards: paired
    assert "not_paired" not in summary and summary["sign_test_p"] is not None


def test_a_loaded_optimizer_keeps_the_runs_own_lr_and_weight_decay():
    """sharding.load_optimizer (replicas, ZeRO-1) takes the checkpoint's moments and step counts, and keeps the
    hyperparameters the run's config set: a resume with --allow-config-change lr=... must step at the new rate."""
    from hetrl.trainer import sharding
    from hetrl.trainer.build import adamw

    w = torch.nn.Parameter(torch.ones(3))
    old = adamw([w], lr=1e-3, weight_decay=0.0)
    w.grad = torch.ones(3)
    old.step()
    saved = old.state_dict()
    new = adamw([w], lr=0.5, weight_decay=0.1)
    sharding.load_optimizer(new, saved)
    assert (new.param_groups[0]["lr"], new.param_groups[0]["weight_decay"]) == (0.5, 0.1)
    assert torch.equal(new.state[w]["exp_avg"], old.state[w]["exp_avg"]) and float(new.state[w]["step"]) == 1


def test_planted_symlinks_are_never_followed(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["train", "--config", TINY, "steps=1", f"out_dir={out}"]) == 0
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    ckpts = out / "checkpoints"
    for name in (".latest.tmp", ".step_000002.tmp", ".step_000002.tmp.d", "latest"):
        target = ckpts / name
        if os.path.lexists(target):
            target.unlink()
        target.symlink_to(victim)
    (ckpts / ".step_000003.x").symlink_to(tmp_path, target_is_directory=True)
    assert main(["train", "--resume", f"out_dir={out}", "steps=2"]) == 0
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r", "victim.txt"]
    assert (ckpts / "latest").read_text() == "step_000002\n" and not (ckpts / "latest").is_symlink()
    # a link planted at metrics.jsonl is replaced by the resumed run's own file, never written through
    (out / "metrics.jsonl").unlink()
    (out / "metrics.jsonl").symlink_to(victim)
    assert main(["train", "--resume", f"out_dir={out}", "steps=3"]) == 0
    assert victim.read_text() == "precious\n" and not (out / "metrics.jsonl").is_symlink()


def test_appends_and_checkpoint_folders_refuse_links(tmp_path, capsys):
    from hetrl.trainer import files

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(ValueError, match="is a symbolic link"):
        files.append_line(tmp_path / "metrics.jsonl", "{}\n")
    assert victim.read_text() == "precious\n"
    out = tmp_path / "r"
    out.mkdir()
    (out / "checkpoints").symlink_to(tmp_path, target_is_directory=True)
    assert main(["train", "--config", TINY, "steps=1", f"out_dir={out}"]) == 2
    assert "checkpoints is a symbolic link; hetrl writes only inside out_dir" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ kill -9

_KILLER = """
import os, signal, sys
sys.argv = ["hetrl"] + sys.argv[2:]
at = int(os.environ["KILL_AT_REPLACE"])
calls = [0]
real = os.replace
def replace(*args, **kwargs):
    calls[0] += 1
    if calls[0] == at:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)
os.replace = replace
from hetrl.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _hetrl(args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-c", _KILLER, "--", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "KILL_AT_REPLACE": "0", **(env or {})})


def _renames_in_a_run(tmp_path) -> int:
    """How many os.replace calls one whole tiny run makes (every atomic write and checkpoint rename)."""
    probe = _KILLER.replace("if calls[0] == at:", "if False:") + ""
    out = tmp_path / "count"
    code = probe.replace("sys.exit(main(sys.argv[1:]))", "rc = main(sys.argv[1:]); print('REPLACES', calls[0]); "
                                                          "sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code, "--", "train", "--config", TINY, f"out_dir={out}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "KILL_AT_REPLACE": "0"})
    assert p.returncode == 0, p.stderr
    return int(p.stdout.split("REPLACES")[-1].split()[0])


def _kill_and_resume(tmp_path, straight, at: int):
    out = tmp_path / f"killed_at_{at}"
    p = _hetrl(["train", "--config", TINY, f"out_dir={out}"], {"KILL_AT_REPLACE": str(at)})
    assert p.returncode == -signal.SIGKILL, f"the run was not killed at rename {at}: {p.stderr[-500:]}"
    # killed before the run's config was on disk (the very first rename): nothing ran; the original command
    # starts it (--resume is refused there with a message, since it cannot know the config)
    r = _hetrl(["train", "--resume", f"out_dir={out}"]) if (out / "run_config.yaml").exists() else \
        _hetrl(["train", "--config", TINY, f"out_dir={out}"])
    assert r.returncode == 0, f"killed at rename {at}, the resume failed: {r.stderr[-800:]}"
    assert _rows(out) == _rows(straight), f"killed at rename {at}"
    assert _same_weights(_weights(out, 3), _weights(straight, 3)), f"killed at rename {at}"
    assert json.loads((out / "summary.json").read_text())["steps"] == 3


@pytest.mark.slow   # 46 s: kill -9 at each point of the final checkpoint (the default suite stays under 10 min)
def test_kill_9_during_the_final_checkpoint_leaves_a_resumable_run(tmp_path, straight):
    """The last renames of a run are the final checkpoint's (its directory, `latest`), the summary's and the
    plot's: a SIGKILL at each of them, then `--resume`, ends with the uninterrupted run's rows and weights. (The
    slow suite does this at every rename of the run; each case here costs two fresh processes.)"""
    total = _renames_in_a_run(tmp_path)
    for at in range(max(1, total - 3), total + 1):
        _kill_and_resume(tmp_path, straight, at)


@pytest.mark.slow
def test_kill_9_at_every_rename_and_at_random_moments(tmp_path, straight):
    total = _renames_in_a_run(tmp_path)
    for at in range(1, total + 1):
        _kill_and_resume(tmp_path, straight, at)
    rng = random.Random(0)
    for k in range(4):
        out = tmp_path / f"random_{k}"
        proc = subprocess.Popen([sys.executable, "-m", "hetrl", "train", "--config", TINY, f"out_dir={out}"],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(3.0, 12.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        r = _hetrl(["train", "--resume", f"out_dir={out}"]) if (out / "run_config.yaml").exists() else \
            _hetrl(["train", "--config", TINY, f"out_dir={out}"])
        assert r.returncode == 0, r.stderr[-800:]
        assert _rows(out) == _rows(straight)
        assert _same_weights(_weights(out, 3), _weights(straight, 3))


def test_resume_of_a_finished_run_does_nothing_and_past_steps_or_a_missing_out_dir_is_refused(tmp_path, capsys,
                                                                                               straight):
    """A finished run resumed again evaluated again and appended a second final row to eval.jsonl: now it says
    so and only draws the plot again (the one file written after summary.json); a checkpoint past `steps` would be
    rewritten as a shorter run; a missing out_dir would be created just to be refused."""
    import shutil

    out = tmp_path / "r"
    shutil.copytree(straight, out)
    evals = (out / "eval.jsonl").read_text()
    (out / "curves.png").unlink()
    capsys.readouterr()
    assert main(["train", "--resume", f"out_dir={out}"]) == 0
    assert "already finished its 3 steps and its final evaluation" in capsys.readouterr().out
    assert (out / "curves.png").is_file() and (out / "eval.jsonl").read_text() == evals
    assert main(["train", "--resume", f"out_dir={out}", "steps=2"]) == 2
    assert "at step 3, past steps=2" in capsys.readouterr().err
    assert (out / "eval.jsonl").read_text() == evals
    missing = tmp_path / "nowhere" / "run"
    assert main(["train", "--resume", f"out_dir={missing}"]) == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "nowhere").exists()


def test_what_a_run_writes_is_readable_as_open_would_make_it(straight):
    """Files written under a temporary name (mkstemp: 0600) and folders (mkdtemp: 0700) get the mode open() and
    mkdir() give under the umask, as metrics.jsonl has: a teammate or a dashboard can read the whole run."""
    mask = os.umask(0o022)
    os.umask(mask)
    for name in ("metrics.jsonl", "summary.json", "run_config.yaml", "curves.png", "eval_step_3.jsonl",
                 "checkpoints/step_000003/model.safetensors", "checkpoints/step_000003/trainer_state.pt"):
        assert (straight / name).stat().st_mode & 0o777 == 0o666 & ~mask, name
    assert (straight / "checkpoints" / "step_000003").stat().st_mode & 0o777 == 0o777 & ~mask


def test_keep_checkpoints_keeps_the_newest_and_the_run_still_resumes(tmp_path, capsys, straight):
    out = tmp_path / "r"
    assert main(["train", "--config", TINY, "steps=2", "keep_checkpoints=1", f"out_dir={out}"]) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_")) == ["step_000002"]
    assert main(["train", "--resume", f"out_dir={out}", "steps=3"]) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_")) == ["step_000003"]
    assert _rows(out) == _rows(straight)
    assert _same_weights(_weights(out, 3), _weights(straight, 3))
