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


@pytest.mark.slow
def test_bench_dualkv_quick_on_the_embedded_model(tmp_path, capsys):
    out = tmp_path / "demo.json"
    assert main(["bench", "demo", "--quick", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "max |log-prob difference|" in text and "speedup" in text
    result = json.loads(out.read_text())
    assert result["max_abs_logprob_diff"] < 1e-3
    assert result["rho"] > 1 and result["update_s"]["dualkv"] > 0
