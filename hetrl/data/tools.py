"""Tools and environments in TRL 1.16's conventions: load them, describe them to the chat template, parse the
model's calls, and run them contained.

- A tool is a plain function (sync or async) with a type hint on every argument and a Google-style docstring;
  transformers' `get_json_schema` turns it into the schema the chat template renders (`apply_chat_template(...,
  tools=[...])`). Named on the command line as `FILE.py:f1,f2` or `package.module:f1,f2`.
- An environment is a class (TRL's `environment_factory`): one instance per rollout, `reset(**row)` returning None
  or a string appended to the last user message, its public methods its tools, an optional `get_reward()` counted
  as one more reward. Named as `FILE.py:Class`.
- Calls are parsed in the template's own format: `tokenizer.parse_response` where the tokenizer declares a
  response template or schema (transformers' response parsing), else Hermes/Qwen's `<tool_call>{json}</tool_call>`.
- A call that names no tool, has bad arguments, raises, times out (`timeout_s`) or returns something that is not
  text, a number or JSON becomes a tool message saying so (TRL's `{'error': ...}`), never a crash.

A model whose chat template renders no tools (SmolLM2, hetrl's tiny model) gets Qwen2.5's ChatML tool template
(`HERMES_TEMPLATE`, without Qwen's default identity line); the run says so when it starts. No torch here.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

from hetrl._tool_worker import invoke, raised_at, render
from hetrl.schema import InputError

from .containment import name_of, user_call
from .specs import load_module, lookup

log = logging.getLogger(__name__)

# Qwen2.5's template (trl/chat_templates/qwen2_5.jinja) less its "You are Qwen" default system line: ChatML, the
# tools listed in the system message, calls as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, results as
# a user turn of <tool_response> blocks. Prefix-preserving: rendering a longer conversation extends the shorter.
HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- elif messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
    "'<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# a block runs from its own <tool_call> (the last before its </tool_call>): a tag named in prose before a call
# is not part of the call
_TOOL_CALL = re.compile(r"<tool_call>\s*((?:(?!<tool_call>).)*?)\s*</tool_call>", re.S)
_PROBE_TOOL = {"type": "function", "function": {"name": "hetrl_probe_tool", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


# ------------------------------------------------------------------------------------------ loading and checking


def _names(spec: str, kind: str, many: bool) -> list[str]:
    if not isinstance(spec, str) or spec.count(":") < 1 or not all(spec.rsplit(":", 1)):
        form = "FILE.py:NAME[,NAME...] or package.module:NAME" if many else "FILE.py:Class or package.module:Class"
        raise InputError(f"{kind} {spec!r}: expected {form}")
    names = [n.strip() for n in spec.rsplit(":", 1)[1].split(",")]
    if not all(names) or (not many and len(names) > 1):
        raise InputError(f"{kind} {spec!r}: expected {'comma-separated names' if many else 'one class name'} "
                         "after the colon")
    return names


def load_tools(spec: str) -> list[Callable]:
    """`FILE.py:f1,f2` or `package.module:f1` -> the functions, each checked by `tool_schema`."""
    names = _names(spec, "tool", many=True)
    module = load_module(spec, "tool")
    out = [lookup(module, spec, n, "tool") for n in names]
    for fn in out:
        tool_schema(fn, spec)
    return out


def load_environment(spec: str) -> Callable:
    """`FILE.py:Class` -> the environment factory (a class, or any callable returning an instance)."""
    (name,) = _names(spec, "environment", many=False)
    return lookup(load_module(spec, "environment"), spec, name, "environment")


def tool_schema(fn: Callable, where: str | None = None) -> dict:
    """The JSON schema transformers' chat templates render for `fn`; a function without a docstring or a type hint
    on an argument is refused in one line, as transformers would refuse it deeper down."""
    from transformers.utils import get_json_schema

    name = name_of(fn)
    at = f"tool {name}" + (f" ({where})" if where else "")
    if not callable(fn):
        raise InputError(f"{at}: its value is of type {type(fn).__name__}, not callable; a tool is a function")
    if not inspect.getdoc(fn):
        raise InputError(f"{at}: has no docstring; a tool needs a Google-style docstring (a description, then "
                         "Args: with one line per argument) for its schema")
    try:
        return get_json_schema(fn)
    except Exception as e:   # transformers' TypeHintParsingException / DocstringParsingException
        raise InputError(f"{at}: {e}; a tool needs a type hint on every argument and a Google-style docstring "
                         "describing each under Args:") from None


def environment_tools(instance) -> list[Callable]:
    """TRL's rule: the instance's public methods, less `reset` and `get_reward`, listed on the class (so that
    properties are not evaluated)."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


def check_environment(factory: Callable) -> tuple[list[dict], bool]:
    """Make one instance of `factory` and check it as TRL does: a callable `reset`, tool methods with schemas.
    -> (its tools' schemas, whether it defines get_reward)."""
    instance = user_call(factory, f"environment {name_of(factory)}()")
    name = type(instance).__name__
    if not callable(getattr(instance, "reset", None)):
        raise InputError(f"environment {name}: defines no reset(); TRL's contract is reset(**row) returning None or "
                         "a string appended to the last user message")
    return [tool_schema(m, f"environment {name}") for m in environment_tools(instance)], \
        callable(getattr(instance, "get_reward", None))


def environment_reward(factory: Callable) -> Callable:
    """The environment's `get_reward()` as a reward function in TRL's convention (weight 1, named after the class):
    it reads each completion's own instance from the `environments` column the rollout adds. What get_reward
    raises is said as Class.get_reward() with the file and line that raised (the reward is named after the class)."""
    cls_name = name_of(factory)

    def get_reward(env):
        value = env.get_reward()
        return asyncio.run(value) if inspect.isawaitable(value) else value

    def reward(completions, environments, **kwargs):
        return [user_call(lambda: get_reward(env), f"environment {type(env).__name__}.get_reward()")
                for env in environments]

    reward.__name__ = cls_name
    return reward


# ------------------------------------------------------------------------------------------ the chat template


def renders_tools(tokenizer, template: str | None = None) -> bool:
    """Whether `template` (None: the tokenizer's own) renders a tool list, a call and a tool message."""
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "hetrl_probe_tool", "arguments": {}}}]},
                {"role": "tool", "name": "hetrl_probe_tool", "content": "hetrl_probe_result"}]
    try:
        text = tokenizer.apply_chat_template(messages, tools=[_PROBE_TOOL], tokenize=False, chat_template=template)
    except Exception:   # a template that cannot render the conversation does not support tools
        return False
    return text.count("hetrl_probe_tool") >= 2 and "hetrl_probe_result" in text


def tool_template(tokenizer) -> str | None:
    """None where the model's own template renders tools, else HERMES_TEMPLATE (refused if even that fails, e.g.
    a tokenizer without ChatML's special tokens)."""
    if renders_tools(tokenizer):
        return None
    vocab = tokenizer.get_vocab()
    if not all(t in vocab for t in ("<|im_start|>", "<|im_end|>")) or not renders_tools(tokenizer, HERMES_TEMPLATE):
        raise InputError(f"tools: the chat template of this model ({type(tokenizer).__name__}) renders no tools, "
                         "and the model has no ChatML tokens (<|im_start|>, <|im_end|>) for hetrl's Qwen2.5-style "
                         "tool template; use a model whose chat template supports tools")
    return HERMES_TEMPLATE


def _ids(out) -> list[int]:
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


class ToolTokenizer:
    """The run's tokenizer with `apply_chat_template` rendering the tools (and the tool template where the model's
    own renders none): what the data source renders prompts with. Everything else is the tokenizer's."""

    def __init__(self, tokenizer, schemas: list[dict], template: str | None):
        self._tokenizer, self._schemas, self._template = tokenizer, schemas, template

    def apply_chat_template(self, messages, **kwargs):
        kwargs.setdefault("tools", self._schemas)
        if self._template is not None:
            kwargs.setdefault("chat_template", self._template)
        return self._tokenizer.apply_chat_template(messages, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)

    def __len__(self):
        return len(self._tokenizer)


def tool_suffix_ids(tokenizer, tool_messages: list[dict], template: str | None) -> list[int]:
    """The tokens that follow an assistant turn's end-of-turn token to put `tool_messages` in the conversation and
    open the next assistant turn: TRL's `_get_tool_suffix_ids` (render a dummy conversation with and without the
    tool messages, cut after the last EOS of the shorter)."""
    call = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": call}]
    prefix = _ids(tokenizer.apply_chat_template(dummy, add_generation_prompt=False, tokenize=True,
                                                chat_template=template))
    full = _ids(tokenizer.apply_chat_template(dummy + tool_messages, add_generation_prompt=True, tokenize=True,
                                              chat_template=template))
    eos = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if eos:
        prefix = prefix[: eos[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise InputError("tools: the chat template is not prefix-preserving (adding a tool message re-renders the "
                         "turns before it), so tool results cannot be appended to a conversation's tokens; use a "
                         "template that only appends")
    return full[len(prefix):]


# ------------------------------------------------------------------------------------------ calls


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Any            # a dict when well formed
    error: str | None = None  # why the call could not be read (then it is answered with that error)


def parse_tool_calls(text: str, tokenizer=None, prefix: list[int] | None = None,
                     tools: list[dict] | None = None) -> list[ToolCall]:
    """The calls in one assistant turn's text: through `tokenizer.parse_response` where the tokenizer declares a
    response template or schema (transformers' parsing of its own format; `prefix`, the conversation's tokens
    before the turn, and `tools`, the schemas, passed on as TRL does), else every
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block. A block that is not such JSON is a call
    with an error (answered, counted), never an exception."""
    if tokenizer is not None and (getattr(tokenizer, "response_template", None) is not None
                                  or getattr(tokenizer, "response_schema", None) is not None):
        try:
            extra = {k: v for k, v in (("prefix", None if prefix is None else tokenizer.decode(prefix)),
                                       ("tools", tools)) if v is not None}
            parsed = tokenizer.parse_response(text, **extra)
        except Exception as e:   # malformed output: one erroneous call, as TRL turns it into a tool failure
            return [ToolCall("unknown", None, f"could not parse the reply's tool calls: {e}")]
        return [ToolCall(c.get("function", c).get("name", "unknown"), c.get("function", c).get("arguments"))
                for c in (parsed or {}).get("tool_calls") or []]
    out = []
    for block in _TOOL_CALL.findall(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError as e:
            out.append(ToolCall("unknown", None, f"the tool call is not valid JSON ({e.msg} at character {e.pos})"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            out.append(ToolCall("unknown", None, 'a tool call is {"name": ..., "arguments": {...}}'))
            continue
        args = call.get("arguments", {})
        if isinstance(args, str):   # some models put the arguments' JSON in a string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        out.append(ToolCall(call["name"], args))
    return out


@dataclass(frozen=True)
class ToolResult:
    name: str
    content: str
    error: bool
    seconds: float


TOOL_RESULT_MAX_CHARS = 32_768   # a tool's answer beyond this is cut (about 2k-30k tokens: more than a context)


def capped(name: str, text: str) -> str:
    """`text` cut at TOOL_RESULT_MAX_CHARS, the cut said in the text the model reads and in the log, so a huge
    result is neither tokenized in full nor dropped in silence."""
    if len(text) <= TOOL_RESULT_MAX_CHARS:
        return text
    log.warning("tool %s returned %d characters; cut to %d (TOOL_RESULT_MAX_CHARS)", name, len(text),
                TOOL_RESULT_MAX_CHARS)
    return text[:TOOL_RESULT_MAX_CHARS] + f"... [cut: {len(text) - TOOL_RESULT_MAX_CHARS} more characters]"


def locator(fn) -> tuple[str, str | None, str] | None:
    """Where a tool process finds `fn`: (module name, the module's file when it was executed from one, qualified
    name); None for what a fresh interpreter cannot find (a lambda, a function defined inside another, a bound
    method: an environment's tools live with their instance in this process)."""
    module_name, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module_name or not qualname or "<" in qualname or inspect.ismethod(fn) or not inspect.isfunction(fn):
        return None
    module = sys.modules.get(module_name)
    if module is None or module_name == "__main__":
        return None
    path = getattr(module, "__file__", None) if module_name.startswith("hetrl_") else None   # specs._execute's
    return module_name, path, qualname


class ToolProcesses:
    """Idle tool processes (hetrl._tool_worker), started on demand (a fresh interpreter: nothing of the trainer's
    threads or CUDA state) and kept for the next calls; one that timed out or died is replaced."""

    KEEP = 16

    def __init__(self):
        self.idle: list = []

    def take(self):
        while self.idle:
            worker = self.idle.pop()
            if worker[0].poll() is None:
                return worker
            self.end(worker)    # ended while idle (killed from outside): a fresh one instead
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}   # what this process imports
        # a session of its own: a Ctrl-C at the terminal is the trainer's to handle (finish the step, checkpoint),
        # not a signal that kills the idle tool processes under it
        proc = subprocess.Popen([sys.executable, "-m", "hetrl._tool_worker", str(theirs.fileno())],
                                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        theirs.close()
        return proc, Connection(ours.detach())

    def send(self, call):
        """A worker that has been sent `call`: an idle one, or a fresh one where the idle one's pipe is broken."""
        worker = self.take()
        try:
            worker[1].send(call)
        except OSError:   # it ended between the check and the send
            self.end(worker)
            worker = self.take()
            worker[1].send(call)
        return worker

    def give_back(self, worker) -> None:
        if len(self.idle) < self.KEEP:
            self.idle.append(worker)
        else:
            self.end(worker)

    @staticmethod
    def end(worker) -> int | None:
        proc, conn = worker
        if proc.poll() is None:
            proc.kill()
        try:
            code = proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        conn.close()
        return code

    def close(self) -> None:
        while self.idle:
            self.end(self.idle.pop())


TOOL_LOAD_S = 120.0   # a tool process may take this long to import a tool's module (its first call only)
_PROCESSES = ToolProcesses()
_UNLOCATABLE: set = set()   # tools a tool process could not load: they run in threads
atexit.register(_PROCESSES.close)


def _error(name: str, why: str, seconds: float) -> ToolResult:
    return ToolResult(name, str({"error": why}), True, seconds)


def run_calls(calls: list[tuple[dict[str, Callable], ToolCall]], timeout_s: float,
              isolation: str = "process") -> list[ToolResult]:
    """Run every (tools of its episode, call) at once, so that the tools of different episodes overlap.

    isolation "process": a function tool runs in a tool process of its own (ToolProcesses); past `timeout_s` the
    process is killed (a C call holding the GIL included) and the call answered with a timeout error; a tool that
    ends its process (os._exit, a crash) is answered with an error naming it, and the run goes on. An
    environment's methods (their state lives with their instance here), lambdas and nested functions run in a
    daemon thread, as with isolation "thread" for every tool: a call past `timeout_s` is answered with a timeout
    error and its thread left to finish (Python cannot stop a thread). Results are capped (`capped`)."""
    results: list[ToolResult | None] = [None] * len(calls)
    slots: list[dict] = [{} for _ in calls]
    threads, procs = [], []
    for i, (tools, call) in enumerate(calls):
        fn = tools.get(call.name)
        if call.error is not None or fn is None:
            why = call.error or f"no tool named {call.name!r} (tools: {', '.join(sorted(tools)) or 'none'})"
            results[i] = _error(call.name, why, 0.0)
            continue
        if not isinstance(call.arguments, dict):
            results[i] = _error(call.name, f"arguments must be a JSON object, got {type(call.arguments).__name__}",
                                0.0)
            continue
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as e:
            results[i] = _error(call.name, f"bad arguments for {call.name}: {e}", 0.0)
            continue
        except ValueError:   # no signature to check against: let the call itself say
            pass
        where = locator(fn) if isolation == "process" else None
        if where is not None and where not in _UNLOCATABLE:
            worker = _PROCESSES.send((where, call.arguments))
            procs.append((i, worker, where, time.perf_counter()))
            continue
        threads.append((i, _thread(call.name, fn, call.arguments, slots[i]), time.perf_counter()))
    timed_out = f"timed out after {timeout_s:g} s (tool_timeout_s)"
    for i, (proc, conn), where, t0 in procs:
        name = calls[i][1].name
        try:
            # the tool's module is imported first (once per process, any time up to TOOL_LOAD_S): its timeout
            # starts when the process says it has the function
            loaded = conn.recv() if conn.poll(TOOL_LOAD_S) else ("slow",)
            if loaded[0] == "loaded":
                left = loaded[1] + timeout_s - time.time()
                reply = conn.recv() if conn.poll(max(0.0, left)) else None
        except (EOFError, OSError):
            code = ToolProcesses.end((proc, conn))
            log.warning("tool %s ended its process (exit code %s); the call is answered with an error", name, code)
            results[i] = _error(name, f"{name} ended its process (exit code {code}: os._exit or a crash)",
                                time.perf_counter() - t0)
            continue
        if loaded[0] == "slow":
            ToolProcesses.end((proc, conn))
            results[i] = _error(name, f"{name}: its module did not import within {TOOL_LOAD_S:g} s",
                                time.perf_counter() - t0)
            continue
        if loaded[0] == "unlocatable":   # a fresh interpreter cannot find it: run it here, in a thread
            _PROCESSES.give_back((proc, conn))
            _UNLOCATABLE.add(where)
            log.warning("tool %s runs in a thread: a tool process could not load it (%s)", name, loaded[1])
            threads.append((i, _thread(name, calls[i][0][name], calls[i][1].arguments, slots[i]),
                            time.perf_counter()))
            continue
        if reply is None:
            ToolProcesses.end((proc, conn))
            results[i] = _error(name, f"{name} {timed_out}", time.perf_counter() - t0)
            continue
        _PROCESSES.give_back((proc, conn))
        answer = {"value": reply[1:]} if reply[0] == "ok" else {"raised": reply[1], "at": reply[2]}
        results[i] = _answer(name, answer, time.perf_counter() - t0)
    for i, thread, t0 in threads:
        thread.join(max(0.0, t0 + timeout_s - time.perf_counter()))
        name, seconds = calls[i][1].name, time.perf_counter() - t0
        results[i] = _error(name, f"{name} {timed_out}", seconds) if thread.is_alive() else \
            _answer(name, slots[i], seconds)
    return results  # type: ignore[return-value]


def _thread(name: str, fn, arguments: dict, slot: dict) -> threading.Thread:
    def target():
        try:
            value = invoke(fn, arguments)
            slot["value"] = (render(value), type(value).__name__)
        except BaseException as e:  # noqa: BLE001 - the tool's failure is its answer, whatever it raised
            slot["raised"], slot["at"] = f"{type(e).__name__}: {e}", raised_at(e)

    thread = threading.Thread(target=target, daemon=True, name=f"hetrl-tool-{name}")
    thread.start()
    return thread


_TOLD: set = set()   # (tool, what went wrong) already logged: once each, the rest are counted in tool_errors


def _tell_once(name: str, what: str, message: str) -> None:
    """A user's tool failing is the model's answer (an error message it reads), and the user's bug: said once per
    tool and kind of failure, so that a tool that fails on every call does not go unnoticed."""
    if (name, what) not in _TOLD:
        _TOLD.add((name, what))
        log.warning("%s; the model gets it as the call's error message (further failures like it: the tool_errors "
                    "metric)", message)


def _answer(name: str, slot: dict, seconds: float) -> ToolResult:
    if "raised" in slot:
        at = f" at {slot['at']}" if slot.get("at") else ""
        _tell_once(name, slot["raised"].partition(":")[0], f"tool {name} raised {slot['raised']}{at}")
        return _error(name, slot["raised"], seconds)
    text, kind = slot["value"]
    if text is None:
        why = f"{name} returned {kind}, not text, a number or JSON"
        _tell_once(name, kind, f"tool {why}")
        return _error(name, why, seconds)
    return ToolResult(name, capped(name, text), False, seconds)


__all__ = ["HERMES_TEMPLATE", "ToolCall", "ToolResult", "ToolTokenizer", "check_environment", "environment_reward",
           "environment_tools", "load_environment", "load_tools", "parse_tool_calls", "renders_tools", "run_calls",
           "tool_schema", "tool_suffix_ids", "tool_template"]
