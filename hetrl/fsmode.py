"""Permissions of the files hetrl writes under temporary names and renames into place.

`tempfile.mkstemp` / `mkdtemp` create 0600 files and 0700 folders whatever the umask (they are meant to be
private), so a run's summary.json or checkpoints would be unreadable by a teammate or a dashboard running as
another user while metrics.jsonl, written with open(), is readable. `as_open_would` gives such a file or folder
the mode open() / mkdir() would have given it under the process's umask. Standard library only: the planner,
the trainer and the exporters all use it.
"""

from __future__ import annotations

import os
import threading

_lock = threading.Lock()


def _umask() -> int:
    try:   # Linux says it without changing it
        with open("/proc/self/status") as f:
            return int(next(line.split()[1] for line in f if line.startswith("Umask:")), 8)
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    with _lock:   # elsewhere os.umask can only be read by setting it; put it back at once
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def as_open_would(path, directory: bool = False) -> None:
    """chmod `path` (created by mkstemp / mkdtemp) to what open() (0666) or mkdir() (0777) would have made."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())
