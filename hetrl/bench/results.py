"""Where a benchmark's result goes: NAME.json (every number) and NAME.md (the table a reader opens) in one folder."""

from __future__ import annotations

import json
import os


def write_results(out: str, name: str, res: dict, text: str) -> str:
    """Write `res` to out/NAME.json and `text` to out/NAME.md; -> out/NAME."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path + ".json", "w") as f:
        json.dump(res, f, indent=2)
    with open(path + ".md", "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")
    return path
