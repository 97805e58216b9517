"""A run on a local (emulated) Ray writes nothing outside out_dir: not Ray's auth token in $HOME (its token lives
in the Ray processes' environment), and not the short session directory a deep out_dir needs (removed at exit)."""

import json
import pathlib
import tempfile

import pytest

pytest.importorskip("ray")

from hetrl.cli import main  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = pathlib.Path(__file__).parents[2]


def test_an_emulated_ray_run_leaves_nothing_in_home_or_tmp(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    temp = pathlib.Path(tempfile.gettempdir())
    before = set(temp.glob("hetrl-ray-*"))
    out = tmp_path / ("d" * 80)     # too deep for Ray's unix sockets: a short session directory of its own
    assert main(["train", "--config", str(ROOT / "examples" / "runs" / "tiny.yaml"), "executor=ray",
                 f"emulate_cluster={ROOT / 'examples' / 'clusters' / 'cpu-2x2.yaml'}", "steps=1", "eval_size=4",
                 "checkpoint_every=0", f"out_dir={out}"]) == 0
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert not (home / ".ray").exists()     # (matplotlib may make its font cache there: that is not Ray's)
    assert set(temp.glob("hetrl-ray-*")) == before
