"""What the planner's memory strategies and time limits do: published setups scored by --evaluate, the strategies the
search picks on paper-multi-continent qwen3-14b PPO sync, and time limits at 2048 GPUs; result:
benchmarks/results/planner_strategies.md.

    python -m benchmarks.planner_strategies

Seconds per iteration are the cost model's predictions; search and configure times are wall-clock here.
"""

from __future__ import annotations

import pathlib
import time

from hetrl.bench.harness import machine, timed, write_results
from hetrl.planner import estimate, load_cluster, load_plan, load_workload, plan
from hetrl.planner.space import configure, groupings, pools
from hetrl.planner.spec import cluster_from_dict

ROOT = pathlib.Path(__file__).resolve().parents[1]
EX = ROOT / "examples"
PUBLISHED = [("h100-2x8", "llama3.1-8b-grpo-nemorl", "nemorl-llama3.1-8b-16xh100"),
             ("a100-40g-8x8", "qwen3-8b-grpo-dualkv-paper", "dualkv-paper-qwen3-8b-64xa100-40g"),
             ("h20-8x8", "qwen2.5-7b-dapo-verl", "verl-dapo-qwen2.5-7b-64xh20")]


def _strategies(p, cluster) -> list[str]:
    out = []
    for g in p.to_dict(cluster)["groups"]:
        for t, par in g["parallelism"].items():
            if "zero" in par:
                out.append(f"{t}: zero {par['zero']}, offload {par['offload']}, recompute {par['recompute']}")
        if g["swap"]:
            out.append(f"group {'+'.join(g['tasks'])}: swap")
    return out


def run() -> dict:
    published = []
    for c, w, p in PUBLISHED:
        cluster, workload = (load_cluster(str(EX / "clusters" / f"{c}.yaml")),
                             load_workload(str(EX / "workloads" / f"{w}.yaml")))
        e = estimate(cluster, workload, load_plan(str(EX / "plans" / f"{p}.json"), cluster, workload))
        published.append({"plan": p, "feasible": e.feasible, "iteration_time_s": e.iteration_time_s,
                          "breakdown": e.breakdown, "peak_gb": max(e.memory_bytes.values()) / 1e9})
    cluster = load_cluster(str(EX / "clusters" / "paper-multi-continent.yaml"))
    w = load_workload(str(EX / "workloads" / "qwen3-14b-ppo-sync.yaml"))
    r = plan(cluster, w, "hybrid", time_limit_s=15.0)
    chosen = {"iteration_time_s": r.iteration_time_s, "search_time_s": r.search_time_s, "stopped": r.stopped,
              "strategies": _strategies(r.plan, cluster), "breakdown": estimate(cluster, w, r.plan).breakdown}
    big = cluster_from_dict({"name": "a100x2048", "nodes": [
        {"name": f"a{i}", "region": "r", "gpu": "A100-80G", "count": 8} for i in range(256)]})
    w8 = load_workload(str(EX / "workloads" / "qwen3-8b-grpo-sync.yaml"))
    blocks = sorted({b for g in groupings(w8) for b in g})
    _, configure_s = timed(lambda: [configure(big, w8, b, tuple(p.steps for p in pools(big))) for b in blocks])
    limits = []
    for method in ("hybrid", "ilp"):
        res, wall_s = timed(lambda: plan(big, w8, method, time_limit_s=5.0))
        limits.append({"method": method, "limit_s": 5.0, "wall_s": wall_s,
                       "iteration_time_s": res.iteration_time_s, "stopped": res.stopped})
    return {"machine": machine(),
            "date": time.strftime("%Y-%m-%d"), "published": published, "multi_continent_qwen3_14b_ppo": chosen,
            "configure_2048_gpus_all_blocks_s": configure_s, "time_limits_2048_gpus": limits}


def markdown(res: dict) -> str:
    lines = ["# Planner memory strategies", "",
             f"{res['date']}, {res['machine']['cpus']} CPUs ({res['machine']['platform']}); "
             "`python -m benchmarks.planner_strategies`. Seconds per iteration are predictions.", "",
             "## Published setups (`hetrl plan --evaluate`)", "",
             "| plan | feasible | s/iter | peak GB per GPU | largest terms |", "|---|---|---|---|---|"]
    for p in res["published"]:
        top = ", ".join(f"{k} {v:.1f}" for k, v in sorted(p["breakdown"].items(), key=lambda kv: -kv[1])[:4])
        lines.append(f"| {p['plan']} | {p['feasible']} | {p['iteration_time_s']:.1f} | {p['peak_gb']:.1f} | {top} |")
    c = res["multi_continent_qwen3_14b_ppo"]
    lines += ["", "## paper-multi-continent, qwen3-14b PPO sync (hybrid, 15 s)", "",
              f"{c['iteration_time_s']:.1f} s per iteration (search {c['search_time_s']:.1f} s; "
              f"{c['stopped'] or 'finished'}).",
              "Strategies other than the defaults: " + ("; ".join(c["strategies"]) or "none") + ".",
              "Breakdown: " + ", ".join(f"{k} {v:.1f} s"
                                        for k, v in sorted(c["breakdown"].items(), key=lambda kv: -kv[1])
                                        if v >= 0.05) + ".",
              "", "## 2048 GPUs (one A100-80G pool, qwen3-8b GRPO sync)", "",
              f"Configuring every task block on the whole cluster: {res['configure_2048_gpus_all_blocks_s']:.1f} s.",
              "",
              "| method | limit s | wall s | s/iter | stopped |", "|---|---|---|---|---|"]
    for t in res["time_limits_2048_gpus"]:
        lines.append(f"| {t['method']} | {t['limit_s']:g} | {t['wall_s']:.1f} | {t['iteration_time_s']:.1f} | "
                     f"{t['stopped'] or '-'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    res = run()
    write_results(ROOT / "benchmarks" / "results", "planner_strategies", res, markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
