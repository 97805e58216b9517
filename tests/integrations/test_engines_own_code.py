"""Exports checked by the engines' own code (item 4): verl 0.9.1's Hydra config and validate_config, OpenRLHF
0.11.2's argument parser and the checks train_ppo_ray runs after it, verl's ResourcePoolManager in the launcher.
They need the test extra (scripts/install.sh --test installs verl and openrlhf without their GPU dependencies);
without it they skip, saying why.

verl: the 240 planner-benchmark plans are composed on two bases (model_engine=dp and =megatron, each composed by
Hydra's compose API), with every plan's overrides applied by the function compose itself uses for them
(ConfigLoaderImpl._apply_overrides_to_config: unknown keys and wrong types fail as they would on the command
line); a sample is also composed in full and must give the same config. OpenRLHF builds its parser inside
`if __name__ == "__main__":` and its package imports CUDA-only code, so the test runs that block from
openrlhf/cli/train_ppo_ray.py's source (parser, hierarchize, the assertions), only `train(args)` replaced.
"""

import ast
import copy
import importlib.util
import json
import pathlib
import shlex

import pytest

from hetrl.integrations import openrlhf, verl
from hetrl.integrations.export import export
from hetrl.planner import load_cluster, load_workload
from hetrl.planner.plan import plan_from_dict

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROWS = json.loads((ROOT / "benchmarks" / "results" / "planner.json").read_text())["rows"]
METHODS = ("hybrid", "ilp", "verl", "verl-all", "streamrl")
EXTRA = "the engines' config layers are not installed (bash scripts/install.sh --test installs them)"


def _have(*mods):
    return all(importlib.util.find_spec(m) is not None for m in mods)


def _plans():
    for row in ROWS:
        c = ROOT / "examples" / "clusters" / f"{row['scenario']}.yaml"
        w = ROOT / "examples" / "workloads" / f"{row['workload']}.yaml"
        cluster, wl = load_cluster(str(c)), load_workload(str(w))
        for m in METHODS:
            yield row, m, cluster, wl, plan_from_dict(row[m]["plan"], cluster, wl)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A model directory verl's HFModelConfig can read (config, tokenizer): the tests' tiny Llama."""
    from hetrl.models import tiny_model, tiny_tokenizer

    d = tmp_path_factory.mktemp("tiny-model")
    tok = tiny_tokenizer()
    tok.save_pretrained(d)
    config = tiny_model(tok).config
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(d)
    return str(d)


def _paths(w, model_dir):
    out = [f"actor_rollout_ref.model.path={model_dir}", "data.train_files=/data/train.parquet",
           "data.val_files=/data/val.parquet"]
    if w.critic is not None:
        out.append(f"critic.model.path={model_dir}")
    if w.reward is not None:
        out.append(f"reward.reward_model.model_path={model_dir}")
    return out


@pytest.mark.skipif(not _have("hydra", "verl", "tensordict"), reason=EXTRA)
def test_every_benchmark_plan_composes_and_validates_in_verl(model_dir):
    from hydra import compose, initialize_config_module
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    parser = OverridesParser.create()
    checked, seen = 0, set()
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        bases = {e: compose(config_name="ppo_trainer", overrides=[f"model_engine={e}"]) for e in ("dp", "megatron")}
        for k, (row, m, cluster, w, plan) in enumerate(_plans()):
            v = verl.view(cluster, w, plan)
            ov = verl.overrides(cluster, v) + _paths(v.workload, model_dir)
            n = len(v.plan.group_of("actor_train").gpus)
            checked += 1
            if tuple(ov) in seen:   # the check is a function of the overrides: 107 distinct among the 240 plans
                continue
            seen.add(tuple(ov))
            engine = ov[0].split("=")[1]
            assert ov[0].startswith("model_engine=")
            cfg = copy.deepcopy(bases[engine])
            ConfigLoaderImpl._apply_overrides_to_config(parser.parse_overrides(ov[1:]), cfg)
            if len(seen) % 20 == 1:     # the fast path is compose's own: a full compose gives the same config
                assert compose(config_name="ppo_trainer", overrides=ov) == cfg, (row, m)
            validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
            assert need_critic(cfg) == (w.critic is not None)
            assert need_reference_policy(cfg) == (w.reference is not None)
            assert cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node == n, (row, m)
    assert checked == 240 and len(seen) > 50


def _openrlhf_main():
    """train_ppo_ray's `if __name__ == "__main__":` block, from its source, as a function of argv."""
    spec = importlib.util.find_spec("openrlhf")
    pkg = pathlib.Path(spec.submodule_search_locations[0])
    tree = ast.parse((pkg / "cli" / "train_ppo_ray.py").read_text())
    main = next(n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    body = []
    for node in main.body:
        if isinstance(node, ast.ImportFrom) and node.module == "openrlhf.utils.config":
            continue        # the package's __init__ imports CUDA-side code; the module is loaded by path below
        body.append(node)
    src = ast.unparse(ast.Module(body=body, type_ignores=[]))
    assert src.count("parser.parse_args()") == 1 and src.rstrip().endswith("train(args)")
    src = src.replace("parser.parse_args()", "parser.parse_args(ARGV)")
    cfg_spec = importlib.util.spec_from_file_location("openrlhf_config", pkg / "utils" / "config.py")
    cfg = importlib.util.module_from_spec(cfg_spec)
    cfg_spec.loader.exec_module(cfg)
    code = compile(src, str(pkg / "cli" / "train_ppo_ray.py"), "exec")

    def run(argv):
        import argparse
        import datetime as dt

        got = {}
        ns = {"argparse": argparse, "datetime": dt.datetime, "hierarchize": cfg.hierarchize, "ARGV": argv,
              "train": lambda args: got.setdefault("args", args)}
        exec(code, ns)
        return got["args"]
    return run


@pytest.mark.skipif(not _have("openrlhf"), reason=EXTRA)
def test_every_benchmark_plan_parses_with_openrlhfs_own_parser(tmp_path):
    run = _openrlhf_main()
    seen = set()
    for row, m, cluster, w, plan in _plans():
        v = openrlhf.view(cluster, w, plan)
        fl = openrlhf.flags(cluster, v) + ["--actor.model_name_or_path", "/m", "--data.prompt_dataset", "/d"]
        fl += ["--critic.model_name_or_path", "/c"] if w.critic is not None else []
        fl += ["--reward.model_name_or_path", "/r"] if w.reward is not None else ["--reward.remote_url", "/r.py"]
        if tuple(fl) in seen:
            continue
        seen.add(tuple(fl))
        args = run(fl)      # argparse exits (SystemExit) on an unknown flag or a bad value; the checks assert
        gen = v.plan.group_of("actor_gen")
        assert args.vllm.num_engines * args.vllm.tensor_parallel_size == len(gen.gpus)
        actor = v.plan.group_of("actor_train")
        assert args.actor.num_nodes * args.actor.num_gpus_per_node == len(actor.gpus)
        assert args.rollout.n_samples_per_prompt == w.responses_per_prompt
        assert args.train.colocate_all == (gen is actor)
        assert (args.critic.model_name_or_path is not None) == (w.critic is not None)
    # the written run.sh says the same flags (one per line in flags.txt)
    row = ROWS[5]
    out = tmp_path / "o"
    export("openrlhf", str(ROOT / "examples" / "clusters" / f"{row['scenario']}.yaml"),
           str(ROOT / "examples" / "workloads" / f"{row['workload']}.yaml"), row["hybrid"]["plan"], str(out))
    written = [x for line in (out / "flags.txt").read_text().splitlines() for x in shlex.split(line)]
    run(written + ["--actor.model_name_or_path", "/m", "--data.prompt_dataset", "/d", "--reward.remote_url", "/r"]
        + (["--critic.model_name_or_path", "/c"] if "ppo" in row["workload"] else []))


@pytest.mark.skipif(not _have("hydra", "verl", "tensordict", "ray"), reason=EXTRA)
def test_launcher_builds_verls_resource_pools(tmp_path):
    """launch_hetrl.py hands verl a ResourcePoolManager with one pool per plan group, pinned by node resource,
    and every verl role mapped to its group's pool."""
    from verl.single_controller.ray.base import ResourcePoolManager
    from verl.trainer.ppo.utils import Role

    row = next(r for r in ROWS if r["scenario"] == "paper-multi-region" and r["workload"] == "qwen3-8b-ppo-sync")
    out = tmp_path / "v"
    export("verl", str(ROOT / "examples" / "clusters" / f"{row['scenario']}.yaml"),
           str(ROOT / "examples" / "workloads" / f"{row['workload']}.yaml"), row["hybrid"]["plan"], str(out))
    pools = json.loads((out / "hetrl_pools.json").read_text())["pools"]
    spec = importlib.util.spec_from_file_location("launch_hetrl", out / "launch_hetrl.py")
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)

    class VerlTrainer:      # what verl's trainer base sets up before the launcher replaces the pools
        def _init_resource_pool_mgr(self):
            self.role_worker_mapping = {Role.ActorRolloutRef: object, Role.Critic: object}
            self.mapping = {Role.ActorRolloutRef: "global_pool", Role.Critic: "global_pool",
                            Role.RewardModel: "reward_pool"}

    t = launcher.pinned(VerlTrainer)()
    t._init_resource_pool_mgr()
    mgr = t.resource_pool_manager
    assert isinstance(mgr, ResourcePoolManager)
    assert mgr.resource_pool_spec == {n: list(p["nodes"].values()) for n, p in pools.items()}
    owner = {r: n for n, p in pools.items() for r in p["roles"]}
    assert mgr.mapping[Role.ActorRolloutRef] == owner["actor"]
    assert mgr.mapping[Role.Critic] == owner["critic"]
    assert mgr.mapping[Role.RewardModel] == owner["rm"]
    assert sum(map(sum, mgr.resource_pool_spec.values())) == sum(
        len(g["gpus"]) for g in json.loads((out / "engine_plan.json").read_text())["groups"])


@pytest.mark.skipif(not _have("verl"), reason=EXTRA)
def test_every_verl_name_the_launcher_uses_is_in_verls_source():
    """The launcher's task runner mirrors verl 0.9.1's TaskRunnerV1 and imports its pieces (the v1 trainer needs
    GPU-side packages to import here): every `from verl... import name` must name something that module defines
    or re-exports, so a verl that renames one fails here rather than on a cluster."""
    root = pathlib.Path(importlib.util.find_spec("verl").submodule_search_locations[0]).parent
    tree = ast.parse(verl.LAUNCHER)
    imports = [(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
               and (n.module or "").startswith("verl") for a in n.names]
    assert len(imports) >= 10
    for module, name in imports:
        base = root.joinpath(*module.split("."))
        path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        text = path.read_text()
        assert any(pat in text for pat in (f"def {name}(", f"class {name}(", f"class {name}:", f"{name} =",
                                           f"import {name}", f" {name},", f"({name},", f", {name})")), \
            f"{module} has no {name}"
