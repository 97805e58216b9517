"""A user's rows read and checked once, up front, before the model loads: every problem names the file, the row
(its line) and the column.

JSONL, JSON and CSV are read here rather than by `datasets`, whose readers coerce a column's type across rows
(a CSV string column "007" became 7), hold a whole over-long line several times over (benchmarks/README.md),
and name no file for a bad encoding or an empty file. Here: UTF-8 strictly, one line at a time with at most
MAX_LINE_BYTES held (a longer line is refused), CSV cells kept as the text written, JSON values as written.
Parquet and `save_to_disk` directories are typed by their writer and still read with `datasets`.
"""

from __future__ import annotations

import csv
import json
import pathlib

from hetrl.schema import InputError, show

MAX_LINE_BYTES = 8 * 2**20    # one JSONL line or CSV record: far beyond any prompt a model can take
MAX_JSON_BYTES = 2 * 2**30    # a whole .json document (JSON lines are read line by line instead)
SHOW = 5                      # rows named in one message


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{where}: byte {e.start + 1} is not UTF-8 ({raw[e.start:e.start + 4]!r}); save the file "
                         "as UTF-8") from None


BOM = b"\xef\xbb\xbf"


def _lines(path: pathlib.Path, what: str):
    """(line number, text) of each line, UTF-8 checked; at most MAX_LINE_BYTES of a line is ever held."""
    with open(path, "rb") as f:
        for n, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n") or len(raw) > MAX_LINE_BYTES + 1:
                raise InputError(f"{what}={path}: line {n} is longer than {MAX_LINE_BYTES // 2**20} MiB "
                                 "(hetrl.data.checks.MAX_LINE_BYTES); a prompt that long cannot be trained on: "
                                 "split or drop that row")
            if n == 1:
                raw = raw.removeprefix(BOM)   # Windows editors' UTF-8 byte-order mark, as utf-8-sig reads it
            yield n, _decode(raw, f"{what}={path}: line {n}")


def read_jsonl(path: pathlib.Path, what: str) -> list[dict]:
    """JSON lines, one object per non-blank line."""
    rows = []
    for n, line in _lines(path, what):
        text = line.strip()
        if not text:
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"{what}={path}: line {n} is not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
            raise InputError(f"{what}={path}: line {n} is a JSON {type(row).__name__}, not an object of columns")
        rows.append(row)
    return rows


def read_json(path: pathlib.Path, what: str) -> list[dict]:
    """A .json file: one array of objects, or JSON lines (as `datasets` reads both)."""
    if path.stat().st_size > MAX_JSON_BYTES:
        raise InputError(f"{what}={path}: a {path.stat().st_size / 2**30:.1f} GiB JSON document; write it as JSON "
                         "lines (.jsonl), which are read a line at a time")
    text = _decode(path.read_bytes().removeprefix(BOM), f"{what}={path}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":     # more than one document: JSON lines
            return read_jsonl(path, what)
        raise InputError(f"{what}={path}: not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise InputError(f"{what}={path}: a JSON {type(data).__name__}; expected an array of row objects")
    bad = next((i for i, r in enumerate(data) if not isinstance(r, dict)), None)
    if bad is not None:
        raise InputError(f"{what}={path}: element {bad} is a JSON {type(data[bad]).__name__}, not an object of "
                         "columns")
    return data


def read_csv(path: pathlib.Path, what: str) -> list[dict]:
    """CSV with a header row; every cell is kept as the text written (no type guessing)."""
    for _ in _lines(path, what):      # the encoding and line lengths first, named by line number
        pass
    with open(path, "rb") as f:
        encoding = "utf-8-sig" if f.read(3) == BOM else "utf-8"
    csv.field_size_limit(MAX_LINE_BYTES)
    rows = []
    try:
        with open(path, encoding=encoding, errors="strict", newline="") as f:
            reader = csv.DictReader(f)
            for row in reader:
                if None in row:
                    raise InputError(f"{what}={path}: line {reader.line_num} has more cells than the header's "
                                     f"{len(reader.fieldnames)} columns")
                missing = [k for k, v in row.items() if v is None]
                if missing:
                    raise InputError(f"{what}={path}: line {reader.line_num} has no cell for column(s) "
                                     f"{', '.join(map(repr, missing))}")
                rows.append(row)
    except csv.Error as e:
        raise InputError(f"{what}={path}: not readable as CSV ({e}; a cell is limited to "
                         f"{MAX_LINE_BYTES // 2**20} MiB)") from None
    return rows


READERS = {".jsonl": read_jsonl, ".json": read_json, ".csv": read_csv}


def empty_prompt(prompt) -> bool:
    """A prompt with nothing in it: blank text, or chat messages whose contents are all blank."""
    if isinstance(prompt, str):
        return not prompt.strip()
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        return all(not str(m.get("content") or "").strip() for m in prompt)
    return False


def check_prompts(rows: list[dict], prompt_key: str, where: str) -> None:
    """Every row has a prompt in `prompt_key` that is text or chat messages and not empty; all bad rows are
    counted and the first few named in one line."""
    missing = [i for i, r in enumerate(rows) if prompt_key not in r]
    if missing:
        cols = ", ".join(map(str, rows[missing[0]])) or "none"
        raise InputError(f"{where}: {_rows(missing)} {'has' if len(missing) == 1 else 'have'} no prompt column "
                         f"{prompt_key!r} (row {missing[0]}'s columns: {cols}); set prompt_key=COLUMN")
    empty = [i for i, r in enumerate(rows) if empty_prompt(r[prompt_key])]
    if empty:
        raise InputError(f"{where}: column {prompt_key!r} is empty in {_rows(empty)}; a blank prompt gives the "
                         "model nothing to answer: fill or drop those rows")
    shape = next((i for i, r in enumerate(rows) if not _prompt_shape(r[prompt_key])), None)
    if shape is not None:
        raise InputError(f"{where}: row {shape}, column {prompt_key!r}: the prompt must be a string or a list of "
                         f"chat messages [{{'role': ..., 'content': ...}}], got {show(rows[shape][prompt_key])}")


def _prompt_shape(prompt) -> bool:
    return isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in prompt))


def _rows(rows: list[int]) -> str:
    text = ", ".join(map(str, rows[:SHOW]))
    return f"row {text}" if len(rows) == 1 else f"rows {text}" + (f" (and {len(rows) - SHOW} more)"
                                                                  if len(rows) > SHOW else "")


__all__ = ["MAX_LINE_BYTES", "READERS", "check_prompts", "empty_prompt", "read_csv", "read_json", "read_jsonl"]
