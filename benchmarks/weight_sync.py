"""Weight sync to Ray rollout actors: the collective transport (a gloo broadcast from learner rank 0, in buckets)
against Ray's object store, side by side on one local Ray; results: benchmarks/results/weight_sync.md.

    python -m benchmarks.weight_sync [--rounds 5] [--actors 2] [--out benchmarks/results]

The default job's model (embedded SmolLM2-135M): one learner actor and `--actors` hf rollout actors on a local Ray
(2 CPUs, one machine, so gloo runs over the loopback and the object store is shared memory). Each round syncs one
version both ways, the transports taking turns (harness.interleaved_times, one warm-up round): `collective` is
RolloutPool.broadcast_weights (the learner's broadcast and every actor's load), `object_store` is what the engine
does in async mode (rank 0's arrays put into the object store, every actor reading and loading them). In fp32 (the
actors hold fp32 weights) and bf16-mixed (the learner sends its bf16 copy, half the bytes). Every actor's weights
are checked equal to the learner's after each transport.
"""

from __future__ import annotations

import argparse
import tempfile

import ray
import torch

from hetrl.bench.harness import interleaved_times, machine, revision, spread, utc_now, write_results
from hetrl.trainer.config import load_config
from hetrl.trainer.precision import decide
from hetrl.trainer.ray_executor import LearnerActor, LearnerGroup, RolloutActor, RolloutPool


def _state(actor, attr: str) -> dict[str, torch.Tensor]:
    return ray.get(actor.__ray_call__.remote(lambda a: {k: v.clone() for k, v in
                                                        getattr(a, attr).module.state_dict().items()}))


def measure(precision: str, rounds: int, n_actors: int, run_dir: str) -> dict:
    cfg = load_config("examples/runs/default.yaml", [f"precision={precision}", f"out_dir={run_dir}"])
    prec = decide(cfg)
    learner = ray.remote(LearnerActor).options(num_cpus=0).remote(cfg, prec, 1, 0, 1)
    actors = [ray.remote(RolloutActor).options(num_cpus=0).remote(cfg, prec, 1, False) for _ in range(n_actors)]
    pool = RolloutPool(actors, cfg.rollout_batch_size, cfg.seed)
    pool.learner = LearnerGroup([learner])
    pool.new_address = lambda: pool.learner.rendezvous(True, run_dir)
    version = [0]
    sent = {}

    def collective():
        version[0] += 1
        _, sent["collective"] = pool.broadcast_weights(version[0])

    def object_store():
        version[0] += 1
        ref = pool.learner.weights_ref()
        sent["object_store"] = sum(a.nbytes for a in ray.get(ref).values())
        pool.wait_loads(pool.push_weights(ref, version[0]))

    def check():
        want = _state(learner, "policy")
        if prec.autocast:
            want = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in want.items()}
        for a in actors:
            got = _state(a, "policy")
            assert all(torch.equal(got[k], want[k].to(got[k].dtype)) for k in want), "a rollout actor differs"

    for sync in (collective, object_store):   # the warm-up round, checked
        sync()
        check()
    times = interleaved_times({"collective": collective, "object_store": object_store}, rounds, warmup=0,
                              desc=f"weight sync {prec.name}")
    check()
    for a in [learner, *actors]:
        ray.kill(a)
    return {"precision": prec.name, "actors": n_actors, "bytes": sent,
            **{name: {**spread(t), "times_s": t} for name, t in times.items()},
            "collective_over_object_store_time": spread(times["collective"])["median_s"]
            / spread(times["object_store"])["median_s"]}


def page(results: list[dict], mach: dict) -> str:
    lines = ["# Weight sync to Ray rollout actors: gloo broadcast vs Ray's object store", "",
             f"Machine: {mach['model']} ({', '.join(mach['flags'])}), {mach['cpus']} cores, torch {mach['torch']}; "
             "nothing else running. Command: `python -m benchmarks.weight_sync`. One local Ray: one learner actor "
             "and hf rollout actors, SmolLM2-135M; each round one version each way (transports interleaved, one "
             "warm-up round, every actor checked equal to the learner after it); median (min-max) seconds from "
             "the driver's call to the last actor's load.", "",
             "| precision | actors | bytes per actor | collective s | object store s | collective / object store |",
             "|---|---:|---:|---|---|---:|"]
    for r in results:
        c, o = r["collective"], r["object_store"]
        lines.append(f"| {r['precision']} | {r['actors']} | {r['bytes']['collective'] / 2**20:.0f} MiB | "
                     f"{c['median_s']:.2f} ({c['min_s']:.2f}-{c['max_s']:.2f}) | {o['median_s']:.2f} "
                     f"({o['min_s']:.2f}-{o['max_s']:.2f}) | {r['collective_over_object_store_time']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16-mixed"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--actors", type=int, default=2)
    args = ap.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, object_store_memory=2 << 30)
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            results = [measure(p, args.rounds, args.actors, run_dir) for p in args.precision]
    finally:
        ray.shutdown()
    mach = machine()
    res = {"machine": mach, "revision": revision(), "when": utc_now(), "results": results}
    path = write_results(args.out, "weight_sync", res, page(results, mach))
    print(open(path + ".md").read())


if __name__ == "__main__":
    main()
