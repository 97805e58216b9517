"""A plan as a picture (`hetrl plan ... --png FILE`): where the tasks run, and one iteration's timeline.

Top: each GPU group of the plan as a row of its GPUs, coloured by type, with its region and the tasks it runs
(tp / pp / dp). Bottom: a Gantt chart of one iteration as the cost model prices it (hetrl.planner.cost.timeline:
the same rule as the iteration time), a lane per group and one for the links, communication hatched; the last
bar ends at the predicted iteration time. With `--evaluate PLAN --measured TIMES` the measured seconds of each task
are drawn as pale bars under the predicted ones (from the same start) and the measured iteration as a dotted line.
Drawn from the report `hetrl plan --json` prints, so a saved report
can be drawn again (`draw(json.load(f), path)`).
"""

from __future__ import annotations

import pathlib

TASK_COLOURS = {"actor_gen": "#4C72B0", "actor_infer": "#55A868", "ref_infer": "#8172B2", "reward_infer": "#CCB974",
                "critic_infer": "#64B5CD", "actor_train": "#C44E52", "critic_train": "#DD8452",
                "transfer": "#BBBBBB", "weight_sync": "#999999"}
GPU_COLOURS = ("#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666")


def _seconds(v: float) -> str:
    return f"{v:.1f} s" if v >= 1 else f"{v * 1e3:.0f} ms"


def draw(report: dict, path: str | pathlib.Path) -> pathlib.Path:
    """Write the picture of `report` (hetrl.planner.report.plan_report's dict) to `path` (PNG); -> the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    groups, hardware, bars = report["plan"]["groups"], report["hardware"], report["timeline"]
    types = list(dict.fromkeys(h["gpu"] for hw in hardware for h in hw))
    colour_of = {t: GPU_COLOURS[i % len(GPU_COLOURS)] for i, t in enumerate(types)}
    n = len(groups)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 2.2 + 1.1 * n + 0.6 * (n + 1)),
                                      gridspec_kw={"height_ratios": [n, n + 1]})
    fig.suptitle(f"{report['method']} plan for {report['workload']} on {report['cluster']}: "
                 f"{_seconds(report['iteration_time_s'])} per iteration ({report.get('mode', 'sync')})", fontsize=11)

    widest = max(sum(h["count"] for h in hw) for hw in hardware)
    for k, (g, hw) in enumerate(zip(groups, hardware)):
        y, x = n - 1 - k, 0
        for h in hw:
            top.barh(y, h["count"], left=x, height=0.6, color=colour_of[h["gpu"]], edgecolor="white")
            top.text(x + h["count"] / 2, y, f"{h['count']}x {h['gpu']}\n{h['region']}", ha="center", va="center",
                     fontsize=8, color="white")
            x += h["count"]
        tasks = "; ".join(f"{t} (tp {g['parallelism'][t]['tp']}, pp {g['parallelism'][t]['pp']}, "
                          f"dp {g['parallelism'][t]['dp']})" for t in g["tasks"])
        top.text(widest * 1.02, y, tasks, va="center", fontsize=8)
    top.set_yticks(range(n), [f"group {k}" for k in reversed(range(n))])
    top.set_xlim(0, widest * 2.6)
    top.set_xticks([])
    top.set_title("placement: GPUs by type and region, the tasks each group runs", fontsize=9, loc="left")
    for side in ("top", "right", "bottom"):
        top.spines[side].set_visible(False)

    lanes = [f"group {k}" for k in range(n)] + ["links"]
    measured = report.get("measured") or {}
    # with measured times each lane holds two rows: predicted above, measured (same start, its own length) below
    height, shift = (0.42, 0.2) if measured else (0.6, 0.0)
    for b in bars:
        lane = n if b["group"] is None else b["group"]
        width = b["end_s"] - b["start_s"]
        if width <= 0:
            continue
        comm = b["kind"] == "communication"
        y = len(lanes) - 1 - lane
        bottom.barh(y + shift, width, left=b["start_s"], height=height, color=TASK_COLOURS.get(b["task"],
                    "#777777"), hatch="//" if comm else None, edgecolor="black" if comm else "white", linewidth=0.5)
        if width > 0.06 * report["iteration_time_s"]:
            bottom.text(b["start_s"] + width / 2, y + shift, f"{b['task']}\n{_seconds(width)}" if not measured
                        else f"{b['task']} {_seconds(width)}", ha="center", va="center", fontsize=7,
                        color="white" if not comm else "black")
        if b["task"] in measured:
            bottom.barh(y - shift, measured[b["task"]], left=b["start_s"], height=height * 0.8,
                        color=TASK_COLOURS.get(b["task"], "#777777"), alpha=0.45, edgecolor="black", linewidth=0.5)
            bottom.text(b["start_s"] + measured[b["task"]] / 2, y - shift, f"measured {_seconds(measured[b['task']])}",
                        ha="center", va="center", fontsize=6)
    bottom.axvline(report["iteration_time_s"], color="black", linestyle="--", linewidth=0.8)
    if "iteration" in measured:
        bottom.axvline(measured["iteration"], color="#C44E52", linestyle=":", linewidth=1.2)
    bottom.set_yticks(range(len(lanes)), list(reversed(lanes)))
    bottom.set_xlabel("seconds into the iteration (cost model)")
    bottom.set_title("one iteration: tasks per group, communication hatched; dashed: the predicted iteration time"
                     + ("; pale bars below: measured (dotted: the measured iteration)" if measured else ""),
                     fontsize=9, loc="left")
    used = list(dict.fromkeys(b["task"] for b in bars if b["end_s"] > b["start_s"]))
    bottom.legend(handles=[Patch(facecolor=TASK_COLOURS.get(t, "#777777"), label=t,
                                 hatch="//" if t in ("transfer", "weight_sync") else None) for t in used],
                  fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=min(len(used), 5), frameon=False)
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["draw"]
