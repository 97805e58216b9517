"""One validation layer for every file a user writes: cluster, workload, plan and run config.

Specs are frozen dataclasses whose `__post_init__` calls `check(self)`: every field is checked against
its annotation (int, float, bool, str, `X | None`, `tuple[X, ...]`, dict, nested specs) and the rules
in its metadata (`ge`, `gt`, `le`, `lt`, `choices`); floats must be finite. Cross-field rules stay in
`__post_init__`. `from_mapping(cls, data, where)` builds a spec from parsed YAML/JSON: unknown keys are
refused with the valid ones (and the closest), missing keys are named, and any error is re-raised as one
line naming the file and the field. `read_yaml` / `read_json` read files safely (YAML's safe loader, a
bound on the expanded size so an alias bomb is refused before anything walks it).

Written by hand rather than with pydantic: the specs are plain frozen dataclasses that the torch-free
planner hashes in its caches, and a ~150-line checker over their own annotations gives the one-line,
file-and-field errors the CLI prints without a second model class per spec.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import re
import reprlib
import types
import typing
from typing import Any

import yaml

MAX_VALUES = 1_000_000    # values in one parsed file (aliases expanded): far above any real config


class InputError(ValueError):
    """A user-input error: one line that says where, what, and how to fix it."""

    def __init__(self, message: str, located: bool = False, field: str | None = None):
        super().__init__(" ".join(str(message).split()))   # one line, whatever the parts held
        self.located, self.field = located, field


def rule(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING, ge=None, gt=None,
         le=None, lt=None, choices=None, **kwargs) -> Any:
    """A dataclass field with validation rules: `steps: int = rule(16, ge=1)`."""
    meta = {k: v for k, v in dict(ge=ge, gt=gt, le=le, lt=lt, choices=choices).items() if v is not None}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta, **kwargs)


_short = reprlib.Repr()
_short.maxlevel, _short.maxstring, _short.maxother, _short.maxlist, _short.maxdict = 2, 60, 60, 4, 4


def show(value) -> str:
    """A bounded repr for error messages (a nested or huge value never expands in full)."""
    return _short.repr(value)


def _range_text(meta: dict) -> str:
    lo = (f"{meta['gt']}", "(") if "gt" in meta else (f"{meta['ge']}", "[") if "ge" in meta else None
    hi = (f"{meta['lt']}", ")") if "lt" in meta else (f"{meta['le']}", "]") if "le" in meta else None
    if lo and hi:
        return f" in {lo[1]}{lo[0]}, {hi[0]}{hi[1]}"
    if lo:
        return f" {'>' if lo[1] == '(' else '>='} {lo[0]}"
    if hi:
        return f" {'<' if hi[1] == ')' else '<='} {hi[0]}"
    return ""


def _in_range(v, meta: dict) -> bool:
    return (("ge" not in meta or v >= meta["ge"]) and ("gt" not in meta or v > meta["gt"])
            and ("le" not in meta or v <= meta["le"]) and ("lt" not in meta or v < meta["lt"]))


def choice_error(name: str, value, choices) -> str:
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1) if isinstance(value, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{name} must be one of {', '.join(map(str, choices))}, got {show(value)}{hint}"


_PLAIN = {bool: "true or false", str: "a string", dict: "a mapping"}   # checked by isinstance alone
PYTHON = "<python>"   # a field's value where hetrl.train() was given it from Python (data, rewards), not by a path
NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _kind(tp) -> str:
    """A type as a YAML writer reads it: a string, a list of strings, an int, a finite number, ..."""
    origin = typing.get_origin(tp) or tp
    if origin is tuple:
        targs = typing.get_args(tp)
        return f"a list of {_kind(targs[0]).split(' ', 1)[-1]}s" if len(targs) == 2 and targs[1] is Ellipsis \
            else "a list"
    return {str: "a string", int: "an int", float: "a finite number", bool: "true or false",
            dict: "a mapping"}.get(origin, getattr(origin, "__name__", str(origin)))


def _union_args(tp) -> tuple | None:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return None


def _coerce(name: str, value, tp, meta: dict):
    """-> the value, normalised (int -> float for floats, list -> tuple for tuples, YAML 1.1's '2e-5' -> float),
    or raise InputError naming `name`."""
    args = _union_args(tp)
    if args is not None:
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _coerce(name, value, rest[0], meta)
        for a in rest:   # several types: the first that takes it
            try:
                return _coerce(name, value, a, meta)
            except InputError:
                pass
        raise InputError(f"{name} must be {' or '.join(_kind(a) for a in rest)}, got {show(value)}")
    if "choices" in meta:
        # true == 1 in Python: a bool is a choice only where the choices are bools
        if value not in meta["choices"] or (isinstance(value, bool) and not any(isinstance(c, bool)
                                                                                 for c in meta["choices"])):
            raise InputError(choice_error(name, value, meta["choices"]))
        return value
    origin = typing.get_origin(tp) or tp
    if tp is Any:
        return value
    if origin in _PLAIN:
        if not isinstance(value, origin):
            raise InputError(f"{name} must be {_PLAIN[origin]}, got {show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int) or not _in_range(value, meta):
            raise InputError(f"{name} must be an int{_range_text(meta)}, got {show(value)}")
        return value
    if tp is float:
        if isinstance(value, str) and NUMBER.match(value.strip()):
            value = float(value)    # YAML 1.1 reads 2e-5 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not _in_range(value, meta):
            raise InputError(f"{name} must be a finite number{_range_text(meta)}, got {show(value)}")
        return float(value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise InputError(f"{name} must be a list, got {show(value)}")
        targs = typing.get_args(tp)
        if len(targs) == 2 and targs[1] is Ellipsis:
            return tuple(_coerce(f"{name}[{i}]", v, targs[0], {}) for i, v in enumerate(value))
        if len(value) != len(targs):
            raise InputError(f"{name} must be a list of {len(targs)}, got {show(value)}")
        return tuple(_coerce(f"{name}[{i}]", v, t, {}) for i, (v, t) in enumerate(zip(value, targs)))
    if dataclasses.is_dataclass(origin):
        if not isinstance(value, origin):
            raise InputError(f"{name} must be a {origin.__name__} mapping, got {show(value)}")
        return value
    raise AssertionError(f"schema: no rule for the annotation {tp!r} of {name}")


def check(obj) -> None:
    """Check and normalise every init field of the dataclass `obj` (call it first in `__post_init__`)."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        if not f.init:
            continue
        value = getattr(obj, f.name)
        try:
            new = _coerce(f.name, value, hints[f.name], dict(f.metadata))
        except InputError as e:
            e.field = f.name
            raise
        if new is not value:
            object.__setattr__(obj, f.name, new)


def unknown_keys_error(unknown, valid, where: str, what: str = "key") -> InputError:
    names = sorted(map(str, unknown))
    close = difflib.get_close_matches(names[0], list(valid), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return InputError(f"{where}: unknown {what}(s) {names}{hint}; valid keys: {', '.join(valid)}", located=True)


def require_mapping(data, where: str) -> dict:
    if not isinstance(data, dict):
        raise InputError(f"{where} must be a mapping (key: value), got {show(data)}", located=True)
    return data


def reject_unknown(data: dict, valid, where: str) -> None:
    unknown = set(data) - set(valid)
    if unknown:
        raise unknown_keys_error(unknown, valid, where)


def located(where: str):
    """Context: a user-input error raised inside (a spec's own check, a cross-field rule) gains `where:`."""
    return _Located(where)


class _Located:
    def __init__(self, where: str):
        self.where = where

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and issubclass(exc_type, ValueError) and not getattr(exc, "located", False):
            raise InputError(f"{self.where}: {exc}", located=True) from None
        return False


def from_mapping(cls, data, where: str, **given):
    """Build the dataclass `cls` from a parsed mapping; `given` are fields the caller already converted.
    Nested spec fields (and tuples of them) are built from their own mappings, with their path in `where`."""
    data = require_mapping(data, where)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    reject_unknown(data, list(fields), where)
    missing = [n for n, f in fields.items() if n not in data and n not in given
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        required = ", ".join(n for n, f in fields.items()
                             if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        raise InputError(f"{where}: missing key(s) {missing}; required: {required}", located=True)
    hints = _hints(cls)
    kwargs = dict(given)
    for name, value in data.items():
        if name in given:
            continue
        tp = hints[name]
        args = _union_args(tp)
        inner = [a for a in args if a is not type(None)][0] if args and len(args) == 2 and type(None) in args else tp
        if dataclasses.is_dataclass(inner) and isinstance(value, dict):
            value = from_mapping(inner, value, f"{where}.{name}")
        elif typing.get_origin(inner) is tuple and isinstance(value, list):
            targs = typing.get_args(inner)
            if len(targs) == 2 and targs[1] is Ellipsis and dataclasses.is_dataclass(targs[0]):
                value = tuple(from_mapping(targs[0], v, f"{where}.{name}[{i}]") for i, v in enumerate(value))
        kwargs[name] = value
    with located(where):
        return cls(**kwargs)


# ------------------------------------------------------------------------------------------ files


def _count_values(data, limit: int) -> int:
    """Values in `data` counted with aliases expanded, stopping once past `limit` (never walks a bomb)."""
    n, stack = 0, [data]
    while stack:
        x = stack.pop()
        n += 1
        if n > limit:
            return n
        if isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return n


def bounded(data, where: str, limit: int = MAX_VALUES):
    if _count_values(data, limit) > limit:
        raise InputError(f"{where} expands to more than {limit:,} values (YAML anchors/aliases repeated inside each "
                         "other?); write the values out, or use fewer nested aliases", located=True)
    return data


class _KeyTwice(yaml.YAMLError):
    pass


class _OneValuePerKey(yaml.SafeLoader):
    """SafeLoader that refuses a mapping naming a key twice (PyYAML keeps the last one silently, so `steps: 1`
    then `steps: 2` would run 2 steps unnoticed). A key given by a merge (`<<: *base`) may still be overridden."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node)
                if key in seen:
                    raise _KeyTwice(f"the key {key!r} is given twice (lines {seen[key] + 1} and "
                                    f"{key_node.start_mark.line + 1}); keep one")
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML parse error as a reader wants it: the line and column, the problem, and where the construct it is
    in started (PyYAML's own text names the input '<unicode string>' and quotes it over several lines)."""
    mark = getattr(e, "problem_mark", None)
    if mark is None:
        return " ".join(str(e).split())
    said = f"line {mark.line + 1}, column {mark.column + 1}: {e.problem}"
    start = getattr(e, "context_mark", None)
    if e.context and start is not None:
        said += f" ({e.context} at line {start.line + 1}, column {start.column + 1})"
    return said


def read_yaml(path: str, what: str = "file") -> dict:
    """A YAML mapping from `path`, with the file named in every error; a key given twice in a mapping is an
    error, not the last one kept."""
    text = _read_text(path, what)
    try:
        data = yaml.load(text, Loader=_OneValuePerKey)   # noqa: S506 (a SafeLoader)
    except _KeyTwice as e:
        raise InputError(f"{path}: {e}", located=True) from None
    except yaml.YAMLError as e:
        raise InputError(f"{path} is not valid YAML: {yaml_problem(e)}", located=True) from None
    if data is None:
        data = {}
    bounded(data, path)
    return require_mapping(data, f"{path} (a {what})")


def read_json(path: str, what: str = "file") -> dict:
    text = _read_text(path, what)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}",
                         located=True) from None
    return require_mapping(data, f"{path} (a {what})")


def _read_text(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise InputError(f"{path}: no such {what}", located=True) from None
    except IsADirectoryError:
        raise InputError(f"{path} is a directory; give the {what} itself", located=True) from None
    except UnicodeDecodeError as e:
        raise InputError(f"{path} is not a UTF-8 text {what} ({e.reason} at byte {e.start})", located=True) from None
    except OSError as e:
        raise InputError(f"{path}: cannot read the {what} ({e.strerror})", located=True) from None
