"""Writing inside a run's out_dir without ever writing outside it, and without half-written files.

Every file is written under a fresh temporary name created exclusively (O_EXCL: an existing file or a
symlink planted at that name is never opened) and renamed into place; `os.replace` replaces a symlink at
the destination instead of following it. Appends (metrics.jsonl) refuse to follow a symlink (O_NOFOLLOW).
Sub-directories of out_dir that hetrl writes into must be real directories, not links elsewhere.
"""

from __future__ import annotations

import os
import pathlib
import tempfile

from hetrl.fsmode import as_open_would
from hetrl.schema import InputError


def prepare_out_dir(run_dir: pathlib.Path) -> None:
    """Create out_dir and prove it writable now, before a model is loaded or anything evaluated."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise InputError(f"out_dir {run_dir} exists and is not a directory; choose another out_dir") from None
    except OSError as e:
        raise InputError(f"out_dir {run_dir} cannot be created ({e.strerror}); choose another out_dir") from None
    try:
        fd, probe = tempfile.mkstemp(dir=run_dir, prefix=".hetrl-write-test.")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise InputError(f"out_dir {run_dir} is not writable ({e.strerror}); choose another out_dir or fix its "
                         "permissions") from None


def real_subdir(parent: pathlib.Path, name: str) -> pathlib.Path:
    """`parent/name` as a real directory (created if missing); a symlink there is refused, since writing
    through it would write outside out_dir."""
    path = parent / name
    if path.is_symlink():
        raise InputError(f"{path} is a symbolic link; hetrl writes only inside out_dir. Remove the link "
                         "(or point out_dir itself at the storage you want)")
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_bytes(path: pathlib.Path, data: bytes) -> None:
    """Write `path` atomically: a fresh exclusive temporary file beside it, flushed, then renamed over it."""
    path = pathlib.Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        as_open_would(tmp)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def write_text(path: pathlib.Path, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def temp_path(path: pathlib.Path, suffix: str) -> pathlib.Path:
    """A fresh, exclusively created (empty) file beside `path` for a writer that takes a file name
    (matplotlib); rename it over `path` when done."""
    fd, tmp = tempfile.mkstemp(dir=pathlib.Path(path).parent, prefix=f".{pathlib.Path(path).name}.", suffix=suffix)
    os.close(fd)
    as_open_would(tmp)
    return pathlib.Path(tmp)


def append_line(path: pathlib.Path, line: str) -> None:
    """Append one line and fsync it; a symlink at `path` is refused rather than followed."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError:
        if os.path.islink(path):
            raise InputError(f"{path} is a symbolic link; hetrl writes only inside out_dir. Remove the link") from None
        raise
    with os.fdopen(fd, "a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
