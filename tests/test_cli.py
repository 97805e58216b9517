import json

import pytest

from hetrl.cli import main


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "bench" in capsys.readouterr().out


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
