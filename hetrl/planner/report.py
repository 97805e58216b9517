"""`hetrl plan`: run the search (or score a given plan), compare with the baselines, report as JSON or a table."""

from __future__ import annotations

import json
import math
import os
import tempfile

from hetrl.fsmode import as_open_would
from hetrl.schema import InputError

from . import METHODS, evaluate, optables, plan
from .plan import load_plan
from .search import exhaustive_size
from .spec import ROLES, ClusterSpec, WorkloadSpec, load_cluster, load_workload

BASELINES = ("verl", "verl-all", "streamrl")


def _entry(cluster: ClusterSpec, w: WorkloadSpec, method: str, p, search_s: float, gap=None, stopped=None) -> dict:
    e = evaluate(cluster, w, p)
    if not e.feasible:
        raise ValueError(f"{method}: the plan cannot run: {e.reason}")
    samples_s, tokens_s = e.throughput(w)
    return {"method": method, "iteration_time_s": e.iteration_time_s, "samples_per_s": samples_s,
            "tokens_per_s": tokens_s, "search_time_s": search_s, "optimality_gap": gap, "stopped": stopped,
            "breakdown": e.breakdown, "task_times_s": e.task_times_s, "timeline": e.timeline,
            "hardware": [_hardware(cluster, g) for g in p.groups], "mode": w.mode, "plan": p.to_dict(cluster),
            "operator_tables": optables.pricing(dict.fromkeys(cluster.gpus[i].type for g in p.groups
                                                              for i in g.gpus),
                                                moe=any(getattr(w, role) is not None and getattr(w, role).experts
                                                        for role in ROLES))}


def _hardware(cluster: ClusterSpec, group) -> list[dict]:
    """A group's GPUs by (type, region): [{"gpu", "region", "count"}], in the order first met."""
    out: dict[tuple[str, str], int] = {}
    for i in group.gpus:
        g = cluster.gpus[i]
        key = (g.type.name, g.region)
        out[key] = out.get(key, 0) + 1
    return [{"gpu": gpu, "region": region, "count": n} for (gpu, region), n in out.items()]


def _methods_for(cluster, w, method: str) -> list[str]:
    if method != "all":
        return [method]
    out = ["hybrid", "ilp"]
    if exhaustive_size(cluster, w) <= 20_000:
        out.append("exhaustive")
    return out


def load_measured(path: str, tasks) -> dict[str, float]:
    """{task or "iteration": seconds} from a JSON or YAML file of measured times, each a positive number and each
    key one of the plan's tasks or "iteration"."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)   # JSON is YAML
    except OSError as e:
        raise InputError(f"--measured {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise InputError(f"--measured {path}: not JSON or YAML ({str(e).splitlines()[0]})") from None
    known = [*tasks, "iteration"]
    if not isinstance(data, dict) or not data:
        raise InputError(f"--measured {path}: expected a mapping of seconds by task, e.g. "
                         '{"actor_gen": 58.0, "iteration": 112}; known keys: ' + ", ".join(known))
    out = {}
    for k, v in data.items():
        if k not in known:
            raise InputError(f"--measured {path}: {k!r} is not a task of this plan; known: {', '.join(known)}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v == math.inf:
            raise InputError(f"--measured {path}: {k} must be a positive number of seconds, got {v!r}")
        out[k] = float(v)
    return out


def plan_report(cluster_path: str, workload_path: str, method: str = "hybrid", *, seed: int | None = None,
                time_limit_s: float | None = None, evaluate_path: str | None = None,
                measured_path: str | None = None) -> dict:
    """The object `hetrl plan --json` prints: the chosen plan with its numbers, plus the baselines (and, with
    `measured_path`, the measured times of the evaluated plan)."""
    cluster, w = load_cluster(cluster_path), load_workload(workload_path)
    if method != "all" and method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join([*METHODS, 'all'])}, got {method!r}")
    results = {}
    if evaluate_path:
        given = load_plan(evaluate_path, cluster, w)
        results["evaluate"] = _entry(cluster, w, "evaluate", given, 0.0)
        if measured_path:
            results["evaluate"]["measured"] = load_measured(measured_path, [t for g in given.groups for t in g.tasks])
    else:
        for m in _methods_for(cluster, w, method):
            r = plan(cluster, w, m, seed=seed if m == "hybrid" else None, time_limit_s=time_limit_s)
            results[m] = _entry(cluster, w, m, r.plan, r.search_time_s, r.optimality_gap, r.stopped)
    best = min(results.values(), key=lambda r: r["iteration_time_s"])
    report = dict(best)
    report["cluster"], report["workload"] = cluster.name, os.path.basename(workload_path)
    if len(results) > 1:
        report["methods"] = {k: {"iteration_time_s": v["iteration_time_s"], "search_time_s": v["search_time_s"],
                                 "optimality_gap": v["optimality_gap"], "stopped": v["stopped"]}
                             for k, v in results.items()}
    report["baselines"] = {}
    for b in BASELINES:
        try:
            r = plan(cluster, w, b)
            report["baselines"][b] = {"iteration_time_s": r.iteration_time_s, "plan": r.plan.to_dict(cluster),
                                      "speedup": r.iteration_time_s / report["iteration_time_s"]}
        except ValueError as e:
            report["baselines"][b] = {"iteration_time_s": None, "plan": None, "error": str(e)}   # JSON has no inf
    return report


def check_output_path(path: str, flag: str = "--out", example: str | None = None) -> None:
    """Refuse an output file (`flag`: --out or --png) that cannot be written (a directory, a missing or read-only
    folder, a file where a folder should be) before any search or run; `example`: a file name for the hint."""
    folder = os.path.dirname(os.path.abspath(path))
    example = example or ("plan.png" if flag == "--png" else "plan.json")
    below = _file_in_the_way(folder)
    if below is not None:
        raise InputError(f"{flag} {path}: {below} is a file, not a folder")
    if os.path.isdir(path):
        raise InputError(f"{flag} {path} is a directory; give a file name, e.g. {os.path.join(path, example)}")
    if not os.path.isdir(folder):
        raise InputError(f"{flag} {path}: the folder {folder} does not exist; create it first (mkdir -p {folder})")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: the folder {folder} is not writable by this user")


def _file_in_the_way(folder: str) -> str | None:
    """The outermost of `folder` and the folders above it that exists and is not a folder (None: none is)."""
    chain = [os.path.abspath(folder)]
    while os.path.dirname(chain[-1]) != chain[-1]:
        chain.append(os.path.dirname(chain[-1]))
    return next((p for p in reversed(chain) if os.path.lexists(p) and not os.path.isdir(p)), None)


def check_output_dir(path: str, flag: str = "--out") -> None:
    """Refuse an output folder that is a file, or lies below one, before a benchmark runs."""
    below = _file_in_the_way(path)
    if below is not None:
        raise InputError(f"{flag} {path}: {below} is a file; {flag} names a folder for the results")


def write_json(report: dict, path: str) -> None:
    """Write under a fresh temporary name in the same folder (created exclusively), then rename into place."""
    check_output_path(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".hetrl-plan.", suffix=".tmp")
    try:
        as_open_would(tmp)
        with os.fdopen(fd, "w") as f:
            json.dump(report, f, indent=2)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def format_report(r: dict) -> str:
    lines = [f"{r['method']} plan for {r['workload']} on {r['cluster']}: "
             f"{_seconds(r['iteration_time_s'])} per iteration, "
             f"{r['samples_per_s']:.1f} samples/s, {r['tokens_per_s']:,.0f} tokens/s "
             f"(search {r['search_time_s']:.1f} s"
             + (f", optimality gap {r['optimality_gap']:.2%}" if r.get("optimality_gap") is not None else "") + ")",
             *([f"search {r['stopped']}"] if r.get("stopped") else []),
             "", f"{'group':<6}{'GPUs':<34}{'task':<14}{'tp':>3}{'pp':>4}{'dp':>4}{'s/iter':>9}"]
    for i, g in enumerate(r["plan"]["groups"]):
        gpus = _compress(g["gpus"])
        for j, t in enumerate(g["tasks"]):
            p = g["parallelism"][t]
            extra = " ".join(f"{k} {p[k]}" for k in ("ep", "sp", "vpp", "engine") if k in p)   # only where set
            # a space before each number keeps the columns apart when one is wider than its heading (dp 1000)
            lines.append(f"{i if j == 0 else '':<6}{gpus if j == 0 else '':<33} {t:<14}{p['tp']:>3} {p['pp']:>3} "
                         f"{p['dp']:>3} {r['task_times_s'][t]:>8.1f}" + (f"  {extra}" if extra else ""))
    if r.get("measured"):
        predicted = {**r["task_times_s"], "iteration": r["iteration_time_s"]}
        lines += ["", "measured vs predicted: " + ", ".join(
            f"{k} {_seconds(v)} vs {_seconds(predicted[k])} ({(predicted[k] - v) / v:+.0%})"
            for k, v in r["measured"].items())]
    top = max(r["breakdown"].values(), default=0.0)   # parts under 1% of the largest are left out
    lines += ["", "time breakdown (critical path): " + ", ".join(
        f"{k} {_seconds(v)}" for k, v in sorted(r["breakdown"].items(), key=lambda kv: -kv[1])
        if v > 0 and v >= 0.01 * top)]
    for gpu, by in r.get("operator_tables", {}).items():
        text = by.get("all") or "; ".join(f"{k.replace('_', ' ')} {v}" for k, v in by.items())
        lines.append(f"priced {gpu}: {text}")
    for name, m in r.get("methods", {}).items():
        gap = f", gap {m['optimality_gap']:.2%}" if m.get("optimality_gap") is not None else ""
        stop = "; stopped early" if m.get("stopped") else ""
        lines.append(f"  {name:<10} {m['iteration_time_s']:8.1f} s/iter  "
                     f"(search {m['search_time_s']:.1f} s{gap}{stop})")
    lines += ["baselines:"] if r["baselines"] else []
    for name, b in r["baselines"].items():
        if b.get("plan") is None:
            why = b.get("error", "")
            lines.append(f"  {name:<10} {'no plan fits' if 'no plan fits' in why else 'no plan'} "
                         f"({_shorten(why, name)})")
        else:
            ratio = b["speedup"]   # a plan given to --evaluate can be slower than a baseline
            said = f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"
            lines.append(f"  {name:<10} {_seconds(b['iteration_time_s']):>10}/iter  -> this plan is {said}")
    return "\n".join(lines)


def _seconds(v: float) -> str:
    return f"{v:.1f} s" if v >= 1 else f"{v:.2g} s"


def _shorten(error: str, name: str, width: int = 90) -> str:
    """A baseline's refusal on one line: without the repeated 'name: no plan fits in memory:', cut at a word with
    '...' where it is longer than `width` (the JSON report has it whole)."""
    for prefix in (f"{name}: ", "no plan fits in memory: ", "no plan fits: "):
        error = error.removeprefix(prefix)
    if len(error) <= width:
        return error
    return error[:width].rsplit(" ", 1)[0].rstrip(",;:") + " ..."


def _compress(names: list[str]) -> str:
    """['a:0', 'a:1', 'b:0'] -> 'a:0-1, b:0'."""
    by_node: dict[str, list[int]] = {}
    for n in names:
        node, idx = n.rsplit(":", 1)
        by_node.setdefault(node, []).append(int(idx))
    parts = []
    for node, idx in by_node.items():
        parts.append(f"{node}:{idx[0]}-{idx[-1]}" if len(idx) > 1 and idx == list(range(idx[0], idx[-1] + 1))
                     else f"{node}:{','.join(map(str, idx))}")
    text = ", ".join(parts)
    return text if len(text) <= 32 else text[:29] + "..."
