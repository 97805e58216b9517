"""The GPU issue's prepared call (`scripts/gpu_session.sh all`), smoke-tested on the CPU at tiny sizes in the default
suite so that it cannot rot between lent GPUs: every stage runs, each writes what it measured, at most 8 files come
back, and it runs without what the device machine lacks (Ray, vLLM, datasets, TRL, verl, OpenRLHF made
unimportable): the first lent GPU lost stage a's `pytest -m gpu` to two modules importing Ray and `datasets` at the
top, so collection stopped before any GPU test ran."""

import csv
import json
import os
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).parents[1]

# what the device machine lacks (../shared/GPU.md: no Ray, vLLM, registry; TRL, verl, datasets not carried)
ABSENT_ON_DEVICE = ("ray", "vllm", "datasets", "trl", "verl", "openrlhf")


def _without_what_the_device_lacks(folder: pathlib.Path) -> str:
    """A PYTHONPATH entry whose sitecustomize makes ABSENT_ON_DEVICE unimportable (and unfound by find_spec)."""
    (folder / "sitecustomize.py").write_text(
        "import sys\n"
        f"ABSENT = {ABSENT_ON_DEVICE!r}\n"
        "class _Absent:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ABSENT:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _Absent())\n"
        "import importlib.util\n"
        "_find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, package=None: (None if name.split('.')[0] in ABSENT\n"
        "                                                       else _find(name, package))\n")
    return str(folder)


def test_the_prepared_gpu_call_runs_every_stage_on_cpu_without_what_the_device_lacks(tmp_path):
    out, site = tmp_path / "out", tmp_path / "site"
    site.mkdir()
    env = dict(os.environ, OUT=str(out), GPU_SESSION_DEVICE="cpu", A_S="90", B_S="150", C_S="90", D_S="40",
               PYTHONPATH=_without_what_the_device_lacks(site))
    done = subprocess.run(["bash", "scripts/gpu_session.sh", "all"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # stage a: `pytest -m gpu` collected every module (GPU tests skip on a CPU; a collection error exits 2)
    assert "pytest -m gpu: exit 0 " in done.stdout, done.stdout[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8, files
    assert {"machine.txt", "summary.txt", "logs.tgz", "train_split_cpu.json", "dualkv_layer_tiny_cpu.json",
            "operators_cpu.csv", "operators_cpu.json"} <= set(files), files
    assert "gpu_session all:" in done.stdout     # the summary, printed last
    runs = json.loads((out / "train_split_cpu.json").read_text())["runs"]          # stage b: a run finished
    assert runs and all(r["profile"]["top"] for r in runs.values())                  # its last step profiled
    assert json.loads((out / "dualkv_layer_tiny_cpu.json").read_text())["rows"]    # stage c: its cells
    rows = list(csv.DictReader((out / "operators_cpu.csv").open()))               # stage d: the tables
    assert {r["op"] for r in rows} == {"copy", "gemm", "attention_decode", "attention_prefill", "attention_train",
                                       "moe_layer", "decode_step"}
    assert all(float(r["seconds"]) > 0 and r["source"].startswith("measured: CPU") for r in rows)


def test_the_absent_packages_are_absent(tmp_path):
    """The smoke test's premise: under its PYTHONPATH, each package the device lacks fails to import."""
    env = dict(os.environ, PYTHONPATH=_without_what_the_device_lacks(tmp_path))
    code = ("import importlib, importlib.util\n"
            f"for name in {ABSENT_ON_DEVICE!r}:\n"
            "    assert importlib.util.find_spec(name) is None, name\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except ModuleNotFoundError:\n"
            "        continue\n"
            "    raise AssertionError(name)\n"
            "import torch, transformers\n")
    done = subprocess.run(["python", "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
