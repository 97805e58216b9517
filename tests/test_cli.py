import json

import pytest

from hetrl.cli import main


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "bench" in capsys.readouterr().out


def test_version_is_one_line_with_what_a_bug_report_needs(capsys):
    from importlib import metadata

    import hetrl

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith(f"hetrl {hetrl.__version__} (python ")
    assert f"torch {metadata.version('torch')}" in out and "transformers " in out and "vllm " in out
    assert metadata.version("hetrl") == hetrl.__version__     # the package's version is read from __version__


def test_unknown_subcommand_fails_cleanly(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2


@pytest.mark.parametrize("argv, want", [
    (["train", "steps=1", "--config", "R.yaml", "out_dir=o", "--resume", "lr=2"], ["steps=1", "out_dir=o", "lr=2"]),
    (["train", "--config", "R.yaml", "steps=1", "--debug", "seed=3", "-v"], ["steps=1", "seed=3"]),
    (["diagnose", "mismatch", "--prompts", "2", "rollout_engine=vllm", "--out", "d", "precision=fp32"],
     ["rollout_engine=vllm", "precision=fp32"]),
])
def test_key_value_overrides_may_come_before_and_after_options(monkeypatch, argv, want):
    """`hetrl train steps=1 --config R.yaml out_dir=o`: every key=value is an override, in the order written."""
    import hetrl.cli as cli

    seen = []
    monkeypatch.setattr(cli, "_train", lambda args: seen.append(args) or 0)
    monkeypatch.setattr(cli, "_diagnose", lambda args: seen.append(args) or 0)
    assert main(argv) == 0 and [a.overrides for a in seen] == [want]
    assert seen[0].debug == ("--debug" in argv) and seen[0].verbose == ("-v" in argv)


@pytest.mark.parametrize("argv", [["--debug", "train"], ["train", "--debug"], ["-v", "train"], ["train", "-v"]])
def test_debug_and_verbose_before_or_after_the_subcommand(monkeypatch, argv):
    import hetrl.cli as cli

    seen = []
    monkeypatch.setattr(cli, "_train", lambda args: seen.append(args) or 0)
    assert main(argv) == 0
    assert (seen[0].debug, seen[0].verbose) == ("--debug" in argv, "-v" in argv)


def test_a_broken_pipe_inside_hetrl_is_not_reported_as_an_input_error(monkeypatch):
    """OSError is an input error (a path, a permission); a broken pipe to one of hetrl's own processes is not: it
    keeps its traceback (it printed 'hetrl train: Broken pipe', exit 2)."""
    import hetrl.cli as cli

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "_train", broken)
    with pytest.raises(BrokenPipeError):
        main(["train", "steps=1"])


def test_a_warning_during_a_progress_bar_gets_its_own_line(capsys, monkeypatch):
    """A log warning printed while a bar is drawn (the first step's reward check) went to the end of the bar's
    line; with a terminal handler (the CLI's basicConfig) it is written through tqdm, which clears the bar first."""
    import logging
    import sys

    from tqdm import tqdm

    from hetrl.cli import warnings_beside_bars

    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.StreamHandler(sys.stderr)])
    with warnings_beside_bars():
        bar = tqdm(total=2, desc="train", file=sys.stderr)
        bar.update()
        logging.getLogger("hetrl.data.rewards").warning("warning: careful")
        bar.close()
    assert "\rwarning: careful\n" in capsys.readouterr().err


SCRIPT = """
import logging, sys, warnings
from tqdm import tqdm
from hetrl.cli import warnings_beside_bars
if sys.argv[1] == "cli":
    logging.basicConfig(format="%(message)s")   # as hetrl's command line; "api": no handler (hetrl.train from Python)
with warnings_beside_bars():
    bar = tqdm(total=2, desc="train")
    bar.update()
    warnings.warn("careful, python", UserWarning)
    bar.close()
    inside = warnings.showwarning
warnings.warn("after", UserWarning)
print(inside is not warnings.showwarning is warnings._showwarning_orig)
"""


@pytest.mark.parametrize("how", ["cli", "api"])
def test_a_python_warning_during_a_progress_bar_gets_its_own_line(how):
    """warnings.warn (transformers', torch's, a user's reward module's) printed while the bar was drawn went to the
    end of the bar's line: inside the context it goes through logging, so through tqdm; after it, as Python prints
    (a subprocess: pytest records warnings itself, and a caller's recording is left alone)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", SCRIPT, how], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"   # replaced inside, Python's own again after
    shown = [line.rsplit("\r", 1)[-1] for line in proc.stderr.split("\n")]   # what the terminal shows per line
    warning = next(line for line in shown if "careful, python" in line)
    assert warning.endswith(": UserWarning: careful, python") and "it/s" not in warning, proc.stderr
    assert any(line.endswith(": UserWarning: after") for line in shown)


def test_recorded_warnings_stay_recorded():
    import warnings

    from hetrl.cli import warnings_beside_bars

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with warnings_beside_bars():
            warnings.warn("kept", UserWarning)
    assert [str(w.message) for w in seen] == ["kept"]


def test_an_unknown_option_is_still_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "steps=1", "--stpes", "2"])
    assert exc.value.code == 2 and "unrecognized arguments: --stpes 2" in capsys.readouterr().err


def test_plan_import_refuses_the_options_it_would_not_read(tmp_path, capsys):
    """`hetrl plan --import verl DIR --cluster X` scored DIR's plan on DIR's own cluster and said nothing of X."""
    assert main(["plan", "--import", "verl", str(tmp_path), "--cluster", "c.yaml", "--png", "p.png"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--import verl {tmp_path} scores the folder's plan on the cluster and workload it was " \
        "exported for" in err[0] and "--cluster, --png would not be used: leave them out" in err[0]


@pytest.mark.slow
def test_bench_dualkv_quick_on_the_embedded_model(tmp_path, capsys):
    out = tmp_path / "demo.json"
    assert main(["bench", "demo", "--quick", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "max |log-prob difference|" in text and "speedup" in text
    result = json.loads(out.read_text())
    assert result["max_abs_logprob_diff"] < 1e-3
    assert result["rho"] > 1 and result["update_s"]["dualkv"] > 0
