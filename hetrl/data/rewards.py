"""Reward functions: the built-in checks and a user's own, in the two conventions the field uses, one interface.

- TRL: `f(completions, **kwargs) -> list[float | None]`, called once per batch with `prompts`, `completions`,
  `completion_ids` and every other dataset column as a list (the row's value at each position). Completions are
  strings for string prompts and `[{"role": "assistant", "content": ...}]` for chat prompts. `None` means "not
  applicable": it is left out of the weighted sum, as TRL does (a row where every function says None gets 0).
- verl: `compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict`, called once
  per row with the row's `data_source`, `reward_model.ground_truth` and `extra_info`; a dict's `score` is the
  reward and its other keys are reported.

The built-ins (`exact_match`, `math_verify`, `format`; a reasoning-gym task adds `verifier` and `partial`) are
TRL-convention functions too, so `RewardSet.score` never knows which it has. A built-in that checks correctness
is marked (`correctness`): its value >= 1 is what "accuracy" counts. A user's function is named by a spec,
`FILE.py:NAME` or `package.module:NAME`. With `workers` > 0 the user's functions run in that many processes
(slow rewards: a sandbox, a verifier service); the built-ins stay in this process.

Written by hand because neither engine exposes this layer on its own (TRL's lives inside GRPOTrainer, verl's
inside its reward manager).
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import pickle
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from hetrl.schema import InputError

from .containment import Failure, WorkerPool, contained
from .specs import load_module, lookup

VERL_PARAMS = ("data_source", "solution_str", "ground_truth")
VERL_SOURCE_PARAMS = ("solution_str", "ground_truth")    # verl's per-source scorers, e.g. gsm8k.compute_score
log = logging.getLogger(__name__)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def extract_answer(text: str) -> str:
    """The final answer of a reply: the content of <answer>...</answer> if present, else its last number."""
    tagged = re.findall(r"<answer>(.*?)</answer>", text, flags=re.S)
    if tagged:
        return tagged[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else ""


def completion_text(completion) -> str:
    """A completion as text, whether given as a string or as TRL's chat form [{"role": "assistant", ...}]."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def nested(row: dict, key: str):
    """`reward_model.ground_truth` style lookups into a row; None when a part is missing."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


# ------------------------------------------------------------------------------------------ built-ins


def builtin(name: str, fn: Callable, correctness: bool) -> Callable:
    fn.__name__, fn.correctness = name, correctness
    return fn


def builtin_rewards(answer_key: str = "answer") -> dict[str, Callable]:
    """The checks any dataset with an answer column gets (`answer_key`, dotted for nested columns such as verl's
    `reward_model.ground_truth`), plus `format` (the reply is exactly its extracted answer)."""

    def answers(kwargs):
        head, _, rest = answer_key.partition(".")
        if head not in kwargs:
            columns = sorted(k for k in kwargs if k not in TRL_OFFERED)
            raise InputError(f"reward: the built-in checks read the answer column {answer_key!r}, but the rows have "
                             f"{', '.join(columns) if columns else 'no column but the prompt'}; set answer_key=COLUMN "
                             "(dotted for nested, e.g. reward_model.ground_truth), or give data with answers")
        return [nested({head: v}, answer_key) for v in kwargs[head]]

    def exact_match(completions, **kwargs):
        gold = answers(kwargs)
        # a row without an answer is not applicable (None, TRL's convention): not judged wrong
        return [None if g is None else float(_same_answer(extract_answer(completion_text(c)), str(g)))
                for c, g in zip(completions, gold)]

    def math_verify(completions, **kwargs):
        from math_verify import parse, verify

        gold = answers(kwargs)
        out = []
        for c, g in zip(completions, gold):
            text = completion_text(c)
            out.append(None if g is None else float(bool(extract_answer(text)) and bool(verify(parse(str(g)),
                                                                                             parse(text)))))
        return out

    def format(completions, **kwargs):   # noqa: A001 - the reward's name as users write it
        texts = [completion_text(c) for c in completions]
        return [float(bool(extract_answer(t)) and t.strip() == extract_answer(t)) for t in texts]

    exact_match.answer_key = math_verify.answer_key = answer_key     # checked at the first step (RewardSet)
    return {"exact_match": builtin("exact_match", exact_match, True),
            "math_verify": builtin("math_verify", math_verify, True),
            "format": builtin("format", format, False)}


def _same_answer(got: str, gold: str) -> bool:
    got, gold = got.strip(), gold.strip()
    if got == gold:
        return True
    try:
        return float(got) == float(gold)
    except ValueError:
        return False


# ------------------------------------------------------------------------------------------ a user's functions


def load_reward(spec: str) -> Callable:
    """The function a spec names: `path/to/file.py:NAME` or `package.module:NAME`."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise InputError(f"reward {spec!r}: expected a built-in name, FILE.py:NAME or package.module:NAME"
                         + (" (or, from Python, a callable)" if not isinstance(spec, str) else ""))
    return lookup(load_module(spec, "reward"), spec, spec.rsplit(":", 1)[1], "reward")


def resolve(specs, builtins: dict[str, Callable]) -> list[tuple[Callable, str | None]]:
    """Reward specs -> [(function, spec it was loaded from or None)]. A spec is a built-in's name, FILE.py:NAME,
    package.module:NAME, or a callable (from Python)."""
    out = []
    for s in specs:
        if callable(s):
            out.append((s, None))
        elif isinstance(s, str) and ":" not in s:
            if s not in builtins:
                raise InputError(f"reward {s!r} is not a built-in here (built-ins: {', '.join(builtins)}); a function "
                                 "of yours is given as FILE.py:NAME or package.module:NAME")
            out.append((builtins[s], None))
        else:
            out.append((load_reward(s), s))
    return out


def convention(fn: Callable) -> str:
    """'verl' when the first parameters are (data_source, solution_str, ground_truth), else 'trl' when the function
    takes `completions` and keyword arguments; anything else is refused."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return "trl"   # a builtin or C callable: assume TRL's keyword call
    names = [p.name for p in params]
    if tuple(names[:3]) == VERL_PARAMS or tuple(names[:2]) == VERL_SOURCE_PARAMS:
        return "verl"
    if "completions" in names or any(p.kind is p.VAR_KEYWORD for p in params):
        return "trl"
    raise InputError(f"reward {getattr(fn, '__name__', fn)!r}: its parameters ({', '.join(names)}) fit none of "
                     "TRL's f(completions, **kwargs), verl's compute_score(data_source, solution_str, ground_truth, "
                     "extra_info=None) or a verl per-source scorer compute_score(solution_str, ground_truth, ...)")


TRL_OFFERED = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
               "environments")   # what a TRL-style reward gets besides the data's columns (environments: with one)


def missing_columns(reward, columns: set[str], answer_key: str = "answer") -> list[str]:
    """The data columns `reward` (a built-in name or a loaded function) needs and the rows lack:
    the answer column of the built-in checks (its first part where dotted), and the parameters without a default
    that a TRL-style function requires and neither TRL's call nor the rows give. Checked before the model loads
    (a reward would otherwise fail on the first batch); verl-style functions read missing columns as None."""
    if isinstance(reward, str):
        head = answer_key.partition(".")[0]
        return [head] if reward in ("exact_match", "math_verify") and head not in columns else []
    fn = reward
    if convention(fn) != "trl":
        return []
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.default is p.empty and p.kind in named and p.name not in TRL_OFFERED
            and p.name not in columns]


def columns_problems(rewards: list, rows: list[dict], answer_key: str, where: str) -> list[str]:
    """Each reward (built-in names and loaded functions, as `load_rewards` gives them) that needs a column the
    `rows` (read from `where`) lack, one line each."""
    columns = {k for r in rows for k in r}
    out = []
    taken = sorted(columns & {"prompts", "completions", "completion_ids"})
    if taken and any(isinstance(f, str) or convention(f) == "trl" for f in rewards):
        out.append(f"{where} has the column(s) {', '.join(taken)}: TRL's reward call passes the prompts, the replies "
                   "and their token ids under those names, and a column of the same name would be passed twice; "
                   "rename the column(s)")
    for f in rewards:
        missing = missing_columns(f, columns, answer_key)
        if missing:
            out.append(f"reward {f if isinstance(f, str) else getattr(f, '__name__', f)} needs the column(s) "
                       f"{', '.join(missing)}, which {where} does not have (its columns: {', '.join(sorted(columns))})"
                       + ("; set answer_key=COLUMN" if isinstance(f, str) else ""))
    return out


def load_rewards(rewards: list) -> list:
    """The run's rewards with every FILE.py:NAME (or module:NAME) spec imported and its convention checked, once,
    before the model loads; built-in names and callables as given."""
    out = [load_reward(f) if isinstance(f, str) and ":" in f else f for f in rewards]
    for f in out:
        if callable(f):
            convention(f)
    return out


def _accepts(fn, name: str) -> bool:
    """Whether fn takes keyword `name` (by name, or through **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


def _number(value, fn_name: str, row: int, allow_none: bool) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, (str, bytes)):     # float("1") would take it: a reward is a number, not text
        raise InputError(f"reward {fn_name}: row {row}: returned the text {value!r}, not a number; return "
                         "float(...) of it if it is one")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:   # numpy / torch scalars
            value = float(value)
        except (TypeError, ValueError):
            raise InputError(f"reward {fn_name}: row {row}: returned {value!r}, not a number") from None
    value = float(value)
    if not math.isfinite(value):
        raise InputError(f"reward {fn_name}: row {row}: returned {value}, not a finite number")
    return value


def call_trl(fn, name, rows, prompts, completions, completion_ids, first_row: int = 0, trainer_state=None,
             logged: dict | None = None) -> tuple[list[float | None], dict[str, list]]:
    """TRL's call: every column as a list, plus `trainer_state`, `log_extra(column, values)` and
    `log_metric(name, value)` to a function that takes them (by name or **kwargs). -> (rewards, log_extra's
    columns); log_metric's values are appended to `logged` (name -> values)."""
    chat = [isinstance(p, list) for p in prompts]
    comps = [[{"role": "assistant", "content": c}] if is_chat else c for c, is_chat in zip(completions, chat)]
    columns = {k for r in rows for k in r if k not in ("prompt", "completion", "completion_ids")}
    kwargs = {k: [r.get(k) for r in rows] for k in sorted(columns)}
    extra: dict[str, list] = {}

    def log_extra(column: str, values: list) -> None:
        extra[f"{name}/{column}"] = list(values)

    def log_metric(metric: str, value: float) -> None:
        try:   # numpy / torch scalars too, but never text
            number = None if isinstance(value, (bool, str, bytes)) else float(value)
        except (TypeError, ValueError):
            number = None
        if number is None or not math.isfinite(number):
            raise InputError(f"log_metric({metric!r}, {show_value(value)}): the value must be a finite number")
        if logged is not None:
            logged.setdefault(str(metric), []).append(number)

    offered = {"trainer_state": trainer_state, "log_extra": log_extra, "log_metric": log_metric}
    kwargs |= {k: v for k, v in offered.items() if k not in columns and _accepts(fn, k)}
    out = contained(lambda: fn(prompts=prompts, completions=comps, completion_ids=completion_ids if completion_ids
                               is not None else [None] * len(comps), **kwargs))
    if isinstance(out, Failure):
        raise InputError(f"reward {name}: {out.why} on a batch of {len(comps)} completions "
                         f"({_rows(first_row, len(comps))})")
    if isinstance(out, (str, bytes, dict)):
        raise InputError(f"reward {name}: returned {type(out).__name__} {show_value(out)}, expected a list of "
                         f"{len(comps)} numbers")
    try:
        out = list(out)
    except TypeError:
        raise InputError(f"reward {name}: returned {type(out).__name__}, expected a list of "
                         f"{len(comps)} numbers") from None
    if len(out) != len(comps):
        raise InputError(f"reward {name}: returned {len(out)} rewards for {len(comps)} completions")
    bad = next((k for k, v in extra.items() if len(v) != len(comps)), None)
    if bad is not None:
        raise InputError(f"reward {name}: log_extra({bad.split('/', 1)[1]!r}, ...) got {len(extra[bad])} values "
                         f"for {len(comps)} completions")
    return [_number(v, name, first_row + i, True) for i, v in enumerate(out)], extra


def show_value(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def call_verl(fn, name, rows, completions, first_row: int = 0) -> tuple[list[float], dict[str, list]]:
    out, extra = [], {}
    for i, (row, text) in enumerate(zip(rows, completions)):
        got = contained(lambda: _verl_call(fn, row, text))
        if isinstance(got, Failure):
            raise InputError(f"reward {name}: row {first_row + i}: {got.why}")
        if isinstance(got, dict):
            if "score" not in got:
                raise InputError(f"reward {name}: row {first_row + i}: returned a dict without 'score' "
                                 f"(keys: {', '.join(map(str, got))})")
            for k, v in got.items():
                if k != "score":
                    extra.setdefault(f"{name}/{k}", [None] * len(rows))[i] = v
            got = got["score"]
        out.append(_number(got, name, first_row + i, False))
    return out, extra


def _verl_call(fn, row: dict, text: str):
    """verl's call: compute_score(data_source, solution_str, ground_truth, extra_info) or a per-source scorer's
    compute_score(solution_str, ground_truth, ...) (its own defaults for method / format_score / score);
    extra_info only to a function that takes it."""
    gt = nested(row, "reward_model.ground_truth")
    extra = {"extra_info": row.get("extra_info")} if _accepts(fn, "extra_info") else {}
    if _accepts_positional(fn, 0, "data_source"):
        return fn(row.get("data_source"), text, gt, **extra)
    return fn(solution_str=text, ground_truth=gt, **extra)


def _accepts_positional(fn, i: int, name: str) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True
    return len(params) > i and params[i].name == name


def _rows(first: int, n: int) -> str:
    return f"row {first}" if n == 1 else f"rows {first}..{first + n - 1}"


def _own_copies(rows: list[dict], prompts: list, completion_ids):
    """What one call of a reward function may change without reaching the run: each row, prompt and token list its
    own copy (a group's samples share their dataset row, and the run keeps its rows for every later step and
    evaluation: a judge that appended the reply to `prompts[i]` grew the held-out prompts at every evaluation, as
    TRL's fresh rows per call never do). An environment instance (TRL's environments=) is the rollout's own, passed
    as it is."""
    rows = [{k: v if k == "environments" else copy.deepcopy(v) for k, v in r.items()} for r in rows]
    prompts = [copy.deepcopy(p) for p in prompts]
    ids = None if completion_ids is None else [copy.deepcopy(x) for x in completion_ids]
    return rows, prompts, ids


def _call(fn, kind, name, rows, prompts, completions, completion_ids, first_row, trainer_state=None):
    """One chunk of one function -> (rewards, extras per row, log_metric's values); a bad return or anything
    raised is an InputError. The function gets its own copies of the rows (`_own_copies`)."""
    rows, prompts, completion_ids = _own_copies(rows, prompts, completion_ids)
    if kind == "trl":
        logged: dict[str, list] = {}
        values, extra = call_trl(fn, name, rows, prompts, completions, completion_ids, first_row, trainer_state,
                                 logged)
        return values, extra, logged
    return (*call_verl(fn, name, rows, completions, first_row), {})


# ------------------------------------------------------------------------------------------ worker processes

_LOADED: dict[str, Callable] = {}


def _in_worker(ref, kind, name, rows, prompts, completions, completion_ids, first_row, trainer_state=None):
    """One chunk of one function, in a reward worker process. `ref` is a spec (loaded once per process) or a
    pickled function."""
    if isinstance(ref, str):
        if ref not in _LOADED:
            _LOADED[ref] = load_reward(ref)
        fn = _LOADED[ref]
    else:
        fn = pickle.loads(ref)
    return _call(fn, kind, name, rows, prompts, completions, completion_ids, first_row, trainer_state)


@dataclass(frozen=True)
class TrainerState:
    """What a TRL-style reward gets as `trainer_state` (the fields of TRL's TrainerState that hetrl has)."""

    global_step: int
    max_steps: int


@dataclass
class Scores:
    total: list[float]                                   # weighted sum per completion
    per_function: dict[str, list[float | None]]          # each function's raw reward (None: not applicable)
    extra: dict[str, list[Any]] = field(default_factory=dict)   # verl dict keys other than `score`
    correct: list[bool | None] | None = None             # the first correctness check's value >= 1 (built-ins);
    #                                                      None for a row it did not judge (it returned None)
    failed: list[int] = field(default_factory=list)      # rows a reward failed on (reward_errors=skip): dropped
    errors: list[str] = field(default_factory=list)      # what each failure was, one line each
    logged: dict[str, list[float]] = field(default_factory=dict)   # TRL's log_metric(name, value) calls

    def means(self) -> dict[str, float]:
        """metrics: `reward/<function>` (mean over the rows it applied to) and numeric verl extras."""
        out = {}
        for name, values in {**self.per_function, **self.extra}.items():
            nums = [float(v) for v in values if isinstance(v, (int, float))]
            if nums:
                out[f"reward/{name}"] = sum(nums) / len(nums)
        return out


class RewardSet:
    """Several reward functions with weights (default 1 each), applied to a batch of completions."""

    def __init__(self, funcs: list, weights: list[float] | None = None, workers: int = 0,
                 builtins: dict[str, Callable] | None = None, errors: str = "stop", timeout_s: float | None = None,
                 strict: bool = False):
        if not funcs:
            raise InputError("reward: give at least one reward function")
        loaded = resolve(funcs, builtins or {})
        self.funcs = [f for f, _ in loaded]
        self.specs = [s for _, s in loaded]
        for f in self.funcs:
            if not callable(f):
                raise InputError(f"reward: {f!r} is not callable")
        self.kinds = [convention(f) for f in self.funcs]
        names = [getattr(f, "__name__", type(f).__name__) for f in self.funcs]
        self.names = [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]
        if weights is None:
            weights = [1.0] * len(self.funcs)
        weights = list(weights)
        if len(weights) != len(self.funcs):
            raise InputError(f"reward_weights: {len(weights)} weights for {len(self.funcs)} reward functions "
                             f"({', '.join(self.names)})")
        self.weights = [_number(w, "reward_weights", i, False) for i, w in enumerate(weights)]
        self.correctness = next((n for f, n in zip(self.funcs, self.names) if getattr(f, "correctness", False)), None)
        self.workers, self.errors, self.timeout_s = workers, errors, timeout_s
        if errors not in ("stop", "skip"):
            raise InputError(f"reward_errors must be stop or skip, got {errors!r}")
        if timeout_s is not None and not workers:
            raise InputError(f"reward_timeout_s={timeout_s:g} needs reward_workers >= 1: a function running in this "
                             "process cannot be stopped; set reward_workers=1 (or more)")
        self._refs = [self._worker_ref(f, s, n) if workers and not hasattr(f, "correctness") else None
                      for f, s, n in zip(self.funcs, self.specs, self.names)]
        self._pool = None
        self.strict, self._checked = strict, False
        # what TRL-style functions get as `trainer_state`; the loop sets it at each step
        self.trainer_state = TrainerState(global_step=0, max_steps=0)

    @staticmethod
    def _worker_ref(fn, spec, name):
        if spec is not None:
            return spec
        try:
            return pickle.dumps(fn)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise InputError(f"reward {name}: reward_workers > 0 runs it in other processes, which needs a function "
                             f"defined at the top level of an importable module (or given as FILE.py:NAME); it "
                             f"cannot be sent there ({type(e).__name__}: {e})") from None

    def score(self, rows: list[dict], prompts: list, completions: list[str],
              completion_ids: list[list[int]] | None = None, check: bool = False) -> Scores:
        """Rewards of `completions[i]`, sampled for `prompts[i]` from dataset row `rows[i]` (the whole row; its
        `prompt` column is passed as `prompts`). A chat prompt (a list of messages) gets chat completions.
        `check`: the first such call looks for silent zeros (check_silent_zeros)."""
        n = len(completions)
        if not (len(rows) == len(prompts) == n):
            raise ValueError(f"reward: {len(rows)} rows, {len(prompts)} prompts, {n} completions")
        per: dict[str, list[float | None]] = {}
        extra: dict[str, list[Any]] = {}
        failed: set[int] = set()
        errors: list[str] = []
        logged: dict[str, list[float]] = {}
        args = (rows, prompts, completions, completion_ids)
        chunks = [(i, a, b) for i, ref in enumerate(self._refs) if n
                  for a, b in (self._chunks(n) if ref is not None else [(0, n)])]
        outs = self._run(chunks, args)
        for (i, a, b), out in zip(chunks, outs):
            name = self.names[i]
            values = per.setdefault(name, [None] * n)
            parts = [(a, b, out)]
            if isinstance(out, Failure):
                bad, good = self._salvage(i, a, b, out, args)
                failed |= bad.keys()
                errors += bad.values()
                parts = [(r, r + 1, o) for r, o in good.items()]
            for a, b, (got_values, got, metrics) in parts:
                values[a:b] = got_values
                for k, v in got.items():
                    extra.setdefault(k, [None] * n)[a:b] = v
                for k, v in metrics.items():
                    logged.setdefault(k, []).extend(v)
        per = {name: per.get(name, []) for name in self.names}
        total = [sum(w * per[name][i] for w, name in zip(self.weights, self.names) if per[name][i] is not None)
                 for i in range(n)]
        # a row the check did not judge (no answer to check against: it returned None) is neither right nor wrong
        correct = [None if v is None or i in failed else v >= 1.0 for i, v in enumerate(per[self.correctness])] \
            if self.correctness else None
        if check and not self._checked and n > 1:
            self._checked = True
            self.check_silent_zeros(rows, per, failed)
        return Scores(total, per, extra, correct, sorted(failed), errors, logged)

    def check_silent_zeros(self, rows: list[dict], per: dict[str, list[float | None]], failed: set[int]) -> None:
        """The first training step's rewards: a function that is None, 0 or one constant for every row, a verl
        scorer given no ground truth, or a built-in check whose answer_key is missing in the rows, trains on zeros
        (or nothing) without a word. Each is a warning, or with `strict` an error."""
        n = len(rows)
        found = []
        for fn, kind, name in zip(self.funcs, self.kinds, self.names):
            values = [v for r, v in enumerate(per[name]) if r not in failed]
            if values and all(v is None for v in values):
                found.append(f"reward {name} returned None (not applicable) for every one of the {len(values)} "
                             "rows of the first step, so it adds nothing")
            elif values and len(set(values)) == 1:
                found.append(f"reward {name} is {values[0]:g} for every one of the {len(values)} rows of the first "
                             "step: no learning signal from it")
            if kind == "verl":
                missing = sum(nested(r, "reward_model.ground_truth") is None for r in rows)
                if missing:
                    found.append(f"reward {name} (verl convention) was called with ground_truth=None for {missing} "
                                 f"of {n} rows: they have no reward_model.ground_truth column (verl's layout)")
            key = getattr(fn, "answer_key", None)
            if key is not None:
                missing = sum(nested(r, key) is None for r in rows)
                if missing:
                    found.append(f"reward {name}: answer_key={key} is missing in {missing} of {n} rows, which it "
                                 "does not score (None: no reward from it, and not counted in accuracy); set "
                                 "answer_key to the column (dotted for nested) that holds the answer")
        if found and self.strict:
            raise InputError("strict=true: " + "; ".join(found))
        for why in found:
            log.warning("warning: %s (strict=true makes this an error)", why)

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        size = math.ceil(n / self.workers)
        return [(a, min(a + size, n)) for a in range(0, n, size)]

    def _run(self, chunks: list[tuple[int, int, int]], args) -> list:
        """Each (function, first row, end row) chunk's (rewards, extras) or Failure: the user's functions in the
        worker pool when there is one (all chunks at once), the rest here."""
        rows, prompts, completions, ids = args
        jobs = [(i, (self._refs[i], self.kinds[i], self.names[i], rows[a:b], prompts[a:b], completions[a:b],
                     None if ids is None else ids[a:b], a, self.trainer_state)) for i, a, b in chunks]
        pooled = [k for k, (i, _) in enumerate(jobs) if self._refs[i] is not None]
        out: list = [None] * len(jobs)
        if pooled:
            if self._pool is None:
                self._pool = WorkerPool(self.workers, _in_worker, self.timeout_s)
            for k, got in zip(pooled, self._pool.map([jobs[k][1] for k in pooled])):
                out[k] = got
        for k, (i, job) in enumerate(jobs):
            if self._refs[i] is None:
                out[k] = contained(lambda: _call(self.funcs[i], *job[1:]))
        return out

    def _salvage(self, i: int, a: int, b: int, failure: Failure, args) -> tuple[dict[int, str], dict[int, Any]]:
        """A failed chunk. reward_errors=stop: raise the failure as one line. skip: ({row: why} of the rows that
        fail alone, {row: (rewards, extras)} of the others): a chunk that raised is retried row by row, one whose
        worker died or hung is dropped whole."""
        name = self.names[i]
        why = failure.why if failure.why.startswith(f"reward {name}") else \
            f"reward {name}: {_rows(a, b - a)}: {failure.why}"
        if self.errors == "stop":
            fix = "fix the data or answer_key" if getattr(self.funcs[i], "correctness", None) is not None else \
                "fix the function"   # a built-in check (builtin() marks them) fails on the data, not its code
            raise InputError(f"{why}; {fix}, or set reward_errors=skip to drop the rows it fails on")
        if b - a == 1 or not failure.raised:
            return {r: why for r in range(a, b)}, {}
        single = dict(zip(range(a, b), self._run([(i, r, r + 1) for r in range(a, b)], args)))
        return ({r: o.why for r, o in single.items() if isinstance(o, Failure)},
                {r: o for r, o in single.items() if not isinstance(o, Failure)})

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


__all__ = ["RewardSet", "Scores", "builtin_rewards", "convention", "extract_answer", "load_reward", "resolve"]
