"""hetrl.data.tools: TRL-convention tools and environments load, are refused in one line when malformed, are
described by transformers' schemas, parsed in the template's format, and run contained (errors, bad arguments,
timeouts, non-data results become tool messages)."""

from __future__ import annotations

import pathlib
import time

import pytest

from hetrl.cli import main
from hetrl.data.tools import (
    HERMES_TEMPLATE,
    ToolCall,
    ToolTokenizer,
    check_environment,
    environment_tools,
    load_environment,
    load_tools,
    parse_tool_calls,
    renders_tools,
    run_calls,
    tool_schema,
    tool_suffix_ids,
    tool_template,
)
from hetrl.models import tiny_tokenizer
from hetrl.schema import InputError

ROOT = pathlib.Path(__file__).parents[2]
CALC = str(ROOT / "examples" / "tools" / "calculator.py")
TINY = str(ROOT / "examples" / "runs" / "tiny.yaml")

BAD = '''
def good(x: int) -> int:
    """Doubles.

    Args:
        x: A number.
    """
    return 2 * x

def undocumented(x: int) -> int:
    return x

def unhinted(x):
    """No hint.

    Args:
        x: A number.
    """
    return x

not_callable = 3

class NoReset:
    def step(self, x: int) -> int:
        """Step.

        Args:
            x: A number.
        """
        return x
'''


@pytest.fixture
def bad_file(tmp_path):
    path = tmp_path / "tools.py"
    path.write_text(BAD)
    return str(path)


def test_the_trl_documentation_tools_and_environment_load():
    mul, add = load_tools(f"{CALC}:multiply,add")
    assert (mul(6, 7), add(1.5, 2)) == (42, 3.5)
    assert tool_schema(mul)["function"]["parameters"]["required"] == ["a", "b"]
    env_cls = load_environment(f"{CALC}:CalculatorEnv")
    schemas, has_reward = check_environment(env_cls)
    assert [s["function"]["name"] for s in schemas] == ["multiply"] and has_reward
    env = env_cls()
    assert env.reset(prompt="x") is None
    assert [m.__name__ for m in environment_tools(env)] == ["multiply"]   # not reset, get_reward or _private


@pytest.mark.parametrize("name, says", [("missing", "has no 'missing'"), ("not_callable", "not callable"),
                                        ("undocumented", "no docstring"), ("unhinted", "type hint")])
def test_bad_tool_specs_are_one_line(bad_file, name, says):
    with pytest.raises(InputError, match=says) as e:
        load_tools(f"{bad_file}:good,{name}")
    assert "\n" not in str(e.value)


def test_module_specs_import_from_the_current_directory_as_reward_specs_do(tmp_path, monkeypatch):
    import os
    import sys

    (tmp_path / "mytools").mkdir()
    (tmp_path / "mytools" / "__init__.py").write_text("")
    (tmp_path / "mytools" / "calc.py").write_text(BAD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd(), str(tmp_path))])
    (good,) = load_tools("mytools.calc:good")
    assert good(4) == 8
    with pytest.raises(InputError, match="defines no reset"):
        check_environment(load_environment("mytools.calc:NoReset"))
    assert str(tmp_path) not in sys.path           # the path is as it was


def test_a_tools_file_is_executed_once_per_version_and_a_failed_import_is_not_kept(tmp_path):
    import os

    f = tmp_path / "counted.py"
    f.write_text("import pathlib\nLOG = pathlib.Path(__file__).with_suffix('.runs')\n"
                 "LOG.write_text(LOG.read_text() + 'x' if LOG.exists() else 'x')\n" + BAD)
    load_tools(f"{f}:good")
    load_tools(f"{f}:good")
    assert (tmp_path / "counted.runs").read_text() == "x"
    f.write_text(f.read_text() + "raise SystemExit(3)\n")
    os.utime(f, ns=(1, 2))
    with pytest.raises(InputError, match=r"^tool .*: importing it failed at .*counted\.py:\d+: SystemExit\(3\)$"):
        load_tools(f"{f}:good")
    f.write_text(f.read_text().replace("raise SystemExit(3)\n", ""))
    os.utime(f, ns=(3, 4))
    load_tools(f"{f}:good")
    assert (tmp_path / "counted.runs").read_text() == "xxx"


def test_bad_specs_exit_2_in_one_line(bad_file, tmp_path, capsys):
    for spec, says in ((f"tools={bad_file}:undocumented", "no docstring"),
                       (f"tools={bad_file}:missing", "has no 'missing'"),
                       (f"tools={tmp_path}/none.py:f", "no such file"),
                       ("tools=nocolon", "expected FILE.py:NAME"),
                       (f"environment={bad_file}:NoReset", "defines no reset()")):
        assert main(["train", "--config", TINY, spec, f"out_dir={tmp_path / 'r'}"]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err


def test_calls_are_parsed_in_the_hermes_format():
    text = ('I will call.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
            '<tool_call>{"name": broken</tool_call><tool_call>[1, 2]</tool_call>')
    calls = parse_tool_calls(text)
    assert calls[:2] == [ToolCall("multiply", {"a": 6, "b": 7}), ToolCall("add", {"a": 1, "b": 2})]
    assert calls[2].error.startswith("the tool call is not valid JSON") and calls[3].error
    assert parse_tool_calls("no calls here") == []
    prose = ('I will write <tool_call> and then call it: '
             '<tool_call>{"name": "multiply", "arguments": {"a": 1, "b": 2}}</tool_call>')   # the tag named in prose
    assert parse_tool_calls(prose) == [ToolCall("multiply", {"a": 1, "b": 2})]


def test_a_template_with_response_parsing_is_asked_to_parse():
    class Declares:
        response_template = "x"

        def decode(self, ids):
            return "decoded"

        def parse_response(self, text, prefix=None, tools=None):
            assert prefix == "decoded" and tools == [{}]
            if text == "bad":
                raise ValueError("no")
            return {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                "name": "f", "arguments": {"a": 1}}}]}

    assert parse_tool_calls("anything", Declares(), [1, 2], [{}]) == [ToolCall("f", {"a": 1})]
    assert parse_tool_calls("bad", Declares(), [1, 2], [{}])[0].error.startswith("could not parse")


TOOLS_SRC = '''
import asyncio
import os
import time


def ok(a: int) -> int:
    """One more.

    Args:
        a: A number.
    """
    return a + 1


def boom(a: int) -> int:
    """Raises.

    Args:
        a: A number.
    """
    raise RuntimeError("kaput")


def slow(s: float) -> str:
    """Sleeps.

    Args:
        s: Seconds.
    """
    time.sleep(s)
    return "done"


def weird() -> object:
    """Not data."""
    return object()


def data() -> dict:
    """Data."""
    return {"x": [1, 2]}


async def later(a: int) -> int:
    """Ten times, awaited.

    Args:
        a: A number.
    """
    await asyncio.sleep(0)
    return a * 10


def dies(code: int) -> str:
    """Ends its process.

    Args:
        code: The exit code.
    """
    os._exit(code)


def spins(n: int) -> int:
    """Holds the GIL in one C call.

    Args:
        n: How far to count.
    """
    return sum(range(n))
'''


@pytest.fixture(params=["process", "thread"])
def tools(request, tmp_path):
    """The same tools run two ways: loaded from a file (function tools: each call in a tool process), and defined
    inside a function (not findable by a fresh interpreter: threads, as an environment's methods)."""
    if request.param == "process":
        (tmp_path / "mytools.py").write_text(TOOLS_SRC)
        names = "ok,boom,slow,weird,data,later,dies,spins"
        return {f.__name__: f for f in load_tools(f"{tmp_path / 'mytools.py'}:{names}")}
    scope: dict = {}
    exec(compile(TOOLS_SRC, "<tools>", "exec"), scope)   # noqa: S102 - functions without a findable module
    for name in ("ok", "boom", "slow", "weird", "data", "later"):
        scope[name].__module__ = "__main__"
    return {n: scope[n] for n in ("ok", "boom", "slow", "weird", "data", "later")}


def test_every_failure_becomes_a_tool_message(tools):
    calls = [ToolCall("ok", {"a": 1}), ToolCall("boom", {"a": 1}), ToolCall("ok", {"b": 1}),
             ToolCall("nope", {}), ToolCall("weird", {}), ToolCall("data", {}), ToolCall("later", {"a": 2}),
             ToolCall("ok", [1]), ToolCall("unknown", None, "the tool call is not valid JSON")]
    got = run_calls([(tools, c) for c in calls], timeout_s=5.0)
    assert [r.error for r in got] == [False, True, True, True, True, False, False, True, True]
    assert got[0].content == "2" and got[5].content == '{"x": [1, 2]}' and got[6].content == "20"
    assert "RuntimeError: kaput" in got[1].content and "bad arguments" in got[2].content
    assert "no tool named" in got[3].content and "returned object" in got[4].content
    assert got[1].content.startswith("{'error': ")   # TRL's form


def test_a_tool_that_ends_its_process_or_holds_the_gil_does_not_take_the_trainer(tmp_path):
    """os._exit in a tool ends its tool process only, answered with an error naming the tool; a C call holding the
    GIL (no thread could time it out) is killed at the timeout; the next calls run in fresh processes."""
    (tmp_path / "mytools.py").write_text(TOOLS_SRC)
    tools = {f.__name__: f for f in load_tools(f"{tmp_path / 'mytools.py'}:ok,dies,spins")}
    t0 = time.perf_counter()
    died, spun, fine = run_calls([(tools, ToolCall("dies", {"code": 7})), (tools, ToolCall("spins", {"n": 10**14})),
                                  (tools, ToolCall("ok", {"a": 1}))], timeout_s=2.0)
    assert time.perf_counter() - t0 < 10
    assert died.error and "dies ended its process (exit code 7" in died.content
    assert spun.error and "spins timed out after 2 s" in spun.content
    assert fine.content == "2"
    again = run_calls([(tools, ToolCall("ok", {"a": 2})), (tools, ToolCall("ok", {"a": 3}))], timeout_s=5.0)
    assert [r.content for r in again] == ["3", "4"]


def test_a_failing_tool_is_told_to_the_user_once_with_where_it_raised(tmp_path, caplog, monkeypatch):
    """A tool that raises (or returns what is not data) is the model's error message and the user's bug: logged
    once per tool and kind of failure, naming the tool, the exception and the user's FILE:LINE (a tool failing on
    every call was seen only as tool_error_frac 1.0)."""
    from hetrl.data import tools as tools_module

    monkeypatch.setattr(tools_module, "_TOLD", set())   # what the tests before told
    (tmp_path / "mytools.py").write_text(TOOLS_SRC)
    tools = {f.__name__: f for f in load_tools(f"{tmp_path / 'mytools.py'}:boom,weird")}
    with caplog.at_level("WARNING", logger="hetrl.data.tools"):
        for _ in range(2):
            got = run_calls([(tools, ToolCall("boom", {"a": 1})), (tools, ToolCall("weird", {}))], timeout_s=5.0)
            assert [r.error for r in got] == [True, True]
    told = [r.getMessage() for r in caplog.records]
    line = TOOLS_SRC[:TOOLS_SRC.index('raise RuntimeError("kaput")')].count("\n") + 1
    assert len(told) == 2, told
    assert told[0].startswith(f"tool boom raised RuntimeError: kaput at {tmp_path / 'mytools.py'}:{line}; "), told[0]
    assert told[1].startswith("tool weird returned object, not text"), told[1]
    assert got[0].content == "{'error': 'RuntimeError: kaput'}"   # the model's message names no file


def test_a_ctrl_c_at_the_terminal_does_not_reach_the_tool_processes(tmp_path):
    """Tool processes run in their own session (a Ctrl-C to the terminal's process group killed the idle ones, and
    the next call's send raised BrokenPipeError, ending the run before its checkpoint); an idle one that ends
    anyway is replaced by a fresh one."""
    import os
    import signal

    from hetrl.data import tools as tools_module

    (tmp_path / "mytools.py").write_text(TOOLS_SRC)
    tools = {f.__name__: f for f in load_tools(f"{tmp_path / 'mytools.py'}:ok")}
    assert run_calls([(tools, ToolCall("ok", {"a": 1}))], timeout_s=5.0)[0].content == "2"
    idle = list(tools_module._PROCESSES.idle)
    assert idle and all(os.getsid(proc.pid) != os.getsid(0) for proc, _ in idle)
    for proc, _ in idle:
        os.kill(proc.pid, signal.SIGINT)   # what a Ctrl-C in the tool's own session would do
        proc.wait(5)
    assert run_calls([(tools, ToolCall("ok", {"a": 2}))], timeout_s=5.0)[0].content == "3"


def test_a_tool_process_started_while_sigint_is_ignored_still_ends_on_sigint(tmp_path):
    """The trainer ignores SIGINT for a moment while it starts its reward workers (containment.WorkerPool); a tool
    process started in that moment by another thread inherited the ignored (or blocked) SIGINT and kept it for its
    whole life. (A clean clone's default suite once timed out in the test above on a tool process that did not end
    on SIGINT; an inherited SIGINT state is how a fresh interpreter comes to that.) Each tool process now starts
    with SIGINT as a fresh interpreter has it."""
    import os
    import signal

    from hetrl.data.tools import ToolProcesses, locator

    pool = ToolProcesses()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        proc, conn = pool.take()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signal.signal(signal.SIGINT, previous)
    try:
        (tmp_path / "mytools.py").write_text(TOOLS_SRC)
        tools = {f.__name__: f for f in load_tools(f"{tmp_path / 'mytools.py'}:ok")}
        conn.send((locator(tools["ok"]), {"a": 1}))
        assert conn.recv()[0] == "loaded" and conn.recv()[:2] == ("ok", "2")   # up and serving
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(5) != 0
    finally:
        pool.end((proc, conn))


def test_tools_of_different_episodes_run_at_once_and_time_out(tools):
    t0 = time.perf_counter()
    got = run_calls([(tools, ToolCall("slow", {"s": 0.6})), (tools, ToolCall("slow", {"s": 0.6})),
                     (tools, ToolCall("slow", {"s": 30.0}))], timeout_s=1.5)
    took = time.perf_counter() - t0
    assert [r.content for r in got[:2]] == ["done", "done"] and "timed out after 1.5 s" in got[2].content
    assert took < 3.0, took   # concurrent: 0.6 + 0.6 + 30 s in sequence


def test_a_model_without_tool_support_gets_the_chatml_tool_template():
    tok = tiny_tokenizer()
    assert not renders_tools(tok) and tool_template(tok) == HERMES_TEMPLATE
    mul, = load_tools(f"{CALC}:multiply")
    rendered = ToolTokenizer(tok, [tool_schema(mul)], HERMES_TEMPLATE).apply_chat_template(
        [{"role": "user", "content": "6*7?"}], add_generation_prompt=True, tokenize=False)
    assert '"name": "multiply"' in rendered and rendered.endswith("<|im_start|>assistant\n")
    suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "multiply", "content": "42"}], HERMES_TEMPLATE)
    assert tok.decode(suffix) == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n" \
                                 "<|im_start|>assistant\n"


class _Scorer:
    def reset(self, **kwargs) -> None:
        return None

    def get_reward(self) -> float:
        return 1 / 0   # the line the error names


def test_an_environments_failing_get_reward_is_named_as_the_method_with_where_it_raised():
    """It was said as `reward _Scorer: raised ZeroDivisionError ...`, the class and not the method that raised."""
    import inspect

    from hetrl.data.rewards import RewardSet
    from hetrl.data.tools import environment_reward

    line = inspect.getsourcelines(_Scorer.get_reward)[1] + 1
    rewards = RewardSet([environment_reward(_Scorer)], [1.0])
    with pytest.raises(InputError) as e:
        rewards.score([{"environments": _Scorer()} for _ in range(2)], ["p", "p"], ["a", "b"])
    assert "reward _Scorer: environment _Scorer.get_reward() raised ZeroDivisionError: division by zero " \
        f"({__file__}:{line})" in str(e.value)
