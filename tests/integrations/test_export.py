"""`hetrl plan --export verl|openrlhf` and `--import verl`, without the engines installed: the round trip over the
planner benchmark's plans, refusals before anything is written, gaps named by field, the CLI."""

import json
import os
import pathlib

import pytest

from hetrl.cli import main
from hetrl.integrations import openrlhf, verl
from hetrl.integrations.export import export, import_plan
from hetrl.planner import evaluate, load_cluster, load_workload
from hetrl.planner.plan import plan_from_dict
from hetrl.schema import InputError

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROWS = json.loads((ROOT / "benchmarks" / "results" / "planner.json").read_text())["rows"]
METHODS = ("hybrid", "ilp", "verl", "verl-all", "streamrl")


def paths(row):
    return str(ROOT / "examples" / "clusters" / f"{row['scenario']}.yaml"), \
        str(ROOT / "examples" / "workloads" / f"{row['workload']}.yaml")


def test_round_trip_every_paper_scenario_and_workload(tmp_path):
    """Item 5: 4 scenarios x 12 workloads: export -> read the verl settings back -> the same prediction as the plan
    exported as verl runs it (or the same reason it does not fit)."""
    assert len(ROWS) == 48
    for k, row in enumerate(ROWS):
        c, w = paths(row)
        out = tmp_path / f"e{k}"
        report = export("verl", c, w, row["hybrid"]["plan"], str(out))
        cluster, wl, plan = verl.read(str(out))
        back = evaluate(cluster, wl, plan)
        eng_plan = plan_from_dict(json.loads((out / "engine_plan.json").read_text()), cluster, wl)
        shape = lambda p: sorted((sorted(g.tasks), g.gpus, sorted(g.parallelism), g.swap) for g in p.groups)  # noqa: E731
        assert shape(plan) == shape(eng_plan), row
        if report["engine_iteration_time_s"] is None:
            assert not back.feasible and back.reason == report["engine_infeasible"], row
        else:
            assert back.iteration_time_s == pytest.approx(report["engine_iteration_time_s"], rel=1e-9), row
        assert report["plan_iteration_time_s"] == pytest.approx(row["hybrid"]["iteration_time_s"], rel=1e-9)


def test_a_plan_verl_runs_as_is_has_no_gaps(tmp_path):
    """One homogeneous pool, everything colocated, FSDP ZeRO-3, no DualKV, a batch the ranks divide: verl runs it
    exactly as planned, so the two predictions agree and nothing is listed."""
    c = ROOT / "examples" / "clusters" / "h100-2x8.yaml"
    w = tmp_path / "w.yaml"
    w.write_text("algorithm: grpo\nmode: sync\nmodels: {actor: qwen3-8b, reference: qwen3-8b}\n"
                 "prompts_per_step: 128\nresponses_per_prompt: 8\nprompt_tokens: {max: 1024, mean: 512}\n"
                 "response_tokens: {max: 1024, mean: 600}\ndualkv: false\n")
    gpus = [f"h{n}:{i}" for n in (0, 1) for i in range(8)]
    full = {"tp": 1, "pp": 1, "dp": 16}
    plan = {"groups": [{"tasks": ["actor_gen", "actor_infer", "ref_infer", "actor_train"], "gpus": gpus,
                        "data_split": "even", "swap": True, "parallelism": {
                            "actor_gen": {"tp": 2, "pp": 1, "dp": 8},
                            "actor_infer": full | {"zero": 3, "offload": "none", "recompute": True},
                            "ref_infer": full | {"zero": 3, "offload": "none", "recompute": True},
                            "actor_train": full | {"zero": 3, "offload": "none", "recompute": True}}}]}
    r = export("verl", str(c), str(w), plan, str(tmp_path / "out"))
    assert r["gaps"] == []
    assert r["engine_iteration_time_s"] == pytest.approx(r["plan_iteration_time_s"], rel=1e-12)
    ov = verl.parse_overrides((tmp_path / "out" / "overrides.txt").read_text())
    assert ov["model_engine"] == "dp" and ov["actor_rollout_ref.actor.fsdp_config.reshard_after_forward"] is True
    assert ov["actor_rollout_ref.actor.fsdp_config.param_offload"] is True      # swap = verl's time-sharing
    assert ov["actor_rollout_ref.rollout.free_cache_engine"] is True
    assert ov["trainer.nnodes"] == 2 and ov["trainer.n_gpus_per_node"] == 8
    assert not (tmp_path / "out" / "launch_hetrl.py").exists()      # one pool, one GPU type: verl's own main_ppo
    assert "python3 -m verl.trainer.main_ppo" in (tmp_path / "out" / "run.sh").read_text()


def test_gaps_name_the_plan_fields(tmp_path):
    row = next(r for r in ROWS if r["scenario"] == "paper-multi-region" and r["workload"] == "qwen3-8b-grpo-async")
    c, w = paths(row)
    r = export("verl", c, w, row["hybrid"]["plan"], str(tmp_path / "v"))
    fields = {g["field"] for g in r["gaps"]}
    assert "workload.dualkv" in fields
    assert any(f.endswith(".data_split") for f in fields)       # mixed A100/L40S group split by speed
    readme = (tmp_path / "v" / "README.md").read_text()
    for g in r["gaps"]:
        assert f"`{g['field']}`" in readme
    assert f"{r['plan_iteration_time_s']:.1f} s per iteration as planned" in readme
    pools = json.loads((tmp_path / "v" / "hetrl_pools.json").read_text())["pools"]
    assert (tmp_path / "v" / "launch_hetrl.py").exists()
    assert all(p["resource"] in readme for p in pools.values())     # the ray start lines that pin the pools
    # the sync version of a separated plan runs asynchronously on verl, and says so
    sync = next(r for r in ROWS if r["scenario"] == "paper-single-region" and r["workload"] == "qwen3-8b-grpo-sync")
    plan = sync["streamrl"]["plan"]
    r = export("verl", *paths(sync), plan, str(tmp_path / "s"))
    assert "workload.mode" in {g["field"] for g in r["gaps"]}
    ov = verl.parse_overrides((tmp_path / "s" / "overrides.txt").read_text())
    assert ov["trainer.v1.trainer_mode"] == "separate_async" and ov["actor_rollout_ref.hybrid_engine"] is False


@pytest.mark.parametrize("engine", ["verl", "openrlhf"])
def test_bad_plans_are_refused_before_anything_is_written(tmp_path, engine):
    row = ROWS[0]
    c, w = paths(row)
    good = row["hybrid"]["plan"]
    twice = json.loads(json.dumps(good))
    twice["groups"][1]["gpus"][0] = twice["groups"][0]["gpus"][0]
    missing = json.loads(json.dumps(good))
    missing["groups"][-1]["tasks"].pop()
    missing["groups"][-1]["parallelism"].pop(next(iter(set(good["groups"][-1]["tasks"])
                                                       - set(missing["groups"][-1]["tasks"]))))
    oom = {"groups": [{"tasks": ["actor_gen", "actor_infer", "ref_infer", "reward_infer", "actor_train"],
                       "gpus": ["l4-0:0"], "parallelism": {t: {"tp": 1, "pp": 1, "dp": 1} for t in
                                                           ["actor_gen", "actor_infer", "ref_infer", "reward_infer",
                                                            "actor_train"]}},
                      {"tasks": []}]}
    oom["groups"].pop()
    for bad, words in ((twice, "disjoint"), (missing, "each task once"), (oom, "out of memory")):
        out = tmp_path / "out"
        with pytest.raises(InputError, match=words):
            export(engine, c, w, bad, str(out))
        assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".hetrl")]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("x")
    with pytest.raises(InputError, match="not an empty folder"):
        export(engine, c, w, good, str(tmp_path / "full"))
    assert os.listdir(tmp_path / "full") == ["mine.txt"]


def test_openrlhf_runs_every_benchmark_plan_somehow(tmp_path):
    """Every benchmark plan exports; OpenRLHF's view of it is a plan hetrl can score (its roles, colocation
    switches and one DeepSpeed config), and the flags say what that view says."""
    for k, row in enumerate(ROWS):
        c, w = paths(row)
        cluster, wl = load_cluster(c), load_workload(w)
        for m in METHODS:
            plan = plan_from_dict(row[m]["plan"], cluster, wl)
            v = openrlhf.view(cluster, wl, plan)
            fl = openrlhf.flags(cluster, v)
            stage = int(fl[fl.index("--ds.zero_stage") + 1])
            for g in v.plan.groups:
                for t, p in g.parallelism:
                    assert p.pp == 1, (row, m, t)
                    if t in ("actor_train", "critic_train"):
                        assert p.zero == stage
            gen = v.plan.group_of("actor_gen").par("actor_gen")
            assert int(fl[fl.index("--vllm.num_engines") + 1]) * int(fl[fl.index("--vllm.tensor_parallel_size") + 1]) \
                == len(v.plan.group_of("actor_gen").gpus) == gen.dp * gen.tp
            colocated = "--train.colocate_all" in fl
            assert colocated == (len(v.plan.groups) == 1 or v.plan.group_of("actor_gen") is v.plan.group_of(
                "actor_train"))


def test_cli_export_and_import(tmp_path, capsys):
    c = str(ROOT / "examples" / "clusters" / "paper-multi-region.yaml")
    w = str(ROOT / "examples" / "workloads" / "qwen3-4b-grpo-sync.yaml")
    out = tmp_path / "verl-run"
    assert main(["plan", "--cluster", c, "--workload", w, "--time-limit", "2", "--export", "verl",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"exported for verl to {out}" in text and "as verl runs it" in text
    report = json.loads((out / "report.json").read_text())
    assert main(["plan", "--import", "verl", str(out), "--json"]) == 0
    back = json.loads(capsys.readouterr().out)
    assert back["iteration_time_s"] == pytest.approx(report["engine_iteration_time_s"], rel=1e-9)
    assert import_plan("verl", str(out))["plan"] == back["plan"]
    # refusals: one line, exit 2, nothing written
    assert main(["plan", "--cluster", c, "--workload", w, "--export", "verl"]) == 2
    assert "needs --out DIR" in capsys.readouterr().err
    assert main(["plan", "--cluster", c, "--workload", w, "--export", "verl", "--out", str(out)]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert main(["plan", "--import", "openrlhf", str(out)]) == 2
    assert "only verl exports" in capsys.readouterr().err
    assert main(["plan", "--workload", w]) == 2
    assert "--cluster and --workload" in capsys.readouterr().err
    orl = tmp_path / "orl"
    assert main(["plan", "--cluster", c, "--workload", w, "--evaluate", str(out / "plan.json"), "--export",
                 "openrlhf", "--out", str(orl)]) == 0
    assert "exported for OpenRLHF" in capsys.readouterr().out
    run = (orl / "run.sh").read_text()
    assert "openrlhf.cli.train_ppo_ray" in run and "--ds.zero_stage" in run and os.access(orl / "run.sh", os.X_OK)


@pytest.mark.parametrize("engine", ["verl", "openrlhf"])
def test_dynamic_sampling_the_export_does_not_configure_is_a_gap(tmp_path, engine):
    """A DAPO workload's dynamic sampling (rollout_batch_multiplier) was dropped from the export without a word;
    it is a gap now, and the engine's prediction prices every generated group as trained."""
    import yaml

    from hetrl.planner import plan as search

    text = yaml.safe_load((ROOT / "examples" / "workloads" / "qwen3-4b-grpo-sync.yaml").read_text())
    w_path = tmp_path / "dapo.yaml"
    w_path.write_text(yaml.safe_dump({**text, "algorithm": "dapo", "rollout_batch_multiplier": 2.0,
                                      "models": {**text["models"], "reference": None}}))
    c = str(ROOT / "examples" / "clusters" / "paper-single-region.yaml")
    found = search(load_cluster(c), load_workload(str(w_path)), "hybrid", time_limit_s=2, seed=0)
    r = export(engine, c, str(w_path), found.plan.to_dict(load_cluster(c)), str(tmp_path / engine))
    gap = next(g for g in r["gaps"] if g["field"] == "workload.rollout_batch_multiplier")
    assert "2x the prompts generated" in gap["text"] and "trains every group it generates" in gap["text"]
