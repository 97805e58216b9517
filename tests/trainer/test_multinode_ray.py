"""The Ray executor on a real multi-raylet cluster (`ray.cluster_utils.Cluster`: several raylets, each with its own
object store, on this machine): actors land on the raylets of their plan nodes (Ray's own actor table), weights
cross object stores, and a whole node lost mid-run costs its rollout worker, not the run nor any sample; losing the
learners' node stops the run with its checkpoint and the command to resume."""

from __future__ import annotations

import json
import pathlib
import threading
import time

import pytest
import yaml

ray = pytest.importorskip("ray")     # the device machine has no Ray: `pytest -m gpu` must still collect

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "runs" / "tiny.yaml")
NODES = {"gen-a": 1, "gen-b": 1, "train": 2}
PLAN = {"groups": [
    {"tasks": ["actor_gen"], "gpus": ["gen-a:0", "gen-b:0"], "parallelism": {"actor_gen": {"tp": 1, "pp": 1, "dp": 2}}},
    {"tasks": ["actor_infer", "actor_train"], "gpus": ["train:0", "train:1"],
     "parallelism": {"actor_infer": {"tp": 1, "pp": 1, "dp": 2}, "actor_train": {"tp": 1, "pp": 1, "dp": 2}}}]}


@pytest.fixture
def raylets(tmp_path):
    """A head raylet (the driver's; no plan node) and one raylet per plan node, each declaring its hetrl-node
    resource."""
    from ray.cluster_utils import Cluster

    # Ray's GCS notices a dead raylet by missed health checks (about 16 s with its defaults); checked every 0.2 s
    # here so that the node's loss is known within the 3-step run
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": 200 << 20,
        "_system_config": {"health_check_period_ms": 200, "health_check_failure_threshold": 2,
                           "health_check_initial_delay_ms": 0}})
    nodes = {name: cluster.add_node(num_cpus=1, resources={f"hetrl-node:{name}": count},
                                    object_store_memory=200 << 20) for name, count in NODES.items()}
    cluster.wait_for_nodes()
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump({"name": "three-raylets", "nodes": [
        {"name": n, "region": "local", "gpu": "L4", "count": c, "intra_node": "pcie", "network_gbps": 10}
        for n, c in NODES.items()]}))
    (tmp_path / "plan.json").write_text(json.dumps({"plan": PLAN}))
    yield cluster, nodes
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


# The tiny model runs 10 steps a second: a node removed after step 1 could be gone only after the run ended. A
# reward that takes a second makes each step outlast the removal and Ray's noticing it (deterministic, so the
# runs stay comparable sample for sample).
SLOW_REWARD = """import time


def slow(completions, **kwargs):
    time.sleep(1.0)
    return [(len(c) % 3) / 2 for c in completions]
"""


def _run(cluster, tmp_path, name, *extra, plan="plan.json"):
    from hetrl.cli import main

    out = tmp_path / name
    reward = tmp_path / "slow_reward.py"
    reward.write_text(SLOW_REWARD)
    code = main(["train", "--config", TINY, "executor=ray", f"cluster={tmp_path / 'cluster.yaml'}",
                 f"reward={reward}:slow", f"ray_address={cluster.address}", f"plan={tmp_path / plan}",
                 f"out_dir={out}", "kl_coef=0", "eval_size=4", "steps=3", "checkpoint_every=0", *extra])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return code, rows, json.loads((out / "placement.json").read_text())


def _remove_when_written(cluster, node, path: pathlib.Path) -> threading.Thread:
    """Removes a whole node (its raylet, object store and actors) once `path` has content (metrics.jsonl: step 1
    logged; checkpoints/latest: the first checkpoint in place)."""
    def remove():
        while not (path.exists() and path.read_text().strip()):
            time.sleep(0.05)
        cluster.remove_node(node, allow_graceful=False)

    thread = threading.Thread(target=remove)
    thread.start()
    return thread


def test_actors_on_their_raylets_and_a_lost_node_costs_no_sample(raylets, tmp_path, caplog, capsys):
    cluster, nodes = raylets
    code, clean, placed = _run(cluster, tmp_path, "clean")
    assert code == 0
    raylet_of = {n.node_id: name for name, n in nodes.items()}
    for actor in placed["actors"]:      # the node Ray's actor table gave each actor = its plan node
        assert raylet_of[actor["node_id"]] == actor["gpus"][0].split(":")[0], actor
    assert all(r["weight_sync_bytes"] > 0 for r in clean)

    killer = _remove_when_written(cluster, nodes["gen-a"], tmp_path / "lost" / "metrics.jsonl")
    # the lost run syncs over the weight-sync group (the clean one through the object store): a broadcast broken by
    # the lost node's actor, the survivor catching up from the object store, the same samples as the clean run
    code, lost, _ = _run(cluster, tmp_path, "lost", "weight_sync=collective")
    killer.join()
    assert code == 0 and [r["step"] for r in lost] == [1, 2, 3]
    assert lost[-1]["rollout_failures"] >= 1
    assert any("gone for good (its node left the Ray cluster)" in r.getMessage() for r in caplog.records)
    for a, b in zip(clean, lost):   # chunks are seeded by position: the same samples, none lost or doubled
        for key in ("reward_mean", "response_len_mean", "sample_tokens"):
            assert a[key] == b[key], (a["step"], key)

    # the learners' node (gen-a is gone, so generation runs on gen-b alone): the run stops with exit code 1, its
    # checkpoint intact, and says how to resume
    one = {"groups": [{"tasks": ["actor_gen"], "gpus": ["gen-b:0"],
                       "parallelism": {"actor_gen": {"tp": 1, "pp": 1, "dp": 1}}}, PLAN["groups"][1]]}
    (tmp_path / "plan-gen-b.json").write_text(json.dumps({"plan": one}))
    killer = _remove_when_written(cluster, nodes["train"], tmp_path / "learners" / "checkpoints" / "latest")
    capsys.readouterr()
    code, _, _ = _run(cluster, tmp_path, "learners", "checkpoint_every=1", plan="plan-gen-b.json")
    killer.join()
    err = capsys.readouterr().err
    assert code == 1 and "a learner actor died" in err and "hetrl train --resume" in err, err[-2000:]
    assert (tmp_path / "learners" / "checkpoints" / "step_000001" / "model.safetensors").is_file()
