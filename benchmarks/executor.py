"""Whether the planner ranks placements as they run: steps/s of `hetrl train executor=ray`, sync vs async and 1 vs 2
rollout workers, on the tiny and the default run, next to the planner's predicted iteration time for the same plan on
this machine seen as a 2-"GPU" cluster (one device per core, type cpu-core, measured in this run); results:
benchmarks/results/executor.md and executor_ranking.md.

    python -m benchmarks.executor [--configs tiny,default] [--steps 4] [--out benchmarks/results]
    python -m benchmarks.executor --configs default --plans split,colocated --name executor_ranking

Plans: `split` puts generation on core 0 and log-probs, reference and training on core 1 (1 rollout worker,
1 learner); `colocated` runs every task on both cores (2 rollout workers, 2 data-parallel learners, 2
references); `planner` is what the hybrid search picks. Each run is a full `train()` (Ray started and
stopped per run); step 1 is a warm-up; the table gives the median of the other steps.

Before the runs the cores are measured into the device description the predictions use: one core's matmul
peak and copy bandwidth, the model's own forward + backward (`mfu`, `concurrent_devices`), gloo between two
processes (`intra_node_gbps`), the rollout's decode step at 8-64 rows (`decode_mfu_by_rows`) and two processes
per core against one (`timeshare_efficiency`); `--no-device-probes` leaves out the last two.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import statistics
import sys
import tempfile
import time

import torch
import yaml

from hetrl.bench.harness import calls_per_s, interleaved_times, machine, revision, timed, write_results
from hetrl.data import TaskSource
from hetrl.models import load_model
from hetrl.planner import evaluate, load_cluster, plan_from_dict, workload_tasks
from hetrl.planner import plan as plan_search
from hetrl.planner.cost import task_costs
from hetrl.planner.plan import Group, Parallelism
from hetrl.planner.spec import TokenLengths, WorkloadSpec, cluster_from_dict
from hetrl.trainer.config import load_config
from hetrl.trainer.placement import model_spec_from_hf, run_workload
from hetrl.trainer.precision import decide
from hetrl.trainer.run import train

ROOT = pathlib.Path(__file__).resolve().parents[1]

CONFIGS = {"tiny": "examples/runs/tiny.yaml", "default": "examples/runs/default.yaml"}


def measure_core() -> dict:
    """One core's fp32 matmul FLOP/s and copy bandwidth (read + write), best of 5."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    x = torch.empty(64 << 20)
    y = torch.empty_like(x)

    def best(fn):
        return min(interleaved_times({"probe": fn}, 5, warmup=2)["probe"])

    flops = 2 * 2048**3 / best(lambda: a @ b)
    copy = 2 * x.numel() * 4 / best(lambda: y.copy_(x))
    torch.set_num_threads(threads)
    return {"fp32_matmul_flops": flops, "copy_bytes_per_s": copy}


def _copy_worker(duration_s: float, start, out) -> None:
    torch.set_num_threads(1)
    x = torch.empty(64 << 20)
    y = torch.empty_like(x)
    y.copy_(x)
    start.wait()
    out.put(2 * x.numel() * 4 * calls_per_s(lambda: y.copy_(x), duration_s, warmup=0))


def copy_together(processes: int, seconds: float = 3.0) -> float:
    """Bytes/s of `processes` one-thread processes copying 256 MiB buffers at the same time, summed: what the
    cores' memory bandwidth is when the roles' processes run side by side."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_copy_worker, args=(seconds, start, out)) for _ in range(processes)]
    for p in procs:
        p.start()
    time.sleep(2.0)          # every process allocated and warmed up
    start.set()
    total = sum(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join()
    return total


def measure_pool(core: dict) -> dict:
    """How many cores' worth the machine delivers with every core busy (`concurrent_devices`): the smaller of
    the fp32 matmul ratio (torch threads = cores against one thread) and the memory-copy ratio (one process per
    core copying at once against one process alone). A 135M model's passes are small matmuls and weight reads,
    so the bandwidth ratio is the one that binds where the cores share a memory system."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    flops = 2 * 2048**3 / min(interleaved_times({"matmul": lambda: a @ b}, 5, warmup=2)["matmul"])
    cores = os.cpu_count()
    alone, together = copy_together(1), copy_together(cores)
    ratio = min(flops / core["fp32_matmul_flops"], together / alone)
    return {"all_cores_fp32_matmul_flops": flops, "copy_bytes_per_s_one_process": alone,
            "copy_bytes_per_s_all_cores": together,
            "concurrent_devices": max(1.0, min(float(cores), round(ratio, 2)))}


def _gloo_worker(rank: int, port: int, nbytes: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.ones(nbytes // 4)
    dist.all_reduce(x)
    times = []
    for _ in range(5):
        dist.barrier()
        times.append(timed(lambda: dist.all_reduce(x))[1])
    if rank == 0:
        out.put(min(times))
    dist.destroy_process_group()


def measure_gloo(nbytes: int = 256 << 20) -> dict:
    """Bandwidth between two processes on this machine as the learners' gradient all-reduce sees it (gloo over
    loopback, one thread each): a 2-rank all-reduce of n bytes moves n bytes each way, so bytes/s = n / t."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_gloo_worker, args=(r, port, nbytes, out)) for r in range(2)]
    for p in procs:
        p.start()
    seconds = out.get(timeout=300)
    for p in procs:
        p.join()
    return {"gloo_allreduce_bytes": nbytes, "gloo_allreduce_s": seconds, "intra_node_gbps": nbytes / seconds * 8 / 1e9}


# The pass the device description is measured on: one data-parallel rank's share of the default job's
# update (4 groups of a 40-token prompt and 8 responses of 16 tokens), forward + backward through DualKV, as
# the learners run it (no activation recompute in this pass).
PASS_GROUPS, PASS_PROMPT, PASS_N, PASS_RESPONSE = 4, 40, 8, 16


def _pass_worker(model_name: str, rounds: int, ready, start, out) -> None:
    torch.set_num_threads(1)
    from hetrl.dualkv.api import shared_prompt_logprobs
    from hetrl.dualkv.packing import pack_groups

    model, _ = load_model(model_name)
    model.train()
    g = torch.Generator().manual_seed(0)
    batch = pack_groups([(torch.randint(10, 40000, (PASS_PROMPT,), generator=g).tolist(),
                          [torch.randint(10, 40000, (PASS_RESPONSE,), generator=g).tolist() for _ in range(PASS_N)])
                         for _ in range(PASS_GROUPS)])

    def once():
        shared_prompt_logprobs(model, batch).sum().backward()
        model.zero_grad(set_to_none=True)

    once()
    ready.put(True)
    start.wait()
    out.put(statistics.median(interleaved_times({"pass": once}, rounds, warmup=0)["pass"]))


def _passes_at_once(model_name: str, processes: int, rounds: int) -> list[float]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    ready, start, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_pass_worker, args=(model_name, rounds, ready, start, out)) for _ in range(processes)]
    for p in procs:
        p.start()
    for _ in procs:   # every worker loaded and past its untimed first pass: all time the same contention
        ready.get(timeout=900)
    start.set()
    seconds = [out.get(timeout=900) for _ in procs]
    for p in procs:
        p.join()
    return seconds


def measure_passes(core: dict, model_name: str = "smollm2-135m", rounds: int = 5) -> dict:
    """The device description measured on the model's own pass instead of a 2048^3 matmul: `pass_mfu`, the
    fraction of one core's matmul peak that a one-thread forward + backward reaches, counted as the cost model
    counts that pass's FLOPs (its compute term on a device of that peak at mfu 1); and
    `pass_concurrent_devices`, how many cores' worth the machine gives when every core runs that pass at once
    (one process per core). Timed separately from the training runs it then predicts."""
    model, _ = load_model(model_name)
    spec = model_spec_from_hf(model.config, model_name)
    del model
    probe = cluster_from_dict({"name": "probe", "gpu_types": [{
        "name": "core", "dense_bf16_flops": core["fp32_matmul_flops"], "memory_bytes": 1e12, "hbm_bytes_per_s": 1e12,
        "mfu": 1.0, "source": "this benchmark's one-core matmul peak"}],
        "nodes": [{"name": "n", "region": "r", "gpu": "core", "count": 1, "intra_node": "pcie"}]})
    w = WorkloadSpec(algorithm="grpo", mode="sync", actor=spec, reference=None, reward=None, critic=None,
                     prompts_per_step=PASS_GROUPS, responses_per_prompt=PASS_N,
                     prompt_tokens=TokenLengths(PASS_PROMPT, float(PASS_PROMPT)),
                     response_tokens=TokenLengths(PASS_RESPONSE, float(PASS_RESPONSE)), dualkv=True,
                     optimizer_steps=1)
    group = Group(("actor_train",), (0,), (("actor_train", Parallelism(1, 1, 1, recompute=False)),))
    at_peak = task_costs(probe, w, group)["actor_train"].terms["compute"]
    cores = os.cpu_count()
    alone = _passes_at_once(model_name, 1, rounds)[0]
    together = _passes_at_once(model_name, cores, rounds)
    return {"pass_s_one_process": alone, "pass_s_all_cores": together, "pass_s_at_peak": at_peak,
            "pass_mfu": min(1.0, at_peak / alone),
            "pass_concurrent_devices": max(1.0, min(float(cores), round(cores * alone / statistics.mean(together), 2)))}


DECODE_GROUPS = (1, 2, 4, 8)   # prompts of PASS_PROMPT tokens, PASS_N rows each: decode steps of 8 to 64 rows


def measure_decode(core: dict, model_name: str = "smollm2-135m", rounds: int = 3) -> dict:
    """`decode_mfu_by_rows`: the fraction of one core's matmul peak a decode step reaches at 8-64 rows, counted as
    the cost model counts decode FLOPs (2 x active params per row and token), on the rollout's own decode (hetrl's
    RolloutWorker, one thread, the prompt's KV held once; no row stops early: PASS_RESPONSE tokens each). Small-row
    steps run below the pass `mfu` on a CPU (the projection matmuls are too thin to reach the core's peak)."""
    from hetrl.trainer.rollout import RolloutWorker

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tokenizer = load_model(model_name)
        active = model_spec_from_hf(model.config, model_name).active_params
        g = torch.Generator().manual_seed(0)
        out, seconds = [], {}
        for groups in DECODE_GROUPS:
            rows = groups * PASS_N
            worker = RolloutWorker(model, tokenizer, batch_size=rows)
            worker.eos = -1   # no token ends a row: every row decodes PASS_RESPONSE steps
            prompts = [torch.randint(10, 40000, (PASS_PROMPT,), generator=g).tolist() for _ in range(groups)]
            times = []
            for k in range(rounds + 1):   # the first is a warm-up
                worker.phase_seconds["decode_s"] = 0.0
                worker.generate(prompts, PASS_N, PASS_RESPONSE, temperature=0.7)
                if k:
                    times.append(worker.phase_seconds["decode_s"])
            seconds[rows] = statistics.median(times)
            out.append([rows, round(min(1.0, 2 * active * rows * PASS_RESPONSE
                                        / (core["fp32_matmul_flops"] * seconds[rows])), 4)])
    finally:
        torch.set_num_threads(threads)
    return {"decode_s_by_rows": seconds, "decode_mfu_by_rows": out}


def measure_timeshare(core: dict, model_name: str = "smollm2-135m", rounds: int = 3) -> dict:
    """`timeshare_efficiency`: two one-thread processes per core running the model's pass at once, against one per
    core (`pass_s_all_cores`): the throughput the cores keep when each is time-shared by two processes, as a
    rollout and a learner share each core in async mode."""
    cores = os.cpu_count()
    doubled = _passes_at_once(model_name, 2 * cores, rounds)
    return {"pass_s_two_per_core": doubled,
            "timeshare_efficiency": round(min(1.0, 2 * statistics.mean(core["pass_s_all_cores"])
                                              / statistics.mean(doubled)), 3)}


def cpu_cluster(core: dict) -> dict:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = os.cpu_count()
    return {"name": "cpu-local", "gpu_types": [{
        "name": "cpu-core", "dense_bf16_flops": core["fp32_matmul_flops"], "memory_bytes": ram // cores,
        "hbm_bytes_per_s": core["copy_bytes_per_s"],
        **({"mfu": round(core["pass_mfu"], 3)} if "pass_mfu" in core else {}),
        **{k: core[k] for k in ("decode_mfu_by_rows", "timeshare_efficiency") if k in core},
        "source": "measured in this run: one core's fp32 matmul and copy bandwidth; RAM / cores"
                  + ("; mfu: the model's forward + backward on one core" if "pass_mfu" in core else "")
                  + ("; decode_mfu_by_rows: the rollout's decode step on one core" if "decode_mfu_by_rows" in core
                     else "")
                  + ("; timeshare_efficiency: two processes per core against one" if "timeshare_efficiency" in core
                     else "")}],
        "nodes": [{"name": "cpu", "region": "local", "gpu": "cpu-core", "count": cores, "intra_node": "pcie",
                   "network_gbps": 10,
                   # measured in this run (absent: the cost model's defaults, cores independent, PCIe between them);
                   # the model's own pass where measured, else the matmul and copy probes
                   **({"concurrent_devices": core["pass_concurrent_devices"]} if "pass_concurrent_devices" in core
                      else {k: core[k] for k in ("concurrent_devices",) if k in core}),
                   **{k: core[k] for k in ("intra_node_gbps",) if k in core}}]}


def fixed_plans(tasks: list[str]) -> dict[str, dict]:
    one = {"tp": 1, "pp": 1, "dp": 1}
    rest = [t for t in tasks if t != "actor_gen"]
    return {
        "split": {"groups": [{"tasks": ["actor_gen"], "gpus": ["cpu:0"], "parallelism": {"actor_gen": one}},
                             {"tasks": rest, "gpus": ["cpu:1"], "parallelism": {t: one for t in rest}}]},
        "colocated": {"groups": [{"tasks": tasks, "gpus": ["cpu:0", "cpu:1"],
                                  "parallelism": {t: {"tp": 1, "pp": 1, "dp": 2} for t in tasks}}]},
    }


def _overrides(config: str, name: str, mode: str, steps: int, work: pathlib.Path, cluster_path, plan_file=None):
    # fp32, as the cores are measured (precision=auto would be bf16-mixed on a CPU with bf16 instructions)
    out = [f"steps={steps}", "eval_size=4", "checkpoint_every=0", "precision=fp32",
           f"out_dir={work / f'{config}-{name}-{mode}'}"]
    if name != "local":
        out += ["executor=ray", f"mode={mode}", f"emulate_cluster={cluster_path}"]
        out += [f"plan={plan_file}"] if plan_file else []
    return out


def _model_facts(config: str):
    """(the run's model spec, its longest held-out prompt): what the run's planner workload is built from."""
    base = load_config(CONFIGS[config], [])
    model, tokenizer = load_model(base.model, seed=base.seed)
    task = TaskSource(base.task, base.task_config, base.seed, base.eval_size, tokenizer, base.max_prompt_tokens,
                      base.prompt_suffix)
    return model_spec_from_hf(model.config, base.model), max(len(e.prompt_ids) for e in task.eval_examples)


def _workload(config, name, mode, steps, work, cluster_path, spec, prompt_len) -> WorkloadSpec:
    """The planner workload of exactly the run that is timed (its executor, mode, precision, mini-batches and
    old log-prob passes: placement.run_workload)."""
    cfg = load_config(CONFIGS[config], _overrides(config, name, mode, steps, work, cluster_path))
    return run_workload(cfg, spec, TokenLengths(prompt_len, float(prompt_len)), decide(cfg).planner)


NEW_PROBES = ("decode_mfu_by_rows", "timeshare_efficiency")


def _without_new_probes(core: dict):
    """The cluster as described before the decode-by-rows and time-sharing probes (None when neither was run)."""
    if not any(k in core for k in NEW_PROBES):
        return None
    return cluster_from_dict(cpu_cluster({k: v for k, v in core.items() if k not in NEW_PROBES}))


def _predict(cluster, independent, workload, plan_dict, before=None) -> dict:
    est = evaluate(cluster, workload, plan_from_dict(plan_dict, cluster, workload))
    return {"iteration_time_s": est.iteration_time_s, "breakdown": est.breakdown, "task_times_s": est.task_times_s,
            "independent_cores_s": evaluate(independent, workload, plan_from_dict(
                plan_dict, independent, workload)).iteration_time_s,
            **({"without_new_probes_s": evaluate(before, workload, plan_from_dict(
                plan_dict, before, workload)).iteration_time_s} if before is not None else {})}


def run(config: str, steps: int, work: pathlib.Path, cluster_path: pathlib.Path, cluster, independent,
        plans=("local", "split", "colocated", "planner"), modes=("sync", "async"), before=None) -> list[dict]:
    """Each (plan, mode) trained and timed; `predicted` from the cost model on `cluster` (this machine as
    measured: cores sharing one pool, gloo between them) and on `independent` (the same cores as independent
    devices linked by PCIe, the model's defaults)."""
    spec, prompt_len = _model_facts(config)
    rows = []
    variants = [("local", "sync", None)] * ("local" in plans) + [(p, m, p) for p in ("split", "colocated", "planner")
                                                                if p in plans for m in modes]
    for name, mode, plan_name in variants:
        predicted, plan_file = None, None
        if plan_name is not None:
            workload = _workload(config, name, mode, steps, work, cluster_path, spec, prompt_len)
            if plan_name == "planner":
                chosen = plan_search(cluster, workload, "hybrid", seed=0, time_limit_s=30).plan
                plan_dict = chosen.to_dict(cluster)
            else:
                plan_dict = fixed_plans(list(workload_tasks(workload)))[plan_name]
            plan_file = work / f"{config}-{name}-{mode}.plan.json"
            plan_file.write_text(json.dumps(plan_dict))
            predicted = _predict(cluster, independent, workload, plan_dict, before)
        cfg = load_config(CONFIGS[config], _overrides(config, name, mode, steps, work, cluster_path, plan_file))
        _, wall = timed(lambda: train(cfg))
        metrics = [json.loads(x) for x in (pathlib.Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()]
        later = metrics[1:] or metrics
        step_s = statistics.median(r["step_s"] for r in later)
        placement = pathlib.Path(cfg.out_dir) / "placement.json"
        actors = json.loads(placement.read_text())["actors"] if placement.exists() else []
        rows.append({
            "config": config, "plan": name, "mode": mode, "steps": steps, "wall_s": wall,
            "rollout_workers": sum(a["role"] == "rollout" for a in actors) or 1,
            "learners": sum(a["role"] == "learner" for a in actors) or 1,
            "plan_groups": json.loads(plan_file.read_text())["groups"] if plan_file else None,
            "step_s": step_s, "steps_per_s": 1 / step_s,
            "gen_wait_s": statistics.median(r["gen_s"] for r in later),
            "update_s": statistics.median(r.get("logprob_s", 0) + r.get("update_s", 0) for r in later),
            "weight_sync_s": statistics.median(r.get("weight_sync_s", r.get("weight_load_s", 0)) for r in later),
            "weight_sync_bytes": later[-1].get("weight_sync_bytes"),
            "max_staleness_seen": max(r.get("staleness", 0) for r in later),
            "predicted": predicted})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "plan_groups"}), flush=True)
    return rows


def repredict(path: pathlib.Path) -> dict:
    """A results JSON's runs scored again by today's cost model, on the device description measured in that
    invocation (its `core`): the measurements are kept, only `predicted` changes (the previous one is kept as
    `predicted_before`)."""
    result = json.loads(path.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        cluster_path = work / "cpu-local.yaml"
        cluster_path.write_text(yaml.safe_dump(cpu_cluster(result["core"])))
        cluster = load_cluster(str(cluster_path))
        independent = cluster_from_dict(cpu_cluster({k: result["core"][k] for k in ("fp32_matmul_flops",
                                                                                     "copy_bytes_per_s")}))
        before = _without_new_probes(result["core"])
        facts = {}
        for r in result["rows"]:
            if not r.get("plan_groups"):
                continue
            if r["config"] not in facts:   # loads the model and task: once per config
                facts[r["config"]] = _model_facts(r["config"])
            workload = _workload(r["config"], r["plan"], r["mode"], r["steps"], work, cluster_path, *facts[r["config"]])
            r["predicted_before"] = r.get("predicted_before", r["predicted"])
            r["predicted"] = _predict(cluster, independent, workload, {"groups": r["plan_groups"]}, before)
    result["repredicted"] = {"date": datetime.date.today().isoformat(), "revision": revision()}
    return result


def _probe_ratio(core: dict) -> float:
    """All cores against one process on the matmul and copy probes, the smaller of the two."""
    return min(core["all_cores_fp32_matmul_flops"] / core["fp32_matmul_flops"],
               core["copy_bytes_per_s_all_cores"] / core["copy_bytes_per_s_one_process"])


def markdown(result: dict) -> str:
    m = result["machine"]
    probes = any("without_new_probes_s" in (r["predicted"] or {}) for r in result["rows"])
    lines = [
        "# Executor: steps/s of `hetrl train executor=ray` on one CPU machine",
        "",
        f"{result['date']}, {m['cpus']} CPUs ({m['platform']}), torch {m['torch']}, ray {m['ray']}. Each run: "
        f"{result['steps']} steps, median step time of steps 2..{result['steps']} (step 1 warms up). The machine is "
        f"emulated as a cluster of {m['cpus']} `cpu-core` devices measured in this run: "
        f"{result['core']['fp32_matmul_flops'] / 1e9:.0f} GFLOP/s fp32 matmul and "
        f"{result['core']['copy_bytes_per_s'] / 1e9:.1f} GB/s copy per core"
        + (f"; with every core busy they deliver {result['core']['concurrent_devices']:g} cores' worth of matmul "
           f"(`concurrent_devices`), and two processes all-reduce through gloo at "
           f"{result['core']['intra_node_gbps']:.1f} Gbit/s (`intra_node_gbps`)" if "concurrent_devices" in
           result["core"] and "pass_mfu" not in result["core"] else "")
        + (f"; measured on the model's own pass (a one-thread forward + backward of {PASS_GROUPS} groups of a "
           f"{PASS_PROMPT}-token prompt and {PASS_N} x {PASS_RESPONSE} response tokens, before the runs): it reaches "
           f"{result['core']['pass_mfu']:.2f} of that peak as the cost model counts its FLOPs (`mfu`; the GPU "
           f"constants are 0.45 / 0.50) and, one process per core at once, the cores deliver "
           f"{result['core']['pass_concurrent_devices']:g} cores' worth (`concurrent_devices`; the matmul and "
           f"copy probes: {_probe_ratio(result['core']):.2f}); "
           f"two processes all-reduce through gloo at {result['core']['intra_node_gbps']:.1f} Gbit/s "
           "(`intra_node_gbps`)" if "pass_mfu" in result["core"] else "")
        + ("; a decode step on one core (the rollout's own, one thread) reaches "
           + ", ".join(f"{m:.2f} at {r} rows" for r, m in result["core"]["decode_mfu_by_rows"])
           + " of the matmul peak (`decode_mfu_by_rows`), and two processes per core keep "
           f"{result['core']['timeshare_efficiency']:.2f} of the throughput of one (`timeshare_efficiency`)"
           if all(k in result["core"] for k in NEW_PROBES) else "")
        + ". `predicted s` is the planner's cost model for that plan on that cluster, not a measurement; "
        "`independent cores` is its prediction with the cores described as independent devices joined by PCIe "
        "(the model's defaults, before the device description could say otherwise)"
        + ("; `without decode/timeshare` is its prediction on the cores as described before those two probes"
           if probes else "") + ".",
        "",
        "| config | plan | mode | rollout workers | learners | step s (measured) | steps/s | gen wait s | "
        "update s | weight sync s | predicted s | measured / predicted | predicted s, independent cores |"
        + (" predicted s, without decode/timeshare |" if probes else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if probes else "")]
    for r in result["rows"]:
        p = r["predicted"]["iteration_time_s"] if r["predicted"] else None
        independent_s = ('' if p is None or 'independent_cores_s' not in r['predicted']
                         else format(r['predicted']['independent_cores_s'], '.4f'))
        lines.append(
            f"| {r['config']} | {r['plan']} | {r['mode']} | {r['rollout_workers']} | {r['learners']} | "
            f"{r['step_s']:.3f} | {r['steps_per_s']:.2f} | {r['gen_wait_s']:.3f} | {r['update_s']:.3f} | "
            f"{r['weight_sync_s']:.4f} | {'' if p is None else f'{p:.4f}'} | "
            f"{'' if p is None else format(r['step_s'] / p, '.1f') + 'x'} | "
            f"{independent_s} |"
            + (f" {'' if p is None else format(r['predicted']['without_new_probes_s'], '.4f')} |" if probes else ""))
    lines += ["", "Plans: `split` = generation on cpu:0, log-probs/reference/training on cpu:1; `colocated` = every "
              "task on both cores, data-parallel 2; `planner` = the hybrid search's choice for this cluster; "
              "`local` = no Ray, one process.", ""]
    lines += ["Ranking of the fixed plans (`split`, `colocated`), fastest first:", ""]
    for config in dict.fromkeys(r["config"] for r in result["rows"]):
        for mode in ("sync", "async"):
            rows = [r for r in result["rows"] if r["config"] == config and r["mode"] == mode
                    and r["plan"] in ("split", "colocated")]
            if len(rows) < 2:
                continue
            order = {k: " < ".join(r["plan"] for r in sorted(rows, key=key)) for k, key in (
                ("measured", lambda r: r["step_s"]), ("predicted", lambda r: r["predicted"]["iteration_time_s"]),
                ("independent cores", lambda r: r["predicted"].get("independent_cores_s", math.inf)),
                ("without", lambda r: r["predicted"].get("without_new_probes_s", math.inf)))}
            gap = {k: max(vals) / min(vals) - 1 for k, vals in (
                ("measured", [r["step_s"] for r in rows]),
                ("predicted", [r["predicted"]["iteration_time_s"] for r in rows]))}
            lines.append(f"- {config}, {mode}: measured {order['measured']} (by {gap['measured']:.1%}); predicted "
                         f"{order['predicted']} (by {gap['predicted']:.1%}) "
                         f"({'agrees' if order['predicted'] == order['measured'] else 'DISAGREES'}); independent "
                         f"cores {order['independent cores']} "
                         f"({'agrees' if order['independent cores'] == order['measured'] else 'disagrees'})"
                         + (f"; without decode/timeshare {order['without']} "
                            f"({'agrees' if order['without'] == order['measured'] else 'disagrees'})"
                            if probes else ""))
    lines.append("")
    for r in result["rows"]:
        if r["plan"] == "planner":
            lines.append(f"- planner's plan ({r['config']}, {r['mode']}): " + "; ".join(
                f"{'+'.join(g['tasks'])} on {', '.join(g['gpus'])}" for g in r["plan_groups"]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="tiny,default")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="executor", help="results file name (NAME.json, NAME.md)")
    ap.add_argument("--plans", default="local,split,colocated,planner")
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--no-device-probes", dest="device_probes", action="store_false",
                    help="describe the cores without the decode-by-rows and time-sharing probes (the model's "
                         "defaults for those: the pass mfu for every decode, no time-sharing loss)")
    ap.add_argument("--repredict", metavar="RESULTS.json",
                    help="score a results file's runs again with today's cost model (no runs): writes "
                         "RESULTS_repredicted.{json,md} beside it")
    args = ap.parse_args(argv)
    if args.repredict:
        path = pathlib.Path(args.repredict)
        result = repredict(path)
        write_results(path.parent, path.stem + "_repredicted", result, markdown(result))
        print(markdown(result))
        return 0
    import ray

    core = measure_core()
    core |= measure_pool(core) | measure_gloo()
    core |= measure_passes(core)
    if args.device_probes:
        core |= measure_decode(core) | measure_timeshare(core)
    print(json.dumps(core), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        cluster_path = work / "cpu-local.yaml"
        cluster_path.write_text(yaml.safe_dump(cpu_cluster(core)))
        cluster = load_cluster(str(cluster_path))
        independent = cluster_from_dict(
            cpu_cluster({k: core[k] for k in ("fp32_matmul_flops", "copy_bytes_per_s")}))
        rows = [r for c in args.configs.split(",")
                for r in run(c, args.steps, work, cluster_path, cluster, independent, args.plans.split(","),
                             args.modes.split(","), _without_new_probes(core))]
    result = {"date": datetime.date.today().isoformat(), "steps": args.steps, "core": core,
              "machine": {**machine(), "ray": ray.__version__},
              "rows": rows}
    write_results(args.out, args.name, result, markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
