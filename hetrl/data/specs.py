"""The user's code a spec names, `FILE.py:NAME` or `package.module:NAME`: one set of rules for reward functions,
tools and environments, so a spec that loads as one kind loads as the others.

A file is executed once per version (its mtime and size), as Python imports a module once: `hetrl train`'s check
before the model loads and the run then share it, and a file changed since is executed again. `package.module` is
imported with the current directory first on the path, as `python -c` would. Whatever importing raises (a syntax
error, an exception, `sys.exit`) becomes one InputError line naming the kind, the spec and where it failed.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import sys

from hetrl.schema import InputError

from .containment import UserAbort
from .containment import where as _where


def load_module(spec: str, kind: str):
    """The module of `spec` (the part before its last colon); `kind` ("reward", "tool", "environment") opens each
    error message and names the module a file is executed as."""
    where = spec.rsplit(":", 1)[0]
    try:
        if where.endswith(".py"):
            return _execute(where, spec, kind)
        return _import_here(where)
    except (InputError, UserAbort):
        raise
    except SyntaxError as e:
        raise InputError(f"{kind} {spec!r}: {e.filename}:{e.lineno}: syntax error: {e.msg}") from None
    except BaseException as e:  # noqa: BLE001 - the user's module failed (or exited) while importing: say where
        if isinstance(e, ModuleNotFoundError) and e.name and (where == e.name or where.startswith(e.name + ".")):
            # the spec's own module (not one it imports): where the import machinery failed says nothing
            raise InputError(f"{kind} {spec!r}: no module named {e.name!r} is importable from here (a package "
                             "installed, or on PYTHONPATH); a file is given as path/to/file.py:NAME") from None
        detail = f"{type(e).__name__}({e.code!r})" if isinstance(e, SystemExit) else f"{type(e).__name__}: {e}"
        raise InputError(f"{kind} {spec!r}: importing it failed at {_where(e)}: {detail}") from None


def lookup(module, spec: str, name: str, kind: str):
    """`module.name`, which must be callable; a missing name lists the module's public callables."""
    obj = getattr(module, name, None)
    if obj is None:
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise InputError(f"{kind} {spec!r}: {spec.rsplit(':', 1)[0]} has no {name!r} (callables there: "
                         f"{', '.join(found) or 'none'})")
    if not callable(obj):
        raise InputError(f"{kind} {spec!r}: {name} is a {type(obj).__name__}, not callable")
    return obj


def _execute(where: str, spec: str, kind: str):
    path = pathlib.Path(where)
    if not path.is_file():
        raise InputError(f"{kind} {spec!r}: no such file {where}")
    module_name = f"hetrl_{kind}_{abs(hash(str(path.resolve())))}"
    stat = path.stat()
    version = (stat.st_mtime_ns, stat.st_size)
    module = sys.modules.get(module_name)
    if module is None or getattr(module, "__hetrl_version__", None) != version:
        loader = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader)
        sys.modules[module_name] = module
        try:
            loader.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
        module.__hetrl_version__ = version
    return module


def _import_here(name: str):
    """import `name` as `python -c` would: the current directory first on the path (the `hetrl` console script,
    unlike `python -m hetrl`, does not put it there)."""
    here = os.getcwd()
    added = here not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        return importlib.import_module(name)
    finally:
        if added and here in sys.path:
            sys.path.remove(here)
