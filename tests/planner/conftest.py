import pytest

from hetrl.planner import optables


@pytest.fixture
def roofline_only(monkeypatch):
    """Price without the operator tables (HETRL_OPERATOR_TABLES=off): the roofline constants' physics, which
    tests of a formula check by hand."""
    monkeypatch.setenv("HETRL_OPERATOR_TABLES", "off")
    optables.reload()
    yield
    monkeypatch.delenv("HETRL_OPERATOR_TABLES")
    optables.reload()
