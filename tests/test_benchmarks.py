"""benchmarks/ stays a set of experiments on one harness: every script imports as a module from the repository root
(no sys.path patches), its docstring names the results page it made (which exists) and the `python -m` command that
reruns it, and benchmarks/README.md lists the script."""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").rglob("*.py") if p.name != "__init__.py")


def _module(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


@pytest.mark.parametrize("path", SCRIPTS, ids=_module)
def test_script_is_a_module_with_a_why_and_its_result(path):
    source = path.read_text()
    assert "sys.path" not in source, f"{path.name} patches sys.path; import from the repository root instead"
    doc = importlib.import_module(_module(path)).__doc__ or ""
    assert f"python -m {_module(path)}" in doc, f"{path.name}'s docstring does not say `python -m {_module(path)}`"
    pages = re.findall(r"benchmarks/results/[\w/.-]+\.md|[\w.-]+\.md", doc)
    assert pages, f"{path.name}'s docstring links no results page"
    assert any((ROOT / p).exists() or (ROOT / "benchmarks" / "results" / p).exists() for p in pages), \
        f"{path.name}'s docstring names results pages that do not exist: {pages}"
    assert (f"benchmarks.{_module(path).removeprefix('benchmarks.')}"
            in (ROOT / "benchmarks" / "README.md").read_text()), \
        f"benchmarks/README.md does not list {_module(path)}"
