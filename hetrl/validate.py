"""`hetrl validate FILE...`: check any hetrl input without running it, through the same loaders the commands use.

The kind of file is told by its form: a `.json` file is a plan; a YAML with `nodes` is a cluster, with `models`
a workload, anything else a run config. A run config's own files (cluster, emulate_cluster, plan, a local
model directory, data and eval_data, the reward functions it names) are checked too. Each check returns a short
description of what it read; a problem raises the same one-line error `hetrl plan` / `hetrl train` would.
"""

from __future__ import annotations

from hetrl.schema import InputError, read_json, read_yaml


def validate_file(path: str, cluster: str | None = None, workload: str | None = None,
                  overrides: list[str] = ()) -> str:
    """-> a short description of the valid file at `path`; raises InputError (one line) otherwise. `overrides`:
    key=value for a run config, as hetrl train's command line gives them (refused for other files)."""
    if overrides and not path.endswith((".yaml", ".yml")):
        raise InputError(f"{path}: key=value overrides ({', '.join(overrides)}) apply to run configs, not to a plan",
                         located=True)
    from hetrl.planner import load_cluster, load_workload
    from hetrl.planner.plan import check_form, load_plan, plan_shape
    from hetrl.planner.spec import cluster_from_dict, workload_from_dict

    if path.endswith(".json"):
        if bool(cluster) != bool(workload):
            raise InputError("a plan is checked against a cluster and a workload together: give both --cluster and "
                             "--workload, or neither (its form only)", located=True)
        if cluster and workload:
            from hetrl.planner import evaluate

            c, w = load_cluster(cluster), load_workload(workload)
            p = load_plan(path, c, w)
            e = evaluate(c, w, p)   # what `hetrl plan --evaluate` refuses: it does not fit
            if not e.feasible:
                raise InputError(f"{path}: the plan cannot run on {cluster} with {workload}: {e.reason}",
                                 located=True)
            return (f"plan: {len(p.groups)} group(s), fits {cluster} with {workload} (cost model: "
                    f"{e.iteration_time_s:.3g} s per iteration)")
        data = read_json(path, "plan JSON")
        p = plan_shape(data, path)
        plan_data = data["plan"] if "plan" in data and "groups" not in data else data
        names = list(dict.fromkeys(n for g in plan_data["groups"] for n in g["gpus"]))   # plan_shape's numbering
        try:
            check_form(p, lambda i: names[i])
        except ValueError as e:
            raise InputError(f"{path}: {e}", located=True) from None
        return (f"plan: {len(p.groups)} group(s); its form only (add --cluster C.yaml --workload W.yaml to check "
                "GPU names, tasks and memory)")
    if not path.endswith((".yaml", ".yml")):
        raise InputError(f"{path}: cannot tell what it is; hetrl reads cluster, workload and run configs as .yaml "
                         "and plans as .json", located=True)
    data = read_yaml(path)
    if overrides and ("nodes" in data or "models" in data):
        raise InputError(f"{path}: key=value overrides ({', '.join(overrides)}) apply to run configs, not to a "
                         f"{'cluster' if 'nodes' in data else 'workload'}", located=True)
    if "nodes" in data:
        c = cluster_from_dict(data, path)
        return (f"cluster {c.name}: {len(c.gpus)} GPUs on {len(c.nodes)} node(s) in "
                f"{len({n.region for n in c.nodes})} region(s)")
    if "models" in data:
        w = workload_from_dict(data, path)
        return f"workload: {w.algorithm} {w.mode}, actor {w.actor.name}, {w.samples} samples per step"
    return _validate_run_config(path, overrides)


def _validate_run_config(path: str, overrides: list[str] = ()) -> str:
    from hetrl.models import unknown_model
    from hetrl.planner import load_cluster
    from hetrl.planner.plan import plan_shape
    from hetrl.trainer.config import load_config

    cfg = load_config(path, list(overrides))
    cluster = None
    for key in ("cluster", "emulate_cluster"):
        if getattr(cfg, key):
            cluster = load_cluster(getattr(cfg, key))
    if cfg.plan:
        if cluster is not None:   # GPU names and shape (the tasks depend on the model, read at run time)
            plan_shape(read_json(cfg.plan, "plan JSON"), cfg.plan, {g.name: g.id for g in cluster.gpus}, cluster)
        else:
            plan_shape(read_json(cfg.plan, "plan JSON"), cfg.plan)
    why = unknown_model(cfg.model)
    if why:
        raise InputError(f"{path}: {why}", located=True)
    from hetrl.trainer.metrics import check_tracker
    from hetrl.trainer.precision import driver_device

    # what `hetrl train` refuses first, on this machine: device=cuda without CUDA, impl=flex on the CPU, report_to
    # without its package
    try:
        driver_device(cfg)
        check_tracker(cfg.report_to)
    except ValueError as e:
        raise InputError(f"{path}: {e} (checked on this machine)", located=True) from None
    # the same checks `hetrl train` makes before the model loads (run.up_front): every file and every reward is
    # checked, and all their problems are said together
    from hetrl.data.sources import input_problems

    problems, rows = input_problems(cfg, list(cfg.rewards))
    if cfg.tool_specs or cfg.environment is not None:   # the tools and environment the run names (import, schemas)
        from hetrl.data.tools import check_environment, load_environment, load_tools

        for spec in cfg.tool_specs:
            try:
                load_tools(spec)
            except InputError as e:
                problems.append(str(e))
        if cfg.environment is not None:
            try:
                check_environment(load_environment(cfg.environment))
            except InputError as e:
                problems.append(str(e))
    if problems:
        raise InputError(f"{path}: " + "; ".join(problems), located=True)
    data = f", {len(rows['data'])} rows of {cfg.data}" if "data" in rows else ""
    return f"run config: {cfg.algorithm} on {cfg.model}, {cfg.steps} steps, executor {cfg.executor}{data}"

