"""`hetrl plan --export ENGINE --out DIR` and `hetrl plan --import verl DIR`: the one entry point per direction."""

from __future__ import annotations

import os

from hetrl.planner import evaluate
from hetrl.planner.plan import Plan, plan_from_dict
from hetrl.planner.spec import cluster_from_dict, workload_from_dict
from hetrl.schema import InputError, choice_error, read_yaml

from . import ENGINES
from .common import check_out_dir, check_plan, common_files, predict, report_of, summary, write_folder


def _engine(name: str):
    if name == "verl":
        from . import verl
        return verl
    if name == "openrlhf":
        from . import openrlhf
        return openrlhf
    raise InputError(f"--export: {choice_error('an engine', name, ENGINES)}")


def export(engine: str, cluster_path: str, workload_path: str, plan: Plan | dict, out_dir: str) -> dict:
    """Check the plan (refused before anything is written), build the engine's view of it, predict both, write
    the folder. `plan` is a Plan or a plan dict (`hetrl plan --json` output or a plan JSON). Returns the report
    (with `summary`, the text the CLI prints)."""
    mod = _engine(engine)
    cluster_yaml, workload_yaml = read_yaml(cluster_path, "cluster YAML"), read_yaml(workload_path, "workload YAML")
    cluster = cluster_from_dict(cluster_yaml, cluster_path)
    w = workload_from_dict(workload_yaml, workload_path)
    if not isinstance(plan, Plan):
        plan = plan_from_dict(plan, cluster, w)
    check_out_dir(out_dir)
    plan_s = check_plan(cluster, w, plan)
    v = mod.view(cluster, w, plan)
    engine_s, why = predict(cluster, v)
    text = summary(v, plan_s, engine_s, why, out_dir)
    report = report_of(v, plan_s, engine_s, why)
    files = common_files(cluster_yaml, workload_yaml, plan, v, cluster, report) | mod.render(cluster, v, text)
    write_folder(out_dir, files, executable=("run.sh",))
    return report | {"summary": text}


def import_plan(engine: str, folder: str) -> dict:
    """A hetrl plan from an export folder's engine settings, scored: what `hetrl plan --import` prints."""
    if engine == "openrlhf":
        raise InputError("--import: only verl exports can be read back; an OpenRLHF command line does not say "
                         "which GPUs each role runs on")
    if engine != "verl":
        raise InputError(f"--import: engine must be verl (the one whose exports can be read back), got {engine!r}")
    if not os.path.isdir(folder):
        raise InputError(f"--import verl {folder}: not a folder; give one written by `hetrl plan --export verl`")
    from . import verl
    cluster, w, plan = verl.read(folder)
    e = evaluate(cluster, w, plan)
    if not e.feasible:
        raise InputError(f"{folder}: the imported plan cannot run: {e.reason}")
    samples_s, tokens_s = e.throughput(w)
    return {"method": "import", "iteration_time_s": e.iteration_time_s, "samples_per_s": samples_s,
            "tokens_per_s": tokens_s, "search_time_s": 0.0, "breakdown": e.breakdown,
            "task_times_s": e.task_times_s, "plan": plan.to_dict(cluster), "cluster": cluster.name,
            "workload": os.path.join(folder, "engine_workload.yaml"), "baselines": {}}
