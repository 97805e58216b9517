"""Every `hetrl train` command the README and docs/ show runs, as written, for one tiny step in the precision a CPU
with bf16 instructions gets (`precision=auto` -> bf16-mixed): the class of bug a user with such a CPU hits first (the
agent demo once crashed there while the suite, pinned to fp32, passed). The commands are read from the pages
themselves, so a command added there is tried here; only the tiny-model sizes and the output folder are added after
it. Commands naming a file of the user's (`--config RUN.yaml`, `cluster=my-cluster.yaml`) are left out."""

from __future__ import annotations

import json
import pathlib
import re
import shlex

import pytest

from hetrl.cli import main

ROOT = pathlib.Path(__file__).parents[1]
TINY = ["model=tiny", "steps=1", "prompts_per_step=2", "responses_per_prompt=4", "mini_batches=1",
        "max_new_tokens=8", "eval_size=2", "eval_max_new_tokens=8", "checkpoint_every=0",
        "max_prompt_tokens=1024", "micro_batch_tokens=2048"]


def train_commands(text: str) -> list[str]:
    """The `hetrl train ...` commands of a page's bash blocks and inline code, comments and continuations
    removed; placeholders (`...`) and `--resume` (it needs a run to resume) left out."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            found += [p.strip() for p in line.split(" #")[0].split("&&")]
    found += [p.strip() for code in re.findall(r"`([^`\n]+)`", text) for p in code.split("&&")]
    cmds = []
    for c in found:
        c = " ".join(c.split())
        if c.startswith("hetrl train") and "..." not in c and "--resume" not in c and c not in cmds:
            cmds.append(c)
    return cmds


def _names_a_users_file(cmd: str) -> bool:
    for arg in shlex.split(cmd)[2:]:
        path = arg.split("=", 1)[-1].split(":")[0]
        if path.endswith((".yaml", ".json", ".jsonl", ".parquet", ".py")) and not (ROOT / path).exists():
            return True
    return False


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMANDS = [c for page in PAGES for c in train_commands(page.read_text()) if not _names_a_users_file(c)]
COMMANDS = list(dict.fromkeys(COMMANDS))


def _marks(cmd: str):
    if "executor=ray" in cmd:
        return [pytest.mark.slow]
    if "rollout_engine=vllm" in cmd:
        return [pytest.mark.vllm]
    return []


def test_the_documented_commands_are_found():
    assert COMMANDS[0] == "hetrl train"
    assert any("tools.yaml" in c for c in COMMANDS) and any("executor=ray" in c for c in COMMANDS)
    assert not any("RUN.yaml" in c or "my-cluster.yaml" in c for c in COMMANDS)
    assert train_commands("```bash\nhetrl train a=1 \\\n  b=2   # note\nhetrl train ... x=1\n```\n"
                                 "`bash scripts/install.sh && hetrl train c=3`") == \
        ["hetrl train a=1 b=2", "hetrl train c=3"]


@pytest.mark.parametrize("cmd", [pytest.param(c, marks=_marks(c), id=c[len("hetrl train"):].strip() or "default")
                                 for c in COMMANDS])
def test_a_documented_train_command_runs_a_step_under_bf16_auto(cmd, tmp_path, monkeypatch):
    if "rollout_engine=vllm" in cmd:
        pytest.importorskip("vllm")
    if "executor=ray" in cmd:
        pytest.importorskip("ray")
    monkeypatch.chdir(ROOT)                       # the README's paths are relative to the clone
    monkeypatch.setenv("HETRL_CPU_BF16", "1")     # what a CPU with bf16 instructions says
    out = tmp_path / "run"
    graded = [] if "reward=" in cmd or "--config" in cmd else ["reward=partial"]  # groups that differ: an update
    assert main(shlex.split(cmd)[1:] + TINY + graded + [f"out_dir={out}"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["precision"] == "bf16-mixed"
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    if "loss" not in row:                        # a step with nothing to learn from (DAPO kept no group) is no crash
        assert row["groups_kept"] == 0
    else:
        assert row["loss"] == row["loss"]
