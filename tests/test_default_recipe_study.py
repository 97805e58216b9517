"""benchmarks.studies.default_recipe: the sweep keeps prior rows, --max-runs stops after that many new runs, and no
recipe is chosen until every (recipe, precision) side has its seeds; a run cut short continues from its checkpoint.
Runs are faked (no training)."""

import json
import pathlib

from benchmarks.studies import default_recipe as study


def _fake(monkeypatch, accuracy):
    started = []

    def run_one(work, recipe, precision, seed):
        started.append((recipe, precision, seed))
        return (recipe, precision, seed)

    def read_run(key, precision):
        recipe, _, seed = key
        return {"run_dir": "x", "precision": precision, "seed": seed, "steps": 16, "eval_accuracy_before": 0.13,
                "eval_accuracy_after": accuracy[(recipe, precision)], "gained": 1, "lost": 0, "sign_test_p": 0.5,
                "median_s": {"step_s": 1.0}, "per_step_s": []}
    monkeypatch.setattr(study, "run_one", run_one)
    monkeypatch.setattr(study, "read_run", read_run)
    monkeypatch.setattr(study, "revision", lambda: "abc1234")
    monkeypatch.setattr(study, "machine", lambda: {"model": "cpu", "flags": ["avx2"], "cpus": 2, "torch": "2.13"})
    return started


def test_max_runs_then_resume_then_choose(tmp_path, monkeypatch):
    acc = {("grpo-kl0.001", "fp32"): 0.43, ("grpo-kl0.001", "bf16-mixed"): 0.40,
           ("grpo-nokl", "fp32"): 0.48, ("grpo-nokl", "bf16-mixed"): 0.35}
    started = _fake(monkeypatch, acc)
    out = tmp_path / "default_recipe"
    args = ["--out", str(out), "--work", str(tmp_path / "runs")]
    study.main([*args, "--precisions", "bf16-mixed", "--max-runs", "1"])
    res = json.loads(out.with_suffix(".json").read_text())
    assert started == [("grpo-kl0.001", "bf16-mixed", 0)] and len(res["runs"]) == 1
    page = out.with_suffix(".md").read_text()
    assert res["chosen"] is None and "Not chosen yet" in page
    assert "| grpo-kl0.001 | bf16-mixed | 1 of 3 seeds so far: 0.40 | |" in page
    assert "| grpo-nokl | fp32 | not run yet | |" in page
    study.main(args)   # the rest: the first run's row is kept, not rerun
    assert len(started) == 12 and started.count(("grpo-kl0.001", "bf16-mixed", 0)) == 1
    res = json.loads(out.with_suffix(".json").read_text())
    assert len(res["runs"]) == 12
    # the highest mean on its worse precision: kl 0.40 beats nokl 0.35
    assert res["chosen"] == "grpo-kl0.001" and res["worse_precision_mean"]["grpo-nokl"] == 0.35


def test_a_run_cut_short_continues_from_its_checkpoint(tmp_path, monkeypatch):
    """A finished run is read; one with a checkpoint and no summary resumes (its files kept); anything else starts
    afresh in an emptied folder."""
    calls = []

    def run(cmd, **kw):
        calls.append(cmd[3:])
        out = pathlib.Path(cmd[-1].removeprefix("out_dir="))
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text("{}")
    monkeypatch.setattr(study.subprocess, "run", run)
    work = tmp_path / "runs"
    fresh = work / "grpo-nokl-fp32-s0"
    fresh.mkdir(parents=True)
    (fresh / "metrics.jsonl").write_text("half a run without a checkpoint")
    assert study.run_one(work, "grpo-nokl", "fp32", 0) == fresh
    assert calls[-1] == ["train", "kl_coef=0", "precision=fp32", "seed=0", f"out_dir={fresh}"]
    assert not (fresh / "metrics.jsonl").exists()
    cut = work / "grpo-nokl-bf16-mixed-s1"
    (cut / "checkpoints" / "step_000008").mkdir(parents=True)
    (cut / "metrics.jsonl").write_text("eight steps")
    study.run_one(work, "grpo-nokl", "bf16-mixed", 1)
    assert calls[-1] == ["train", "--resume", f"out_dir={cut}"] and (cut / "metrics.jsonl").exists()
    study.run_one(work, "grpo-nokl", "bf16-mixed", 1)   # finished now: read, not run again
    assert len(calls) == 2


def test_a_call_limited_to_one_recipe_still_judges_every_recipe(tmp_path, monkeypatch):
    """--recipes limits what runs: the page and the choice still weigh the other recipe's rows, so a call that ran
    only the KL recipe cannot choose it over a better recipe already in the results (or over one not run yet)."""
    acc = {("grpo-kl0.001", "fp32"): 0.43, ("grpo-kl0.001", "bf16-mixed"): 0.41,
           ("grpo-nokl", "fp32"): 0.48, ("grpo-nokl", "bf16-mixed"): 0.48}
    _fake(monkeypatch, acc)
    out = tmp_path / "default_recipe"
    args = ["--out", str(out), "--work", str(tmp_path / "runs")]
    study.main([*args, "--recipes", "grpo-kl0.001"])
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["chosen"] is None and "| grpo-nokl | fp32 | not run yet | |" in out.with_suffix(".md").read_text()
    study.main([*args, "--recipes", "grpo-nokl", "--precisions", "fp32"])
    assert json.loads(out.with_suffix(".json").read_text())["chosen"] is None
    study.main([*args, "--recipes", "grpo-kl0.001"])   # nothing left to run for it: the page is rewritten
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["chosen"] is None and "grpo-nokl" in res["sides"]
    study.main([*args, "--recipes", "grpo-nokl"])
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["chosen"] == "grpo-nokl" and res["worse_precision_mean"] == {"grpo-kl0.001": 0.41, "grpo-nokl": 0.48}
