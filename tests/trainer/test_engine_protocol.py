"""The loop calls nothing of an engine beyond the written `Engine` protocol (hetrl/trainer/engine.py): a run
through an engine that offers exactly the protocol's members is the run through LocalEngine itself."""

import json
import pathlib

from hetrl.cli import main
from hetrl.trainer import run
from hetrl.trainer.engine import Engine
from hetrl.trainer.metrics import TIMING_KEYS

TINY = str(pathlib.Path(__file__).parents[2] / "examples" / "runs" / "tiny.yaml")
PROTOCOL = set(Engine.__annotations__) | {k for k, v in vars(Engine).items() if callable(v) and not k.startswith("_")}


class OnlyTheProtocol:
    """The engine's protocol members and nothing else: anything more the loop asked for would be an AttributeError."""

    __slots__ = tuple(PROTOCOL)

    def __init__(self, engine):
        for name in PROTOCOL:
            setattr(self, name, getattr(engine, name))


def _rows(out):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_run_needs_nothing_of_its_engine_beyond_the_protocol(tmp_path, monkeypatch):
    (tmp_path / "spread.py").write_text("def distinct(completions, **kwargs):\n"
                                        "    return [len(set(c[-1]['content'])) / 8 for c in completions]\n")
    args = ["train", "--config", TINY, "steps=2", "eval_size=8", "checkpoint_every=0", "algorithm=ppo",
            f"reward=[partial, {tmp_path / 'spread.py'}:distinct]"]
    assert {"worker", "learner", "reference", "critic", "episodes", "rollout_logprobs", "precision", "phase_seconds",
            "sync_weights", "save", "load", "save_merged", "close"} <= PROTOCOL
    assert main([*args, f"out_dir={tmp_path / 'local'}"]) == 0
    made = run.make_engine
    monkeypatch.setattr(run, "make_engine", lambda *a, **k: OnlyTheProtocol(made(*a, **k)))
    assert main([*args, f"out_dir={tmp_path / 'protocol'}"]) == 0
    assert _rows(tmp_path / "protocol") == _rows(tmp_path / "local")
    assert any(r["loss"] != 0 for r in _rows(tmp_path / "local")) and "value_loss" in _rows(tmp_path / "local")[0]
