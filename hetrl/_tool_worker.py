"""The process a user's tool functions run in (hetrl.data.tools.ToolProcesses): `python -m hetrl._tool_worker FD`, a
fresh interpreter that imports nothing of hetrl but this file and the tools' own modules, and answers one call at a
time over the socket FD (a multiprocessing Connection: stdout stays the tool's own). Not multiprocessing's spawn,
which would run the user's main script again in the child when it has no `if __name__ == "__main__"` guard. A call
that hangs (a C call holding the GIL included) is ended by killing this process; a tool that calls os._exit ends
only this process. It runs in a session of its own, so a Ctrl-C at the terminal reaches the trainer (which finishes
its step and saves a checkpoint) and not the tools. Hand-written because `concurrent.futures.ProcessPoolExecutor`
cannot kill one stuck call (it breaks the whole pool) and cannot say which call ended its worker.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import sys
import time
import traceback


def _locate(locator: tuple[str, str | None, str]):
    """(module name, its file or None, qualified name) -> the function: the module imported by name, or executed
    from its file under the parent's module name (a FILE.py tool module is not importable by name)."""
    module_name, path, qualname = locator
    module = sys.modules.get(module_name)
    if module is None:
        if path is None:
            module = importlib.import_module(module_name)
        else:
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def render(value) -> str | None:
    """A tool's return value as message text (TRL: str(result)); None for values that are not data."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float)):
        return str(value)
    if isinstance(value, (dict, list, tuple)):
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            return None
    return None


def invoke(fn, arguments: dict):
    out = fn(**arguments)
    return asyncio.run(out) if inspect.isawaitable(out) else out


def raised_at(e: BaseException) -> str:
    """Where a tool's exception was raised: the innermost frame's FILE:LINE (the user's own code, or the library
    their tool called)."""
    frames = traceback.extract_tb(e.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def serve(conn) -> None:
    """Per call (locator, arguments): ("unlocatable", "Class: message") when the function cannot be found here;
    else ("loaded", wall-clock time) once it is (the tool's module imported: its timeout starts then), then ("ok",
    text or None, type name) or ("raised", "Class: message", FILE:LINE)."""
    found = {}
    while True:
        try:
            locator, arguments = conn.recv()
        except (EOFError, OSError):
            return
        if locator not in found:
            try:
                found[locator] = _locate(locator)
            except BaseException as e:  # noqa: BLE001 - the caller runs it where it was found instead
                conn.send(("unlocatable", f"{type(e).__name__}: {e}"))
                continue
        conn.send(("loaded", time.time()))
        try:
            value = invoke(found[locator], arguments)
            reply = ("ok", render(value), type(value).__name__)
        except BaseException as e:  # noqa: BLE001 - the tool's failure (SystemExit too) is its answer
            reply = ("raised", f"{type(e).__name__}: {e}", raised_at(e))
        conn.send(reply)


def default_signals() -> None:
    """SIGINT as a fresh interpreter normally has it, whatever the parent was doing when it started this process: an
    ignored SIGINT is inherited across exec (and Python then installs no KeyboardInterrupt handler), and so is a
    blocked one. The trainer ignores SIGINT for a moment while it starts its reward workers (containment.WorkerPool)
    and Python's resource tracker blocks it while it starts; a tool process started by another thread in such a
    moment would have ignored SIGINT for its whole life."""
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


if __name__ == "__main__":
    from multiprocessing.connection import Connection

    default_signals()
    serve(Connection(int(sys.argv[1])))
