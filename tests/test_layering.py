"""Imports go one way: trainer -> {dualkv, planner, algo, data}; those never import each other, trainer or ray,
and planner never imports torch; hetrl.schema (the validation layer) imports no other hetrl package. Checked in a
fresh interpreter so that nothing is already loaded."""

import importlib.util
import json
import subprocess
import sys

import pytest

FORBIDDEN = {
    "hetrl.dualkv": {"hetrl.planner", "hetrl.algo", "hetrl.data", "hetrl.trainer", "ray"},
    "hetrl.planner": {"hetrl.dualkv", "hetrl.algo", "hetrl.data", "hetrl.trainer", "ray", "torch", "transformers"},
    "hetrl.algo": {"hetrl.dualkv", "hetrl.planner", "hetrl.data", "hetrl.trainer", "ray", "transformers"},
    # prompts and rewards: no model code (a reward worker process imports only this and the user's module)
    "hetrl.data": {"hetrl.dualkv", "hetrl.planner", "hetrl.algo", "hetrl.trainer", "hetrl.models", "ray", "torch",
                   "transformers"},
    # plan export / import: the planner and the validation layer only (no model code, no engines)
    "hetrl.integrations.export": {"hetrl.dualkv", "hetrl.algo", "hetrl.data", "hetrl.trainer", "hetrl.models", "ray",
                                  "torch", "transformers", "verl", "openrlhf", "hydra"},
    # the validation layer every package uses: a leaf (yaml and the standard library)
    "hetrl.schema": {"hetrl.dualkv", "hetrl.planner", "hetrl.algo", "hetrl.data", "hetrl.trainer", "hetrl.models",
                     "ray", "torch", "transformers"},
}
PRESENT = [name for name in FORBIDDEN if importlib.util.find_spec(name) is not None]


def _modules_loaded_by(package: str) -> set[str]:
    code = f"import json, sys, {package}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


def test_dualkv_is_present():
    assert "hetrl.dualkv" in PRESENT


@pytest.mark.parametrize("package", PRESENT)
def test_one_way_imports(package):
    loaded = _modules_loaded_by(package)
    bad = {m for m in loaded for f in FORBIDDEN[package] if m == f or m.startswith(f + ".")}
    assert not bad, f"{package} imports {sorted(bad)}"


def test_the_local_trainer_does_not_load_ray():
    """`hetrl train` with the default local executor should not pay for importing Ray."""
    assert not {m for m in _modules_loaded_by("hetrl.trainer.run") if m == "ray" or m.startswith("ray.")}


def test_the_ray_engine_does_not_import_the_loop():
    """run -> loop -> engine -> (ray_executor, lazily): the Ray engine needs only the Engine contract, never the run's
    entry or the loop."""
    loaded = _modules_loaded_by("hetrl.trainer.ray_executor")
    assert not loaded & {"hetrl.trainer.run", "hetrl.trainer.loop", "hetrl.trainer.engine"}
