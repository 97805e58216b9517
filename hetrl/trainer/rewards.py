"""A user's reward functions, in the two conventions the field uses, told apart by the function's signature.

- TRL: `f(completions, **kwargs) -> list[float | None]`, called once per batch with `prompts`, `completions`,
  `completion_ids` and every other dataset column as a list (the row's value at each position). Completions are
  strings for string prompts and `[{"role": "assistant", "content": ...}]` for chat prompts. `None` means "not
  applicable": it is left out of the weighted sum, as TRL does (a row where every function says None gets 0).
- verl: `compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict`, called once
  per row with the row's `data_source`, `reward_model.ground_truth` and `extra_info`; a dict's `score` is the
  reward and its other keys are reported.

A spec is `FILE.py:NAME` or `package.module:NAME`. Written by hand because neither engine exposes this layer on
its own (TRL's lives inside GRPOTrainer, verl's inside its reward manager). Not yet wired into `hetrl train`
(issue #19); `RewardSet.score` is the interface the loop will call.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import pathlib
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from hetrl.schema import InputError

VERL_PARAMS = ("data_source", "solution_str", "ground_truth")


def load_reward(spec: str) -> Callable:
    """The function a spec names: `path/to/file.py:NAME` or `package.module:NAME`."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise InputError(f"reward {spec!r}: expected FILE.py:NAME or package.module:NAME")
    where, name = spec.rsplit(":", 1)
    try:
        if where.endswith(".py"):
            path = pathlib.Path(where)
            if not path.is_file():
                raise InputError(f"reward {spec!r}: no such file {where}")
            module_name = f"hetrl_reward_{abs(hash(str(path.resolve())))}"
            loader = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader)
            sys.modules[module_name] = module
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except InputError:
        raise
    except SyntaxError as e:
        raise InputError(f"reward {spec!r}: {e.filename}:{e.lineno}: syntax error: {e.msg}") from None
    except Exception as e:  # the user's module failed while importing: say where
        frame = traceback.extract_tb(e.__traceback__)[-1]
        raise InputError(f"reward {spec!r}: importing it failed at {frame.filename}:{frame.lineno}: "
                         f"{type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if fn is None:
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise InputError(f"reward {spec!r}: {where} has no {name!r} (callables there: {', '.join(found) or 'none'})")
    if not callable(fn):
        raise InputError(f"reward {spec!r}: {name} is not callable")
    return fn


def convention(fn: Callable) -> str:
    """'verl' when the first parameters are (data_source, solution_str, ground_truth), else 'trl' when the function
    takes `completions` and keyword arguments; anything else is refused."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return "trl"   # a builtin or C callable: assume TRL's keyword call
    names = [p.name for p in params]
    if tuple(names[:3]) == VERL_PARAMS:
        return "verl"
    if "completions" in names or any(p.kind is p.VAR_KEYWORD for p in params):
        return "trl"
    raise InputError(f"reward {getattr(fn, '__name__', fn)!r}: its parameters ({', '.join(names)}) fit neither "
                     "TRL's f(completions, **kwargs) nor verl's compute_score(data_source, solution_str, "
                     "ground_truth, extra_info=None)")


def _number(value, fn_name: str, row: int, allow_none: bool) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:   # numpy / torch scalars
            value = float(value)
        except (TypeError, ValueError):
            raise InputError(f"reward {fn_name}: row {row}: returned {value!r}, not a number") from None
    value = float(value)
    if not math.isfinite(value):
        raise InputError(f"reward {fn_name}: row {row}: returned {value}, not a finite number")
    return value


def _nested(row: dict, key: str):
    """`reward_model.ground_truth` style lookups into a row."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


@dataclass
class Scores:
    total: list[float]                                   # weighted sum per completion
    per_function: dict[str, list[float | None]]          # each function's raw reward (None: not applicable)
    extra: dict[str, list[Any]] = field(default_factory=dict)   # verl dict keys other than `score`


class RewardSet:
    """Several reward functions with weights (default 1 each), applied to a batch of completions."""

    def __init__(self, funcs: list, weights: list[float] | None = None):
        if not funcs:
            raise InputError("reward: give at least one reward function")
        self.funcs = [load_reward(f) if isinstance(f, str) else f for f in funcs]
        for f in self.funcs:
            if not callable(f):
                raise InputError(f"reward: {f!r} is not callable")
        self.kinds = [convention(f) for f in self.funcs]
        names = [getattr(f, "__name__", type(f).__name__) for f in self.funcs]
        self.names = [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]
        if weights is None:
            weights = [1.0] * len(self.funcs)
        if len(weights) != len(self.funcs):
            raise InputError(f"reward_weights: {len(weights)} weights for {len(self.funcs)} reward functions")
        self.weights = [_number(w, "reward_weights", i, False) for i, w in enumerate(weights)]

    def score(self, rows: list[dict], prompts: list, completions: list[str],
              completion_ids: list[list[int]] | None = None) -> Scores:
        """Rewards of `completions[i]`, sampled for `prompts[i]` from dataset row `rows[i]` (the whole row; its
        `prompt` column is passed as `prompts`). A chat prompt (a list of messages) gets chat completions."""
        n = len(completions)
        if not (len(rows) == len(prompts) == n):
            raise ValueError(f"reward: {len(rows)} rows, {len(prompts)} prompts, {n} completions")
        per: dict[str, list[float | None]] = {}
        extra: dict[str, list[Any]] = {}
        for fn, kind, name in zip(self.funcs, self.kinds, self.names):
            per[name] = self._trl(fn, name, rows, prompts, completions, completion_ids) if kind == "trl" \
                else self._verl(fn, name, rows, completions, extra)
        total = []
        for i in range(n):
            vals = [(w, per[name][i]) for w, name in zip(self.weights, self.names)]
            total.append(sum(w * v for w, v in vals if v is not None))
        return Scores(total, per, extra)

    @staticmethod
    def _trl(fn, name, rows, prompts, completions, completion_ids) -> list[float | None]:
        chat = [isinstance(p, list) for p in prompts]
        comps = [[{"role": "assistant", "content": c}] if is_chat else c for c, is_chat in zip(completions, chat)]
        columns = {k for r in rows for k in r if k not in ("prompt", "completion", "completion_ids")}
        kwargs = {k: [r.get(k) for r in rows] for k in sorted(columns)}
        try:
            out = fn(prompts=prompts, completions=comps,
                     completion_ids=completion_ids if completion_ids is not None else [None] * len(comps), **kwargs)
        except Exception as e:
            frame = traceback.extract_tb(e.__traceback__)[-1]
            raise InputError(f"reward {name}: raised {type(e).__name__}: {e} ({frame.filename}:{frame.lineno}) on a "
                             f"batch of {len(comps)} completions") from None
        try:
            out = list(out)
        except TypeError:
            raise InputError(f"reward {name}: returned {type(out).__name__}, expected a list of "
                             f"{len(comps)} numbers") from None
        if len(out) != len(comps):
            raise InputError(f"reward {name}: returned {len(out)} rewards for {len(comps)} completions")
        return [_number(v, name, i, True) for i, v in enumerate(out)]

    @staticmethod
    def _verl(fn, name, rows, completions, extra) -> list[float | None]:
        out = []
        for i, (row, text) in enumerate(zip(rows, completions)):
            try:
                got = fn(row.get("data_source"), text, _nested(row, "reward_model.ground_truth"), row.get("extra_info"))
            except Exception as e:
                frame = traceback.extract_tb(e.__traceback__)[-1]
                raise InputError(f"reward {name}: row {i}: raised {type(e).__name__}: {e} "
                                 f"({frame.filename}:{frame.lineno})") from None
            if isinstance(got, dict):
                if "score" not in got:
                    raise InputError(f"reward {name}: row {i}: returned a dict without 'score' "
                                     f"(keys: {', '.join(map(str, got))})")
                for k, v in got.items():
                    if k != "score":
                        extra.setdefault(f"{name}/{k}", [None] * len(rows))[i] = v
                got = got["score"]
            out.append(_number(got, name, i, False))
        return out


__all__ = ["RewardSet", "Scores", "convention", "load_reward"]
