"""`hetrl plan --evaluate` accepts every published run that happened: the 19 of cost_model_validation.py and the
45 of benchmarks/published_runs.yaml, written in hetrl's formats, all evaluate (none refused as out of memory),
through the CLI's own path (plan_from_dict + estimate) and through the CLI itself for one MoE / EP run."""

import importlib.util
import json
import pathlib

import pytest

from hetrl.planner import estimate
from hetrl.planner.plan import plan_from_dict
from hetrl.planner.spec import cluster_from_dict, workload_from_dict

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("cmv", ROOT / "benchmarks" / "cost_model_validation.py")
cmv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cmv)
RUNS = cmv.nemo_rl_runs() + cmv.longreason_runs() + cmv.moe_runs() + cmv.gsm8k_runs() + cmv.published_runs()


def test_the_list_is_wide_enough():
    new = [r for r in RUNS if r.get("new")]
    assert len(RUNS) >= 25 and len(new) == 45
    assert len({r["system"] for r in RUNS}) >= 5
    moe = [r for r in RUNS if workload_from_dict(r["workload"], r["run"]).actor.experts]
    assert len(moe) >= 5
    assert sum(r.get("engine") == "megatron" for r in new) >= 5


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r["run"])
def test_every_published_run_evaluates(run):
    c = cluster_from_dict(run["cluster"], run["run"])
    w = workload_from_dict(run["workload"], run["run"])
    e = estimate(c, w, plan_from_dict(run["plan"], c, w, run["run"]))
    assert e.feasible, e.reason
    assert e.iteration_time_s > 0


def test_cli_evaluates_an_expert_parallel_run(tmp_path, capsys):
    import yaml

    from hetrl.cli import main
    run = next(r for r in RUNS if r["run"] == "nemorl-v05-qwen3-30b-a3b-onpolicy-32xh100")
    for name, data in (("cluster.yaml", run["cluster"]), ("workload.yaml", run["workload"])):
        (tmp_path / name).write_text(yaml.safe_dump(data))
    (tmp_path / "plan.json").write_text(json.dumps(run["plan"]))
    assert main(["plan", "--cluster", str(tmp_path / "cluster.yaml"), "--workload", str(tmp_path / "workload.yaml"),
                 "--evaluate", str(tmp_path / "plan.json"), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["plan"]["groups"][0]["parallelism"]["actor_train"]["ep"] == 8
    assert r["breakdown"]["ep_comm"] > 0 and r["iteration_time_s"] > 0
