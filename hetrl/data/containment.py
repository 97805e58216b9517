"""Running a user's reward code so that whatever it does is that reward's error, never the run's.

In this process an exception, `SystemExit` or `KeyboardInterrupt` raised by the function is caught and named
(function, rows). In worker processes (`reward_workers=N`) so are `os._exit`, a crash and a hang
(`reward_timeout_s`): the worker is killed and replaced. Workers ignore SIGINT: Ctrl-C in a terminal reaches
the whole process group, and only hetrl's handler decides what it means (first: finish the step and save;
second: `UserAbort`, and the busy workers are killed at once). Written by hand because
`concurrent.futures.ProcessPoolExecutor` re-raises a worker's `SystemExit` in the caller (hetrl would exit 0
with nothing trained), breaks for good when a worker dies, and cannot stop a hung call.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable

from hetrl.schema import InputError


class UserAbort(KeyboardInterrupt):
    """hetrl's own abort (the second Ctrl-C): passes through the containment, never taken for a reward's error."""


@dataclass(frozen=True)
class Failure:
    """One call of a user's function that did not return normally: `why` is one line; `raised` is False for a
    worker that died or hung (retrying its rows one by one would only repeat that)."""

    why: str
    raised: bool = True


_HETRL = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the hetrl package's folder


def where(e: BaseException) -> str:
    """The user's file and line an error came from: the innermost frame outside hetrl (the line of the user's
    code that raised, or that called the library that did). None there (a call whose arguments do not fit the
    user's signature fails before entering it): said so, instead of naming hetrl's own call site."""
    tb = traceback.extract_tb(e.__traceback__)
    if not tb:
        return "?"
    users = [f for f in tb if not os.path.abspath(f.filename).startswith(_HETRL + os.sep)]
    if users:
        return f"{users[-1].filename}:{users[-1].lineno}"
    if isinstance(e, TypeError):
        return "when hetrl called it: its parameters do not take that call"
    return f"{tb[-1].filename}:{tb[-1].lineno}"


def contained(call: Callable[[], Any]) -> Any:
    """call() -> its value, or a Failure for anything it raises (SystemExit and KeyboardInterrupt included) but
    hetrl's own UserAbort. An InputError is the reward layer's own one-line verdict (a wrong return value)."""
    try:
        return call()
    except UserAbort:
        raise
    except InputError as e:
        return Failure(str(e))
    except BaseException as e:     # noqa: BLE001 - the user's code: whatever it raises is its error
        kind = type(e).__name__
        detail = f"{kind}({e.code!r})" if isinstance(e, SystemExit) else f"{kind}: {e}" if str(e) else kind
        return Failure(f"raised {detail} ({where(e)})")


def user_call(call: Callable[[], Any], what: str) -> Any:
    """call() of the user's code (an environment's constructor or reset()) -> its value; whatever it raises is one
    InputError naming `what`, the exception's class and the file and line in the user's code (`contained`)."""
    out = contained(call)
    if isinstance(out, Failure):
        raise InputError(f"{what} {out.why}")
    return out


def name_of(obj) -> str:
    """A user's function, class or callable object by its name (its type's, for an object without one)."""
    return getattr(obj, "__name__", type(obj).__name__)


def _serve(conn, run: Callable) -> None:
    """A worker: answer (job id, args) with (job id, value or Failure) until told None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the trainer's to handle
    while True:
        job = conn.recv()
        if job is None:
            return
        j, args = job
        out = contained(lambda: run(*args))
        try:
            conn.send((j, out))
        except Exception as e:   # the value cannot be pickled: say so instead of dying
            conn.send((j, Failure(f"returned a value that cannot be sent back from its worker "
                                  f"({type(e).__name__}: {e})")))


class WorkerPool:
    """`n` worker processes (spawned clean: no copy of the trainer's threads or model memory) that each run
    `run(*args)` jobs one at a time. `timeout_s`: a job that has not answered by then is a Failure."""

    def __init__(self, n: int, run: Callable, timeout_s: float | None = None):
        self.n, self.run_fn, self.timeout_s = n, run, timeout_s
        self._workers: list = [None] * n

    def _start(self, i: int):
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(theirs, self.run_fn), daemon=True, name=f"hetrl-reward-{i}")
        # an ignored SIGINT is inherited and Python then installs no KeyboardInterrupt handler: a Ctrl-C while
        # the worker starts cannot kill it before _serve ignores SIGINT itself
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            proc.start()
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)
        theirs.close()
        self._workers[i] = (proc, ours)

    def map(self, jobs: list[tuple]) -> list[Any]:
        """Each job's value or Failure, in order; jobs go to whichever worker is free."""
        results: list[Any] = [None] * len(jobs)
        todo = deque(range(len(jobs)))
        busy: dict[int, tuple[int, float]] = {}     # worker -> (job, deadline)
        try:
            while todo or busy:
                for i in range(self.n):
                    if todo and i not in busy:
                        if self._workers[i] is None or not self._workers[i][0].is_alive():
                            self._start(i)
                        j = todo.popleft()
                        self._workers[i][1].send((j, jobs[j]))
                        busy[i] = (j, time.monotonic() + (self.timeout_s or float("inf")))
                wait_s = min(d for _, d in busy.values()) - time.monotonic()
                ready = set(wait([x for i in busy for x in (self._workers[i][1], self._workers[i][0].sentinel)],
                                 timeout=None if wait_s == float("inf") else max(0.0, wait_s)))
                for i, (j, deadline) in list(busy.items()):
                    proc, conn = self._workers[i]
                    if conn in ready or conn.poll():
                        try:
                            got_j, results[j] = conn.recv()
                            assert got_j == j
                            del busy[i]
                            continue
                        except EOFError:
                            pass    # it died while answering: below
                    if proc.sentinel in ready or not proc.is_alive():
                        proc.join()
                        results[j] = Failure(f"its worker process exited (exit code {proc.exitcode}) without "
                                             "returning: it called os._exit or crashed", raised=False)
                    elif time.monotonic() >= deadline:
                        results[j] = Failure(f"did not return within reward_timeout_s={self.timeout_s:g} s; its "
                                             "worker was stopped", raised=False)
                    else:
                        continue
                    self._kill(i)
                    del busy[i]
        except BaseException:
            for i in busy:          # an abort (second Ctrl-C) or a bug: nobody waits for the busy workers
                self._kill(i)
            raise
        return results

    def _kill(self, i: int) -> None:
        if self._workers[i] is not None:
            proc, conn = self._workers[i]
            proc.kill()
            proc.join(5)
            conn.close()
            self._workers[i] = None

    def close(self) -> None:
        """Idle workers are told to stop (a second later they are killed); busy ones were killed already."""
        for i, w in enumerate(self._workers):
            if w is None:
                continue
            proc, conn = w
            try:
                conn.send(None)
            except OSError:
                pass
            proc.join(1)
            self._kill(i)


__all__ = ["Failure", "UserAbort", "WorkerPool", "contained"]
