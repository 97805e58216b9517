"""benchmarks.train_variants' --set: settings added to every variant reach its run, the page says them, and a finished
run made with other settings is refused rather than read into the comparison."""

import json
import subprocess
import sys

import pytest

from benchmarks import train_variants as tv


def _finished(out, extra):
    out.mkdir(parents=True)
    row = {"step": 1, "step_s": 1.0, "update_s": 0.5, "logprob_s": 0.1, "gen_s": 0.4, "groups_sampled": 8,
           "sample_tokens": 100}
    (out / "metrics.jsonl").write_text("\n".join(json.dumps(row | {"step": i}) for i in (1, 2)) + "\n")
    (out / "summary.json").write_text(json.dumps({
        "paired_on": "accuracy", "eval_accuracy_before": 0.1, "eval_accuracy_after": 0.4, "gained": 3, "lost": 0,
        "sign_test_p": 0.25, "eval_problems": 4, "steps": 2, "checkpoint": str(out), "precision": "fp32"}))
    (out / "variant_marks.json").write_text(json.dumps({"wall_s": 9.0, "marks": None, "extra": extra}))


def test_a_finished_run_is_read_only_with_the_same_settings(tmp_path):
    _finished(tmp_path / "gspo-s0", ["precision=fp32"])
    row = tv.run_variant("gspo", 2, tmp_path, 0, seed=0, extra=("precision=fp32",))
    assert row["eval_after"] == 0.4 and row["precision"] == "fp32"
    with pytest.raises(SystemExit, match=r"made with --set precision=fp32, not \(nothing\)"):
        tv.run_variant("gspo", 2, tmp_path, 0, seed=0)
    _finished(tmp_path / "grpo-s0", [])          # one from before --set (no "extra" recorded) reads as none
    marks = json.loads((tmp_path / "grpo-s0" / "variant_marks.json").read_text())
    del marks["extra"]
    (tmp_path / "grpo-s0" / "variant_marks.json").write_text(json.dumps(marks))
    assert tv.run_variant("grpo", 2, tmp_path, 0, seed=0)["eval_after"] == 0.4
    with pytest.raises(SystemExit, match="give another --work"):
        tv.run_variant("grpo", 2, tmp_path, 0, seed=0, extra=("precision=fp32",))


def test_the_page_states_the_settings_and_a_bad_one_is_refused(tmp_path):
    _finished(tmp_path / "grpo-s0", ["precision=fp32"])
    _finished(tmp_path / "gspo-s0", ["precision=fp32"])
    rows = [tv.run_variant(v, 2, tmp_path, 0, seed=0, extra=("precision=fp32",)) for v in ("grpo", "gspo")]
    text = tv.markdown({"machine": "m", "steps": 2, "rounds": 1, "seeds": [0], "conditions": "c", "work": "w",
                        "parallel": True, "eval_size": None, "variants": ["grpo", "gspo"], "name": "n",
                        "extra": ["precision=fp32"], "rows": rows})
    assert "--seeds 0 --parallel --set precision=fp32 --work w" in text
    assert "- every variant also: precision=fp32" in text and "Precision (set by --set): fp32." in text
    done = subprocess.run([sys.executable, "-m", "benchmarks.train_variants", "--set", "precision"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "--set takes KEY=VALUE, got precision" in done.stderr
