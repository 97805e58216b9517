"""The documentation stays a map that matches the territory: every relative link resolves, the README stays a
front door (<= 220 lines), benchmarks/README.md names every results page, and docs/train.md lists every knob of
RunConfig with its default. Anchors are not checked (GitHub derives them; a renamed heading only loses the jump)."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

from hetrl.trainer.config import _PRESETS, RunConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _links(page: pathlib.Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    missing = [t for t in _links(page) if not (page.parent / t.split("#")[0]).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 220, (f"README.md has {lines} lines; reference belongs in docs/, "
                          "measurements in benchmarks/README.md")


def test_benchmarks_readme_names_every_results_page():
    index = ROOT / "benchmarks" / "README.md"
    linked = {(index.parent / t.split("#")[0]).resolve() for t in _links(index)}
    results = ROOT / "benchmarks" / "results"
    pages = [p for p in results.rglob("*.md")]
    unnamed = [str(p.relative_to(results)) for p in pages if p.resolve() not in linked]
    assert pages and not unnamed, f"results pages missing from benchmarks/README.md's index: {unnamed}"


def _default_text(f: dataclasses.Field) -> str | None:
    """A field's default as docs/train.md writes it (None: a default too long for a cell, described in words)."""
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        value = f.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    if isinstance(value, dict):
        return None
    return str(value) if value != "" else '""'


def test_train_doc_lists_every_knob_with_its_default():
    rows: dict[str, str] = {}
    for name, cell in re.findall(r"^\| `(\w+)` \| ([^|]+) \|", (ROOT / "docs" / "train.md").read_text(), re.M):
        rows.setdefault(name, cell)   # the knob tables come first; later tables compare algorithms
    preset = {k for p in _PRESETS.values() for k in p}
    missing, wrong = [], []
    for f in dataclasses.fields(RunConfig):
        if f.name not in rows:
            missing.append(f.name)
            continue
        want = "`-`" if f.name in preset and f.default is None else _default_text(f)
        if want is not None and rows[f.name].strip() != (want if want == "`-`" else f"`{want}`"):
            wrong.append(f"{f.name}: docs say {rows[f.name].strip()}, RunConfig says {want}")
    assert not missing and not wrong, f"docs/train.md's knob table: missing {missing}; wrong defaults {wrong}"
