"""Bad input, from the user's side: every case is the CLI's exit code 2 and one line on stderr that names the
file and the field (no traceback); `hetrl validate` says the same without running anything."""

import json
import os
import pathlib

import pytest
import yaml

from hetrl.cli import main

ROOT = pathlib.Path(__file__).parents[1]
CLUSTER = ROOT / "examples" / "clusters" / "paper-single-region.yaml"
WORKLOAD = ROOT / "examples" / "workloads" / "qwen3-4b-grpo-sync.yaml"
TINY = str(ROOT / "examples" / "runs" / "tiny.yaml")
ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")) + "name: *i\n"


def one_line_error(capsys, rc, *needles):
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _cluster(**node) -> dict:
    data = yaml.safe_load(CLUSTER.read_text())
    data["nodes"][0].update(node)
    return data


def _write(tmp_path, name, data) -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(path)


CLUSTER_CASES = [
    ("count-string", _cluster(count="8"), ["nodes[0]", "count must be an int >= 1, got '8'"]),
    ("count-fraction", _cluster(count=2.5), ["nodes[0]", "count must be an int >= 1, got 2.5"]),
    ("count-negative", _cluster(count=-1), ["nodes[0]", "count"]),
    ("zero-bandwidth", _cluster(network_gbps=0), ["nodes[0]", "network_gbps must be a finite number > 0"]),
    ("nan-bandwidth", _cluster(network_gbps=float("nan")), ["nodes[0]", "network_gbps"]),
    ("misspelt-link", _cluster(intra_node="nvlnk"),
     ["intra_node must be one of nvlink, pcie", "did you mean 'nvlink'"]),
    ("unknown-key", _cluster(gpus=8), ["nodes[0]", "unknown key(s) ['gpus']"]),
    ("unknown-gpu", _cluster(gpu="B300"), ["unknown GPU type 'B300'"]),
    ("nodes-map", {"name": "x", "nodes": {"a": 1}}, ["nodes must be a list"]),
    ("not-a-mapping", "- a\n- b\n", ["must be a mapping"]),
    ("invalid-yaml", "name: [unclosed\n", ["is not valid YAML: line 2, column 1: expected ',' or ']', but got "
                                           "'<stream end>' (while parsing a flow sequence at line 1, column 7)"]),
    ("alias-bomb", ALIAS_BOMB, ["expands to more than 1,000,000 values"]),
    ("name-not-text", {**_cluster(), "name": ["a", "b"]}, ["name must be a string"]),
]


@pytest.mark.parametrize("data, needles", [c[1:] for c in CLUSTER_CASES], ids=[c[0] for c in CLUSTER_CASES])
def test_bad_cluster_files(tmp_path, capsys, data, needles):
    path = _write(tmp_path, "cluster.yaml", data)
    rc = main(["plan", "--cluster", path, "--workload", str(WORKLOAD), "--method", "verl"])
    line = one_line_error(capsys, rc, *needles)
    assert "cluster.yaml" in line
    assert main(["validate", path]) == 2
    assert one_line_error(capsys, 2, *needles)


def _workload(**changes) -> dict:
    data = yaml.safe_load(WORKLOAD.read_text())
    data.update(changes)
    return data


WORKLOAD_CASES = [
    ("prompts-string", _workload(prompts_per_step="128"), ["prompts_per_step must be an int >= 1, got '128'"]),
    ("zero-responses", _workload(responses_per_prompt=0), ["responses_per_prompt"]),
    ("dualkv-string", _workload(dualkv="yes"), ["dualkv must be true or false, got 'yes'"]),
    ("lengths-not-map", _workload(prompt_tokens=512), ["prompt_tokens must be {max: N, mean: M}"]),
    ("mean-above-max", _workload(prompt_tokens={"max": 8, "mean": 9}),
     ["prompt_tokens", "mean (9) must be <= max (8)"]),
    ("model-missing-keys", _workload(models={"actor": {"layers": 2}}), ["models.actor", "missing key(s)"]),
    ("algorithm", _workload(algorithm="ppoo"), ["algorithm must be one of grpo, dapo, ppo", "did you mean 'ppo'"]),
    ("unknown-key", _workload(prompt_per_step=4), ["unknown key(s) ['prompt_per_step']",
                                                   "did you mean 'prompts_per_step'"]),
]


@pytest.mark.parametrize("data, needles", [c[1:] for c in WORKLOAD_CASES], ids=[c[0] for c in WORKLOAD_CASES])
def test_bad_workload_files(tmp_path, capsys, data, needles):
    path = _write(tmp_path, "workload.yaml", data)
    rc = main(["plan", "--cluster", str(CLUSTER), "--workload", path, "--method", "verl"])
    assert "workload.yaml" in one_line_error(capsys, rc, *needles)


@pytest.fixture(scope="module")
def good_plan(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    assert main(["plan", "--cluster", str(CLUSTER), "--workload", str(WORKLOAD), "--method", "verl",
                 "--out", str(out)]) == 0
    return json.loads(out.read_text())["plan"]


def _plan_with(good, **par):
    plan = json.loads(json.dumps(good))
    plan["groups"][0]["parallelism"]["actor_gen"].update(par)
    return plan


PLAN_CASES = [
    ("negative-tp", lambda g: _plan_with(g, tp=-1),
     ["groups[0].parallelism.actor_gen", "tp must be an int >= 1, got -1"]),
    ("fractional-dp", lambda g: _plan_with(g, dp=1.5), ["groups[0].parallelism.actor_gen", "dp must be an int >= 1"]),
    ("string-pp", lambda g: _plan_with(g, pp="1"), ["pp must be an int >= 1, got '1'"]),
    ("misspelt-degree", lambda g: _plan_with(g, dpp=2), ["unknown key(s) ['dpp']", "valid keys: tp, pp, dp"]),
    ("misspelt-group-key", lambda g: {"groups": [{**g["groups"][0], "data_spilt": "even"}]},
     ["groups[0]", "unknown key(s) ['data_spilt']", "did you mean 'data_split'"]),
    ("unknown-top-key", lambda g: {**g, "notes": "x"}, ["unknown key(s) ['notes']"]),
    ("gpu-twice", lambda g: {"groups": [{**g["groups"][0],
                                         "gpus": [g["groups"][0]["gpus"][0]] * len(g["groups"][0]["gpus"])}]},
     ["task groups must own disjoint GPUs"]),
    ("task-missing", lambda g: {"groups": [{**g["groups"][0], "tasks": ["actor_gen"],
                                            "parallelism": {"actor_gen": g["groups"][0]["parallelism"]["actor_gen"]}}]},
     ["must place each task once"]),
    ("malformed-json", lambda g: '{"groups": [', ["plan.json is not valid JSON"]),
]


@pytest.mark.parametrize("make, needles", [c[1:] for c in PLAN_CASES], ids=[c[0] for c in PLAN_CASES])
def test_bad_plan_files(tmp_path, capsys, good_plan, make, needles):
    data = make(good_plan)
    path = tmp_path / "plan.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    rc = main(["plan", "--cluster", str(CLUSTER), "--workload", str(WORKLOAD), "--evaluate", str(path)])
    assert "plan.json" in one_line_error(capsys, rc, *needles)


def test_out_is_checked_before_the_search(tmp_path, capsys):
    args = ["plan", "--cluster", str(CLUSTER), "--workload", str(WORKLOAD), "--method", "verl"]
    one_line_error(capsys, main([*args, "--out", str(tmp_path)]), "is a directory")
    one_line_error(capsys, main([*args, "--out", str(tmp_path / "missing" / "p.json")]), "does not exist")
    assert main([*args, "--out", str(tmp_path / "p.json")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]   # no stray temporary file


TRAIN_CASES = [
    ("infinite-lr", ["lr=.inf"], ["the command line", "lr must be a finite number > 0, got inf"]),
    ("nan-lr", ["lr=.nan"], ["lr must be a finite number > 0"]),
    ("fractional-steps", ["steps=2.5"], ["steps must be an int >= 1, got 2.5"]),
    ("negative-seed", ["seed=-1"], ["seed must be an int >= 0"]),
    ("top-p", ["top_p=2"], ["top_p must be a finite number in (0, 1]"]),
    ("algorithm", ["algorithm=ppoo"], ["algorithm must be one of grpo, dapo"]),
    ("dtype", ["dtype=fp8"], ["dtype must be one of float32, bfloat16, float64"]),
    ("task-config-list", ["task_config=[1, 2]"], ["task_config must be a mapping"]),
    ("unknown-key", ["lerning_rate=1"], ["unknown config key(s) ['lerning_rate']"]),
    ("ray-without-cluster", ["executor=ray"], ["executor=ray needs exactly one of cluster="]),
    ("bad-yaml-value", ["task_config=[1"], ["override 'task_config=[1': the value is not valid YAML"]),
    ("device", ["device=tpu"], ["device must be auto, cpu, cuda or cuda:N, got 'tpu'"]),
    ("device-on-ray", ["executor=ray", "emulate_cluster=examples/clusters/cpu-2x2.yaml", "device=cuda"],
     ["device=cuda is for the local executor"]),
    ("lora-rank", ["lora_rank=-1"], ["lora_rank must be an int >= 0"]),
    ("reward-weights", ["reward=[verifier, format]", "reward_weights=[1]"], ["reward_weights has 1 weights for 2"]),
    ("report-to", ["report_to=mlflow"], ["report_to must be one of none, tensorboard, wandb"]),
    ("lora-no-targets", ["lora_rank=4", "lora_target_modules=[]"], ["lora_target_modules is empty"]),
    ("nonfinite", ["nonfinite=ignore"], ["nonfinite must be one of stop, skip"]),
    ("reward-errors", ["reward_errors=retry"], ["reward_errors must be one of stop, skip"]),
    ("timeout-in-process", ["reward_timeout_s=5"], ["reward_timeout_s=5 needs reward_workers >= 1"]),
    ("strict-text", ["strict=maybe"], ["strict must be true or false"]),
    # cross-field siblings: each silent conflict refused in one line
    ("sequence-level-vanilla", ["importance_sampling_level=sequence", "loss_mode=vanilla"],
     ["importance_sampling_level=sequence is GSPO", "loss_mode=vanilla"]),
    ("gspo-preset-vanilla", ["algorithm=gspo", "loss_mode=vanilla"],
     ["loss_mode=vanilla with algorithm=gspo would take gspo's clip range (0.0003, 0.0004)"]),
    ("warmup-past-the-run", ["warmup_steps=1000000000", "steps=2"],
     ["warmup_steps (1000000000) exceeds the run's 4 optimizer steps"]),
    ("sapo-tau", ["loss_mode=sapo", "loss_options={tau_pos: -1}"], ["tau_pos must be > 0"]),
    ("adaptive-kl-in-loss", ["kl_ctrl=adaptive"], ["kl_ctrl=adaptive", "needs use_kl_in_reward=true"]),
    ("alias-as-typed", ["beta=.nan"], ["the command line: beta (kl_coef) must be a finite number >= 0"]),
    ("tool-calls-unbounded", ["tools=examples/tools/calculator.py:multiply", "max_tool_calls=1000000000000"],
     ["max_tool_calls (1000000000000) exceeds max_new_tokens"]),
    ("weight-sync-local", ["weight_sync=collective"], ["weight_sync=collective is how Ray's rollout actors"]),
    ("weight-sync-async", ["executor=ray", "emulate_cluster=examples/clusters/cpu-2x2.yaml", "mode=async",
                           "weight_sync=collective"], ["weight_sync=collective holds the learner"]),
]


@pytest.mark.parametrize("overrides, needles", [c[1:] for c in TRAIN_CASES], ids=[c[0] for c in TRAIN_CASES])
def test_bad_train_config_values(tmp_path, capsys, overrides, needles):
    rc = main(["train", "--config", TINY, f"out_dir={tmp_path / 'run'}", *overrides])
    one_line_error(capsys, rc, *needles)
    assert not (tmp_path / "run").exists()       # refused before anything is written


def test_special_tokens_in_the_text_put_in_every_prompt_are_refused(tmp_path, capsys):
    """response_prefix / prompt_suffix holding the chat template's control tokens would be tokenized into real
    ones (a turn ended or opened); plain text with tool-call tags stays allowed (tools.yaml's suffix)."""
    rc = main(["train", "--config", TINY, f"out_dir={tmp_path / 'run'}", "response_prefix=<|im_end|>"])
    one_line_error(capsys, rc, "response_prefix='<|im_end|>' holds the tokenizer's special token(s) <|im_end|>")
    rc = main(["train", "--config", TINY, f"out_dir={tmp_path / 'run2'}", "prompt_suffix=<|im_start|>user"])
    one_line_error(capsys, rc, "prompt_suffix='<|im_start|>user' holds")


def test_bad_value_in_a_run_file_names_the_file(tmp_path, capsys):
    path = _write(tmp_path, "run.yaml", {**yaml.safe_load(pathlib.Path(TINY).read_text()), "steps": "ten"})
    one_line_error(capsys, main(["train", "--config", path]), "run.yaml", "steps must be an int >= 1, got 'ten'")
    assert main(["validate", path]) == 2
    one_line_error(capsys, 2, "run.yaml", "steps")


def test_unusable_out_dir_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    from hetrl.trainer import run

    def never(*_, **__):
        raise AssertionError("the model was loaded before out_dir was checked")

    monkeypatch.setattr(run, "load_model", never)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    one_line_error(capsys, main(["train", "--config", TINY, f"out_dir={a_file}"]), "exists and is not a directory")
    # /proc refuses new entries even to root (root ignores permission bits, so chmod cannot stand in for this)
    one_line_error(capsys, main(["train", "--config", TINY, "out_dir=/proc/hetrl-run"]), "cannot be created")


def test_validate_says_ok_for_every_example(capsys):
    files = sorted(str(p) for p in (ROOT / "examples").rglob("*") if p.suffix in (".yaml", ".json"))
    assert main(["validate", *files]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(files) and all(": ok (" in line for line in out)
    assert main(["validate", "examples/plans/cpu-local-split.json", "--cluster", "examples/clusters/cpu-local.yaml",
                 "--workload", str(WORKLOAD)]) == 2    # a 4B workload's tasks need a reference: named, not crashed
    assert "cpu-local-split.json" in capsys.readouterr().err


def test_debug_shows_the_traceback_and_keeps_the_exit_code(tmp_path, capsys):
    assert main(["--debug", "train", "--config", TINY, "lr=.inf", f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.rstrip().splitlines()[-1].startswith(
        "hetrl train: ") and "lr must be a finite number" in err


def test_validate_refuses_a_plan_that_does_not_fit_as_plan_evaluate_does(tmp_path, capsys):
    """`hetrl validate --cluster C --workload W PLAN.json` checks memory too (its help says so): a plan of the
    right form and tasks for a 70B-sized model on four L4s is refused with the cost model's reason."""
    text = yaml.safe_load((ROOT / "examples" / "workloads" / "smollm2-135m-ppo-cpu.yaml").read_text())
    big = dict(text["models"]["actor"]) if isinstance(text["models"]["actor"], dict) else {}
    big.update(layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128, intermediate=28672, vocab=128256)
    text["models"] = {k: big for k in text["models"]}
    w = _write(tmp_path, "big.yaml", text)
    cluster, plan_ = "examples/clusters/cpu-2x2.yaml", "examples/plans/cpu-2x2-ppo.json"
    assert main(["validate", "--cluster", cluster, "--workload", "examples/workloads/smollm2-135m-ppo-cpu.yaml",
                 plan_]) == 0
    assert "fits examples/clusters/cpu-2x2.yaml" in capsys.readouterr().out
    line = one_line_error(capsys, main(["validate", "--cluster", cluster, "--workload", w, plan_]),
                          "cpu-2x2-ppo.json", "the plan cannot run", "out of memory")
    assert "GB usable" in line


def test_a_one_gpu_type_cluster_says_why_streamrl_has_no_plan_and_the_json_is_standard(capsys):
    """streamrl splits generation and training over two GPU types (or regions of one): on one type in one region
    it says so, not "no plan fits in memory"; and --json is standard JSON (no Infinity) for the baseline."""
    args = ["plan", "--cluster", "examples/clusters/h100-2x8.yaml", "--workload",
            "examples/workloads/smollm2-135m-ppo-cpu.yaml"]
    one_line_error(capsys, main([*args, "--method", "streamrl"]), "streamrl: it generates on one GPU type",
                   "no two disjoint sets")
    assert main([*args, "--method", "verl", "--json"]) == 0
    report = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert report["baselines"]["streamrl"]["iteration_time_s"] is None
    assert "GPU type" in report["baselines"]["streamrl"]["error"]
    assert main(args[:5] + ["--method", "verl"]) == 0
    assert "streamrl   no plan (it generates on one GPU type" in capsys.readouterr().out


def test_png_and_out_errors_name_their_own_flag(tmp_path, capsys):
    args = ["plan", "--cluster", str(CLUSTER), "--workload", str(WORKLOAD), "--method", "verl"]
    one_line_error(capsys, main([*args, "--png", str(tmp_path / "no" / "x.png")]), "--png ", "does not exist")
    one_line_error(capsys, main([*args, "--out", str(tmp_path / "no" / "x.json")]), "--out ", "does not exist")


def test_a_plan_report_without_its_plan_says_so(tmp_path, capsys):
    report = {"iteration_time_s": 1.0, "baselines": {}, "breakdown": {}}
    path = _write(tmp_path, "report.json", json.dumps(report))
    one_line_error(capsys, main(["plan", "--cluster", str(CLUSTER), "--workload", str(WORKLOAD), "--evaluate", path]),
                   "report.json", "report without its 'plan' key")


@pytest.mark.parametrize("argv", [
    ["bench", "dualkv", "--quick", "--repeats", "-1"],
    ["bench", "tree", "--quick", "--repeats", "0"],
    ["diagnose", "mismatch", "--prompts", "-3"],
    ["diagnose", "mismatch", "--prompts", "0"],
    ["bench", "train", "--steps", "two"],
])
def test_counts_below_one_are_refused_before_anything_runs(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "expected a whole number >= 1" in capsys.readouterr().err


def test_bench_outputs_and_options_are_checked_before_anything_runs(tmp_path, capsys):
    """--out below a file (bench demo ran 5 minutes, then named its .tmp file), a folder --out that is a file ('File
    exists'), --device gpu (a torch traceback), and --set of what the benchmark sets per run (steps=2 ran 16 steps)
    or of a key that does not exist: one line each, exit 2, nothing run."""
    afile = tmp_path / "afile"
    afile.write_text("")
    one_line_error(capsys, main(["bench", "demo", "--quick", "--out", f"{afile}/x.json"]),
                   f"--out {afile}/x.json: {afile} is a file, not a folder")
    one_line_error(capsys, main(["bench", "dualkv", "--quick", "--out", str(afile)]),
                   f"--out {afile}: {afile} is a file; --out names a folder")
    one_line_error(capsys, main(["bench", "tree", "--quick", "--out", f"{afile}/d"]), f"{afile} is a file")
    one_line_error(capsys, main(["bench", "train", "--set", "model=tiny", "steps=2", "--out", str(tmp_path)]),
                   "--set steps=2: the benchmark sets steps for each run; use --steps N")
    one_line_error(capsys, main(["bench", "train", "--set", "stpes=2", "--out", str(tmp_path)]),
                   "--set: unknown config key(s) ['stpes'] (did you mean 'steps'?)")
    with pytest.raises(SystemExit) as exc:
        main(["bench", "dualkv", "--layer", "tiny", "--device", "gpu"])
    assert exc.value.code == 2 and "expected cpu, cuda or cuda:N, got 'gpu'" in capsys.readouterr().err


def test_a_task_config_typo_is_refused_up_front_with_the_option_meant(tmp_path, capsys):
    run = _write(tmp_path, "run.yaml", {"model": "tiny", "task_config": {"max_digitz": 3}, "out_dir": str(tmp_path)})
    one_line_error(capsys, main(["validate", run]), "unknown option(s) ['max_digitz']", "did you mean 'max_digits'")
    one_line_error(capsys, main(["train", "--config", run]), "unknown option(s) ['max_digitz']")
    assert not (tmp_path / "metrics.jsonl").exists()
    run = _write(tmp_path, "run2.yaml", {"model": "tiny", "task_config": {"min_terms": 3, "max_terms": 2}})
    one_line_error(capsys, main(["validate", run]), "max_terms must be >= min_terms")


def test_a_model_too_big_for_the_cluster_is_one_line_not_a_key_error(capsys):
    """Reproduction 1: the memory check left its free-memory map half filled and the search read a missing GPU."""
    rc = main(["plan", "--cluster", "examples/clusters/cpu-local.yaml",
               "--workload", "examples/workloads/qwen3-14b-ppo-sync.yaml"])
    one_line_error(capsys, rc, "no plan fits in memory")


def test_cluster_with_no_ray_running_is_one_line(tmp_path, capsys):
    pytest.importorskip("ray")
    import ray

    assert not ray.is_initialized()
    rc = main(["train", "--config", TINY, "executor=ray", "cluster=examples/clusters/cpu-local.yaml",
               "ray_address=auto", f"out_dir={tmp_path / 'r'}"])
    one_line_error(capsys, rc, "no Ray cluster answers at ray_address=auto", "emulate_cluster=")


def test_a_plan_with_zero_true_is_refused_not_read_as_1():
    from hetrl.planner.plan import Parallelism
    from hetrl.schema import InputError

    with pytest.raises(InputError, match="zero must be one of 1, 2, 3, got True"):
        Parallelism(zero=True)


def test_a_missing_critic_model_is_named_as_critic_model(tmp_path, capsys):
    rc = main(["train", "--config", TINY, f"out_dir={tmp_path / 'run'}", "algorithm=ppo",
               f"critic_model={tmp_path / 'nope'}"])
    one_line_error(capsys, rc, f"critic_model={tmp_path / 'nope'}:")


def test_rays_session_files_go_under_out_dir(tmp_path, capsys):
    from hetrl.trainer.config import load_config
    from hetrl.trainer.ray_executor import ray_temp_dir

    short = tmp_path.parent / "r"    # pytest's own tmp_path is deep; a short one as a user's runs/x would be
    cfg = load_config(TINY, ["executor=ray", "emulate_cluster=examples/clusters/cpu-2x2.yaml", f"out_dir={short}"])
    assert ray_temp_dir(cfg) == str((short / "ray").resolve()) and (short / "ray").is_dir()
    deep = tmp_path / ("d" * 80)
    cfg = load_config(TINY, ["executor=ray", "emulate_cluster=examples/clusters/cpu-2x2.yaml", f"out_dir={deep}"])
    got = ray_temp_dir(cfg)
    said = capsys.readouterr().out   # the path it measured is named (the user's out_dir is not what was too long)
    assert "hetrl-ray-" in got and f"they are in {got} instead" in said and f"would go to {deep / 'ray'} (" in said
    os.rmdir(got)
    with pytest.raises(ValueError, match="too long for Ray's unix sockets"):
        ray_temp_dir(load_config(TINY, ["executor=ray", "emulate_cluster=examples/clusters/cpu-2x2.yaml",
                                        f"ray_temp_dir={deep}"]))


def test_a_users_own_error_is_said_with_its_class_file_and_line(tmp_path, monkeypatch):
    """An error raised in the user's own code that reaches the CLI is one line with the exception's class and the
    file and line it came from; hetrl's own one-line errors stay as they are."""
    import importlib

    from hetrl.cli import _one_line
    from hetrl.schema import InputError

    (tmp_path / "my_env.py").write_text("def make():\n    raise ValueError('init boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        importlib.import_module("my_env").make()
    except ValueError as e:
        said = _one_line(e)
    assert said.startswith("ValueError: init boom (") and said.endswith("my_env.py:2)"), said
    assert _one_line(InputError("steps must be an int")) == "steps must be an int"


def test_a_key_given_twice_in_a_yaml_file_is_refused_not_the_last_one_kept(tmp_path, capsys):
    run = _write(tmp_path, "run.yaml", "model: tiny\nsteps: 1\nsteps: 2\n")
    one_line_error(capsys, main(["validate", run]), "run.yaml", "the key 'steps' is given twice (lines 2 and 3)")
    # a merge key's value may still be overridden (the examples' anchors and aliases stay valid)
    cluster = _write(tmp_path, "c.yaml", "base: &n {name: a, region: r, gpu: H100, count: 8}\nname: c\n"
                     "nodes:\n  - <<: *n\n    count: 4\n")
    capsys.readouterr()
    from hetrl.schema import read_yaml

    assert read_yaml(cluster)["nodes"][0]["count"] == 4


def test_a_run_config_path_found_only_from_another_folder_says_where(tmp_path, capsys, monkeypatch):
    """Paths in a run config are read from the current directory; run from elsewhere, the error names the folder
    from which the path is found (examples/ is written to run from the repository root)."""
    monkeypatch.chdir(tmp_path)
    one_line_error(capsys, main(["validate", str(ROOT / "examples" / "runs" / "own_data.yaml")]),
                   "data: examples/data/arithmetic_chat.jsonl is not found from the current directory",
                   f"found from {ROOT}")


def test_evaluate_and_method_together_are_refused(capsys):
    one_line_error(capsys, main(["plan", "--cluster", "examples/clusters/cpu-2x2.yaml", "--workload",
                                 "examples/workloads/smollm2-135m-ppo-cpu.yaml", "--method", "ilp", "--evaluate",
                                 "examples/plans/cpu-2x2-ppo.json"]), "give one of the two")


def test_import_names_the_engine_it_reads(tmp_path, capsys):
    one_line_error(capsys, main(["plan", "--import", "foo", str(tmp_path)]), "engine must be verl", "'foo'")


def test_the_plan_table_keeps_its_columns_apart_at_any_width():
    from hetrl.planner.report import format_report

    group = {"tasks": ["actor_gen"], "gpus": ["n:0"], "parallelism": {"actor_gen": {"tp": 1, "pp": 1, "dp": 100000}}}
    r = {"method": "hybrid", "workload": "w", "cluster": "c", "iteration_time_s": 1.0, "samples_per_s": 1.0,
         "tokens_per_s": 1.0, "search_time_s": 0.1, "plan": {"groups": [group]}, "task_times_s": {"actor_gen": 1.0},
         "breakdown": {}, "baselines": {}}
    row = next(line for line in format_report(r).splitlines() if "actor_gen" in line)
    assert row.split()[-4:] == ["1", "1", "100000", "1.0"], row
    assert "baselines:" not in format_report(r)


def test_a_plan_slower_than_a_baseline_is_said_slower(tmp_path, capsys):
    """--evaluate of a user's plan slower than verl said '0.74x faster'."""
    tasks = ["actor_gen", "ref_infer", "actor_infer", "actor_train", "critic_infer", "critic_train"]
    plan = {"groups": [{"tasks": tasks, "gpus": ["node-a:0"], "parallelism": {t: {"tp": 1, "pp": 1, "dp": 1}
                                                                              for t in tasks}}]}
    path = _write(tmp_path, "plan.json", json.dumps(plan))
    assert main(["plan", "--cluster", "examples/clusters/cpu-2x2.yaml", "--workload",
                 "examples/workloads/smollm2-135m-ppo-cpu.yaml", "--evaluate", path]) == 0
    out = capsys.readouterr().out
    assert "x slower" in out and "0." not in out.split("verl ", 1)[1].split("\n")[0].split("->")[1]


def test_validate_checks_a_plans_own_form_without_a_cluster(tmp_path, capsys):
    """A GPU in two groups, a task placed twice, tp*pp*dp not the group's size: none needs the cluster or the
    workload, and `hetrl validate PLAN.json` alone said ok to all three."""
    def plan(**change):
        dp2 = {"tp": 1, "pp": 1, "dp": 2}
        groups = [{"tasks": ["actor_gen", "actor_train"], "gpus": ["n:0", "n:1"],
                   "parallelism": {"actor_gen": dp2, "actor_train": dp2}},
                  {"tasks": ["ref_infer"], "gpus": ["n:2"], "parallelism": {"ref_infer": {"tp": 1, "pp": 1, "dp": 1}}}]
        for i, g in change.items():
            groups[int(i[1:])] |= g
        return json.dumps({"groups": groups})

    cases = [(plan(g1={"gpus": ["n:1"]}), "task groups must own disjoint GPUs; shared: ['n:1']"),
             (plan(g1={"tasks": ["actor_train"], "parallelism": {"actor_train": {"tp": 1, "pp": 1, "dp": 1}}}),
              "places actor_train more than once"),
             (plan(g0={"parallelism": {"actor_gen": {"tp": 1, "pp": 1, "dp": 2},
                                       "actor_train": {"tp": 2, "pp": 2, "dp": 2}}}),
              "actor_train: tp*pp*dp = 2*2*2 = 8 must equal the group's 2 GPUs")]
    for i, (text, needle) in enumerate(cases):
        path = _write(tmp_path, f"p{i}.json", text)
        one_line_error(capsys, main(["validate", path]), f"p{i}.json: ", needle)
    assert main(["validate", _write(tmp_path, "ok.json", plan())]) == 0


def test_validate_refuses_a_device_this_machine_does_not_have(tmp_path, capsys):
    """validate said ok to device=cuda on a machine without CUDA, which train refuses first; where CUDA is there,
    the same file is ok."""
    import torch

    run = _write(tmp_path, "run.yaml", {"model": "tiny", "device": "cuda"})
    if torch.cuda.is_available():
        assert main(["validate", run]) == 0
    else:
        one_line_error(capsys, main(["validate", run]), "run.yaml: device=cuda", "checked on this machine")


def test_validate_refuses_what_train_refuses_before_its_first_step(tmp_path, capsys, monkeypatch):
    """validate said ok to a tracker whose package is missing, to impl=flex on the CPU (train failed at its first
    update, after the model loaded and the held-out evaluation ran) and to a micro-batch smaller than one sequence
    (train failed at the packing, naming its internal max_tokens)."""
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)   # as where wandb is not installed
    run = _write(tmp_path, "run.yaml", {"model": "tiny", "report_to": "wandb"})
    one_line_error(capsys, main(["validate", run]), "run.yaml: report_to=wandb needs the wandb package",
                   "wandb==0.31.0")
    run = _write(tmp_path, "run.yaml", {"model": "tiny", "impl": "flex", "device": "cpu"})
    one_line_error(capsys, main(["validate", run]), "run.yaml: impl=flex cannot train on the CPU", "impl=sdpa")
    one_line_error(capsys, main(["train", "--config", TINY, "impl=flex", "device=cpu",
                                 f"out_dir={tmp_path / 'flex'}"]), "impl=flex cannot train on the CPU")
    run = _write(tmp_path, "run.yaml", {"model": "tiny", "micro_batch_tokens": 500})
    one_line_error(capsys, main(["validate", run]), "run.yaml: micro_batch_tokens (500) is below one sequence",
                   "max_prompt_tokens (512)", "max_new_tokens (16) is 528 tokens", "raise micro_batch_tokens to 528")


def test_a_workload_refuses_what_hetrl_train_refuses_for_its_algorithm(tmp_path, capsys):
    """A grpo workload of one response per prompt (every advantage 0) and a dapo workload with a reference model
    (DAPO has no KL) were planned without a word; hetrl train refuses both."""
    base = yaml.safe_load(WORKLOAD.read_text())
    for change, needles in (({"responses_per_prompt": 1}, ["responses_per_prompt (1) must be >= 2"]),
                            ({"algorithm": "dapo"}, ["dapo has no KL term", "models.reference: null"])):
        path = _write(tmp_path, "w.yaml", {**base, **change})
        one_line_error(capsys, main(["validate", path]), "w.yaml", *needles)
    ok = {**base, "algorithm": "dapo", "models": {**base["models"], "reference": None}}
    assert main(["validate", _write(tmp_path, "w.yaml", ok)]) == 0


def test_gpu_and_link_names_are_read_in_any_case(tmp_path, capsys):
    """gpu: h100 was an unknown GPU type and intra_node: NVLink not one of nvlink, pcie; any case is the catalog's
    spelling now, and the cluster is the one spelled so (the planner groups nodes by that name)."""
    from hetrl.planner.spec import cluster_from_dict

    base = yaml.safe_load(CLUSTER.read_text())
    node = base["nodes"][0]
    shouted = {**base, "nodes": [{**node, "gpu": node["gpu"].lower(), "intra_node": "NVLink"}, *base["nodes"][1:]]}
    assert cluster_from_dict(shouted) == cluster_from_dict(base)
    assert cluster_from_dict(shouted).nodes[0].gpu == node["gpu"]
    assert main(["validate", _write(tmp_path, "c.yaml", shouted)]) == 0
    one_line_error(capsys, main(["validate", _write(tmp_path, "c.yaml", _cluster(gpu="h1000"))]),
                   "unknown GPU type 'h1000'; known: H100")
