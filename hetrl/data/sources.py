"""Where a run's prompts come from: a reasoning-gym generator (`task=`) or a user's rows (`data=`), one interface.

Both give `Example`s (the dataset row with every column, its prompt under `prompt`, and the prompt as token ids)
through the same calls: `eval_examples` (held out, never trained on) and `train_examples(start, count)`, a
deterministic stream indexed by position, so a checkpoint stores one integer and a resumed run draws the same
prompts. A prompt is a string (tokenized as is, no special tokens added, as TRL does) or a list of chat messages
(rendered with the tokenizer's chat template, generation prompt added). Prompts longer than `max_prompt_tokens`
are skipped and counted, never truncated.

- reasoning-gym: training problems are generator indices 0, 1, 2, ... of one seed; the held-out set comes from
  another seed, and a training problem whose question is also held out is skipped.
- a user's rows (JSONL, JSON, Parquet, CSV, or a `datasets.save_to_disk` directory, read with `datasets`, offline):
  the held-out rows are `eval_data`, or else a saved DatasetDict's test (else validation) split, or else
  `eval_size` rows drawn out of `data` by seed; training rows whose
  prompt equals a held-out prompt are dropped too. Each epoch visits the training rows in a new order drawn from
  (seed, epoch). Rows are held in memory as Python dicts (fine to millions of short rows).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import random
import tempfile
from dataclasses import dataclass
from typing import Callable, Protocol

from hetrl.schema import PYTHON, InputError, show, unknown_keys_error

from .checks import READERS, check_prompts
from .rewards import builtin, builtin_rewards, completion_text, extract_answer

DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass(frozen=True)
class Example:
    row: dict              # every column of the dataset row; the prompt is under "prompt"
    prompt_ids: list[int]


def prompt_ids(tokenizer, prompt) -> list[int]:
    """A prompt as token ids: a string as is, chat messages through the chat template. As TRL's
    apply_chat_template: a conversation that ends with an assistant message is continued from that message's
    text (continue_final_message: the reply starts with it), any other gets the generation prompt."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    go_on = reply_prefix(prompt) is not None
    out = tokenizer.apply_chat_template(prompt, add_generation_prompt=not go_on, continue_final_message=go_on)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def reply_prefix(prompt) -> str | None:
    """The text a chat prompt's reply starts with: its last message's, where that is the assistant's (None: the
    reply starts fresh)."""
    if isinstance(prompt, list) and prompt and prompt[-1].get("role") == "assistant":
        return prompt[-1]["content"]
    return None


def _check_prompt(prompt, where: str):
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt):
        return
    raise InputError(f"{where}: the prompt must be a string or a list of chat messages "
                     f"[{{'role': ..., 'content': ...}}], got {show(prompt)}")


def check_plain_text(tokenizer, **texts: str) -> None:
    """Text the run inserts into every prompt (prompt_suffix, response_prefix) must not hold the tokenizer's
    special tokens (<|im_end|>, a role marker): tokenized, they would become real control tokens, ending a turn or
    opening another, not text the model reads."""
    specials = set(getattr(tokenizer, "all_special_tokens", []))
    specials |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    for name, text in texts.items():
        found = sorted(t for t in specials if t and t in text)
        if found:
            raise InputError(f"{name}={text!r} holds the tokenizer's special token(s) {', '.join(found)}, which would "
                             "become real control tokens (ending or opening a turn); give plain text (the chat "
                             "template adds the turn markers)")


def shaped_prompt(prompt, suffix: str, response_prefix: str = ""):
    """`suffix` appended to the prompt (chat: its last user message), then `response_prefix` as the start of the
    reply (chat: an assistant message the reply continues, TRL's convention; a string prompt: appended)."""
    if isinstance(prompt, str):
        return prompt + suffix + response_prefix
    if suffix:
        last = max(i for i, m in enumerate(prompt) if m["role"] == "user") if any(
            m["role"] == "user" for m in prompt) else len(prompt) - 1
        prompt = [{**m, "content": m["content"] + suffix} if i == last else m for i, m in enumerate(prompt)]
    if response_prefix:
        if reply_prefix(prompt) is not None:
            raise InputError(f"response_prefix={response_prefix!r}: a prompt already ends with an assistant message "
                             "(its reply continues that message); leave response_prefix out for such data")
        prompt = [*prompt, {"role": "assistant", "content": response_prefix}]
    return prompt


class Source(Protocol):
    """What the loop uses of a data source (TaskSource, RowSource)."""

    description: str        # one line for the start of a run
    fingerprint: str        # a checkpoint is resumed only on the same data
    eval_examples: list[Example]
    eval_too_long: int

    def train_examples(self, start: int, count: int) -> tuple[list[Example], int, int]: ...

    def builtin_rewards(self, answer_key: str = "answer") -> dict[str, Callable]: ...


class _Stream:
    """The parts both sources share: rendering with the length limit, and the evaluation examples."""

    def __init__(self, tokenizer, max_prompt_tokens: int | None):
        self.tokenizer, self.max_prompt_tokens = tokenizer, max_prompt_tokens

    def _example(self, row: dict) -> Example | None:
        ids = prompt_ids(self.tokenizer, row["prompt"])
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            return None
        return Example(row, ids)

    def _eval(self, rows: list[dict]) -> None:
        made = [self._example(r) for r in rows]
        self.eval_examples = [e for e in made if e is not None]
        self.eval_too_long = len(made) - len(self.eval_examples)
        if rows and not self.eval_examples:   # no rows at all: eval_size=0, no evaluation
            raise InputError(f"every one of the {len(rows)} held-out prompts is longer than max_prompt_tokens="
                             f"{self.max_prompt_tokens}; raise max_prompt_tokens")


def check_task(name: str, options: dict) -> None:
    """A reasoning-gym task and its task_config, checked against the task's own config class (its fields, then its
    validate()) without generating a problem: what `hetrl train` and `hetrl validate` say before the model loads."""
    import dataclasses

    import reasoning_gym

    known = reasoning_gym.factory.DATASETS
    if name not in known:
        raise InputError(f"unknown task {name!r}; reasoning-gym has: {', '.join(sorted(known))}")
    config_cls = known[name][1]
    fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
    unknown = [k for k in options if k not in fields]
    if unknown:
        raise unknown_keys_error(unknown, fields, f"task_config for {name!r}", "option")
    try:
        config = config_cls(**options)
        if hasattr(config, "validate"):
            config.validate()
    except (TypeError, ValueError, AssertionError) as e:
        raise InputError(f"bad task_config for {name!r}: {e}") from None


class TaskSource(_Stream):
    """A reasoning-gym generator: problems {question, answer, metadata} as chat prompts."""

    def __init__(self, name: str, options: dict, seed: int, eval_size: int, tokenizer,
                 max_prompt_tokens: int | None = None, prompt_suffix: str = "", response_prefix: str = ""):
        import reasoning_gym

        super().__init__(tokenizer, max_prompt_tokens)
        check_task(name, options)
        self.name, self.options, self.seed, self.prompt_suffix = name, dict(options), seed, prompt_suffix
        self.response_prefix = response_prefix
        try:
            evals = reasoning_gym.create_dataset(name, size=eval_size, seed=seed + 1_000_003, **self.options) \
                if eval_size else []
            self._train_size = 1_000_000
            self._train = reasoning_gym.create_dataset(name, size=self._train_size, seed=seed, **self.options)
        except TypeError as e:
            raise InputError(f"bad task_config for {name!r}: {e}") from None
        rows = [self._row(evals[i]) for i in range(eval_size)]
        self._eval_questions = {r["question"] for r in rows}
        self._eval(rows)
        self.description = f"reasoning-gym {name}"
        self.fingerprint = hashlib.sha256(json.dumps(
            ["reasoning-gym", name, self.options, seed, eval_size, prompt_suffix]
            + ([response_prefix] if response_prefix else []), sort_keys=True,
            default=str).encode()).hexdigest()

    def _row(self, problem: dict) -> dict:
        prompt = shaped_prompt([{"role": "user", "content": problem["question"]}], self.prompt_suffix,
                              self.response_prefix)
        return {"prompt": prompt, "question": problem["question"], "answer": problem["answer"],
                "metadata": problem.get("metadata", {})}

    def train_examples(self, start: int, count: int) -> tuple[list[Example], int, int]:
        """`count` training examples from stream index `start` -> (examples, next index, prompts too long)."""
        out, k, too_long = [], start, 0
        while len(out) < count:
            if k >= self._train_size:
                raise InputError(f"task {self.name!r} ran out of distinct training problems after {k}")
            problem = self._train[k]
            k += 1
            if problem["question"] in self._eval_questions:
                continue
            example = self._example(self._row(problem))
            if example is None:
                too_long += 1
                if too_long >= 10_000 and not out:
                    raise InputError(f"task {self.name!r}: 10,000 prompts in a row are longer than "
                                     f"max_prompt_tokens={self.max_prompt_tokens}; raise it")
                continue
            out.append(example)
        return out, k, too_long

    def builtin_rewards(self, answer_key: str = "answer") -> dict[str, Callable]:
        """The generic checks plus the task's own verifier (`verifier`: correct or not; `partial`: its graded
        score in [0, 1])."""
        score_answer = self._train.score_answer

        def graded(completions, question, answer, metadata, **_):
            return [float(score_answer(extract_answer(completion_text(c)), {"question": q, "answer": a,
                                                                            "metadata": m}))
                    for c, q, a, m in zip(completions, question, answer, metadata)]

        def verifier(completions, question, answer, metadata, **kwargs):
            return [float(g >= 1.0) for g in graded(completions, question, answer, metadata)]

        def partial(completions, question, answer, metadata, **kwargs):
            return graded(completions, question, answer, metadata)

        return {"verifier": builtin("verifier", verifier, True), "partial": builtin("partial", partial, True),
                **builtin_rewards(answer_key)}


def load_rows(path: str, what: str = "data", label: str | None = None) -> list[dict]:
    """Rows of a JSONL / JSON / CSV file (hetrl.data.checks: values as written, bounded lines, strict UTF-8), or
    of a Parquet file or `save_to_disk` directory read with `datasets` (offline, its cache in a temporary directory
    that is removed: nothing is written outside out_dir). `what` is the field the rows are for (eval_data takes a
    DatasetDict's held-out split); `label` how messages name them (default `what=path`: a DatasetDict's split read
    for evaluation out of data= is named as the user gave it, data=DIR)."""
    name = label or f"{what}={path}"
    p = pathlib.Path(path)
    if p.is_file() and p.suffix.lower() in READERS:
        rows = READERS[p.suffix.lower()](p, what)
        if not rows:
            raise InputError(f"{name}: holds no rows")
        return rows
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    p = pathlib.Path(path)
    if not p.exists():
        raise InputError(f"{name}: no such file or directory")
    progress = datasets.utils.logging.is_progress_bar_enabled()
    datasets.utils.logging.disable_progress_bar()
    verbosity = datasets.utils.logging.get_verbosity()
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)   # its own error lines: ours says it once
    try:
        if p.is_dir():
            try:
                ds = datasets.load_from_disk(str(p), keep_in_memory=True)
            except (FileNotFoundError, ValueError) as e:
                raise InputError(f"{name}: not a directory written by datasets' save_to_disk "
                                 f"({str(e).splitlines()[0]})") from None
            if isinstance(ds, datasets.DatasetDict):   # held-out rows from its split for evaluation, if it has one
                want = (*EVAL_SPLITS, "train") if what == "eval_data" else ("train",)
                split = next((s for s in want if s in ds), None)
                if split is None:
                    raise InputError(f"{name}: a DatasetDict without a {' or '.join(map(repr, want))} split "
                                     f"(splits: {', '.join(ds)}); save the split you want with save_to_disk")
                ds = ds[split]
        else:
            kind = DATA_SUFFIXES.get(p.suffix.lower())
            if kind is None:
                raise InputError(f"{name}: unknown file type {p.suffix!r}; give .jsonl, .json, .parquet, "
                                 ".csv or a datasets save_to_disk directory")
            with tempfile.TemporaryDirectory(prefix="hetrl-datasets-") as cache:
                try:
                    ds = datasets.load_dataset(kind, data_files=str(p), split="train", cache_dir=cache,
                                               keep_in_memory=True)
                except Exception as e:   # datasets raises many types for a malformed file; say which file
                    cause = e.__cause__ or e
                    raise InputError(f"{name}: cannot be read as {p.suffix} ({type(cause).__name__}: "
                                     f"{str(cause).splitlines()[0] if str(cause) else ''})") from None
        rows = ds.to_list()
    finally:
        datasets.utils.logging.set_verbosity(verbosity)
        if progress:
            datasets.utils.logging.enable_progress_bar()
    if not rows:
        raise InputError(f"{name}: holds no rows")
    return rows


def as_rows(data, what: str, label: str | None = None) -> list[dict]:
    """A path, a `datasets.Dataset` or a list of dicts -> a list of dicts (`label`: load_rows')."""
    if isinstance(data, (str, os.PathLike)):
        return load_rows(str(data), what, label)
    if hasattr(data, "to_list") and hasattr(data, "column_names"):
        rows = data.to_list()
    elif isinstance(data, (list, tuple)):
        rows = list(data)
    else:
        raise InputError(f"{what}: expected a path, a datasets.Dataset or a list of dicts, got {type(data).__name__}")
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
    if bad is not None:
        raise InputError(f"{what}: row {bad} is a {type(rows[bad]).__name__}, not a dict of columns")
    if not rows:
        raise InputError(f"{what}: holds no rows")
    return rows


def read_checked(data, what: str, prompt_key: str, label: str | None = None) -> list[dict]:
    """as_rows, then every row's prompt checked (present, text or chat, not empty), naming the file (as `label`
    says, for a path) and rows. The loop calls it before the model loads and hands the rows on, so they are read
    once."""
    path = isinstance(data, (str, os.PathLike))
    rows = as_rows(data, what, label if path else None)
    check_prompts(rows, prompt_key, (label or f"{what}={data}") if path else what)
    return rows


EVAL_SPLITS = ("test", "validation")   # a saved DatasetDict's held-out split, the first it has


def dataset_dict_splits(path) -> list[str]:
    """The splits of the DatasetDict that datasets' save_to_disk wrote at `path` ([] for anything else)."""
    try:
        splits = json.loads((pathlib.Path(path) / "dataset_dict.json").read_text()).get("splits")
    except (OSError, ValueError, AttributeError):
        return []
    return [s for s in splits if isinstance(s, str)] if isinstance(splits, list) else []


def held_out_data(data, eval_data, eval_size: int = 1):
    """Where a run's held-out rows come from: `eval_data` when given; else, where `data` is a saved DatasetDict with
    a test (else validation) split, that split (the same directory, read as eval_data, takes it; training reads its
    train split) unless eval_size is 0 (no evaluation); else None (eval_size rows drawn out of the data). One rule
    for hetrl train and hetrl validate."""
    if eval_data is not None or not isinstance(data, (str, os.PathLike)) or eval_size == 0:
        return eval_data
    return data if any(s in dataset_dict_splits(data) for s in EVAL_SPLITS) else None


def held_out_label(data, eval_data) -> str:
    """How a run's description names its held-out rows when they are not drawn out of the data."""
    if eval_data is None and held_out_data(data, None) is not None:
        split = next(s for s in EVAL_SPLITS if s in dataset_dict_splits(data))
        return f"the DatasetDict's {split} split; eval_data=PATH for others"
    return "eval_data"


def input_problems(cfg, rewards: list, train_dataset=None, eval_dataset=None) -> tuple[list[str], dict]:
    """Every problem in a run's data and reward code found before the model loads, all of them together: the task
    and its task_config; each file (or dataset passed from Python) read and its prompts checked; held out from the
    data itself, enough rows left to train on; each reward function imported and its signature checked; the
    columns the rewards read, in every row. One check for `hetrl train` (run.up_front raises them) and
    `hetrl validate` (which adds the tools'). `cfg`: a RunConfig; `rewards`: the run's reward specs or callables
    (a field holding PYTHON, data passed from Python and not given again, is not read). -> (problems, the rows
    read by field: "data", "eval_data", where read, so the run reads them once)."""
    from .rewards import columns_problems, load_rewards

    problems: list[str] = []

    def attempt(check, *args):
        try:
            return check(*args)
        except InputError as e:
            problems.append(str(e))
            return None

    if cfg.data is None:
        attempt(check_task, cfg.task, cfg.task_config)
    loaded = [attempt(load_rewards, [spec]) for spec in rewards]
    held_out = held_out_data(cfg.data, cfg.eval_data, cfg.eval_size)
    given = {"data": train_dataset if train_dataset is not None else cfg.data,
             "eval_data": eval_dataset if eval_dataset is not None else held_out}
    where = {"data": "the train_dataset" if train_dataset is not None else f"data={cfg.data}",
             "eval_data": "the eval_dataset" if eval_dataset is not None else
             f"eval_data={held_out}" if cfg.eval_data is not None else f"data={cfg.data} (its held-out split)"}
    rows = {}
    for key, value in given.items():
        if value is None or (isinstance(value, str) and value == PYTHON):
            continue
        try:   # data's own held-out split is named as the user gave it (data=DIR, not eval_data=)
            rows[key] = read_checked(value, key, cfg.prompt_key, where[key])
        except InputError as e:
            problems.append(str(e))
    if "data" in rows and given["eval_data"] is None:   # held out from the data: some must be left to train on
        attempt(check_eval_size, len(rows["data"]), cfg.eval_size)
    funcs = [f for fs in loaded if fs is not None for f in fs]   # those that loaded: what else is wrong is said too
    if funcs:   # the columns the rewards need (held-out rows are scored by them too)
        for key, got in rows.items():
            problems += columns_problems(funcs, got, cfg.answer_key, where[key])
    return problems, rows


def check_eval_size(rows: int, eval_size: int) -> None:
    """Held out from the data itself (no eval_data), eval_size rows must leave some to train on: checked by hetrl
    train and hetrl validate before the model loads, and by the source that splits them."""
    if eval_size >= rows:
        raise InputError(f"data has {rows} rows, and eval_size={eval_size} would hold out all of them; "
                         f"lower eval_size (e.g. {max(1, rows // 5)}) or give eval_data=PATH")


def _fingerprint(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


class RowSource(_Stream):
    """A user's rows: `data` (and optionally `eval_data`) with the prompt in column `prompt_key`."""

    def __init__(self, data, eval_data, *, eval_size: int, seed: int, tokenizer, prompt_key: str = "prompt",
                 max_prompt_tokens: int | None = None, prompt_suffix: str = "", name: str | None = None,
                 response_prefix: str = "", eval_label: str = "eval_data"):
        super().__init__(tokenizer, max_prompt_tokens)
        rows = read_checked(data, "data", prompt_key)
        rows = [self._normalise(r, i, prompt_key, "data", prompt_suffix, response_prefix) for i, r in enumerate(rows)]
        self.seed = seed
        if eval_data is not None:
            evals = [self._normalise(r, i, prompt_key, "eval_data", prompt_suffix, response_prefix)
                     for i, r in enumerate(read_checked(eval_data, "eval_data", prompt_key))]
            split = eval_label
        else:
            check_eval_size(len(rows), eval_size)
            order = list(range(len(rows)))
            random.Random(seed + 1_000_003).shuffle(order)
            held = set(order[:eval_size])
            evals = [rows[i] for i in sorted(held)]
            rows = [r for i, r in enumerate(rows) if i not in held]
            split = f"eval_size={eval_size} rows drawn by seed" if eval_size else "eval_size=0: no evaluation"
        held_prompts = {json.dumps(r["prompt"], sort_keys=True) for r in evals}
        self.train_rows = [r for r in rows if json.dumps(r["prompt"], sort_keys=True) not in held_prompts]
        self.dropped_as_eval = len(rows) - len(self.train_rows)
        if not self.train_rows:
            raise InputError(f"data: no training rows left after holding out the evaluation rows ({split}); every "
                             "training prompt also appears among them")
        self._eval(evals)
        self._order: tuple[int, list[int]] | None = None
        n = len(self.train_rows)
        self.description = (f"{name or 'data'}: {n} training rows, {len(self.eval_examples)} held out ({split})"
                            + (f", {self.dropped_as_eval} training rows dropped as copies of held-out prompts"
                               if self.dropped_as_eval else "")
                            + (f", {self.eval_too_long} held-out prompts longer than max_prompt_tokens dropped"
                               if self.eval_too_long else ""))
        self.fingerprint = _fingerprint(self.train_rows, evals, prompt_key, prompt_suffix)

    @staticmethod
    def _normalise(row: dict, i: int, prompt_key: str, what: str, suffix: str, response_prefix: str = "") -> dict:
        if prompt_key not in row:
            raise InputError(f"{what}: row {i} has no prompt column {prompt_key!r} (columns: "
                             f"{', '.join(map(str, row)) or 'none'}); set prompt_key=COLUMN")
        prompt = row[prompt_key]
        _check_prompt(prompt, f"{what}: row {i}, column {prompt_key!r}")
        return {**row, "prompt": shaped_prompt(prompt, suffix, response_prefix)}

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self.train_rows)))
            random.Random(_fingerprint(self.seed, epoch)).shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def epoch(self, index: int) -> int:
        return index // len(self.train_rows)

    def train_examples(self, start: int, count: int) -> tuple[list[Example], int, int]:
        """`count` training examples from stream index `start` -> (examples, next index, prompts too long).
        Index k is row order[k mod n] of epoch k // n."""
        n = len(self.train_rows)
        out, k, too_long, run = [], start, 0, 0
        while len(out) < count:
            row = self.train_rows[self._epoch_order(k // n)[k % n]]
            k += 1
            example = self._example(row)
            if example is None:
                too_long += 1
                run += 1
                if run >= n:
                    raise InputError(f"data: every training prompt is longer than max_prompt_tokens="
                                     f"{self.max_prompt_tokens}; raise max_prompt_tokens")
                continue
            run = 0
            out.append(example)
        return out, k, too_long

    def builtin_rewards(self, answer_key: str = "answer") -> dict[str, Callable]:
        return builtin_rewards(answer_key)

