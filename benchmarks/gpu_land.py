"""Land what a lent GPU's call brought back (the device tool's `files_at`) in a folder of its own under
benchmarks/results/gpu/, named by the GPU and the day (`h200-2026-12-09`), so no later call overwrites an earlier
one's files (issue 46 item 2; docs/gpu.md; the folders: benchmarks/results/gpu/README.md).

    python -m benchmarks.gpu_land FILES_AT --command "bash scripts/gpu_session.sh all" [--timeout-s 580]

Every file is copied; `logs.tgz` is unpacked into `logs/` (its text files: the pytest log, each stage's log and
table, hetrl-measured_GPU.csv); a file that is already there (a second call the same day into the same folder)
is kept and the new one gets a `_call2` (`_call3`, ...) suffix. `call.txt` records each landed call: the command,
its time limit, the summary the call printed. What to do next is printed (the study to run, where the engine's
operator rows go).

Hand-written: copying files; no library has an opinion on this project's results layout.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import pathlib
import shutil
import tarfile

from hetrl.planner.catalog import device_type

ROOT = pathlib.Path(__file__).resolve().parents[1] / "results" / "gpu"


def gpu_and_day(files: pathlib.Path) -> tuple[str, str]:
    """The catalog type of the GPU a call ran on (machine.txt: nvidia-smi and the device name) and its UTC day
    (stage b's results, else nvidia-smi's clock line, else today)."""
    machine = files / "machine.txt"
    if not machine.is_file():
        raise SystemExit(f"{files}: no machine.txt (is this a gpu_session.sh call's files_at?)")
    lines = machine.read_text(errors="replace").splitlines()
    name = next((t for line in lines if (t := device_type(line.strip(" |")))), None)
    if name is None:
        raise SystemExit(f"{machine}: names no catalog GPU (nvidia-smi said nothing the catalog knows)")
    day = None
    split = files / "train_split_cuda.json"
    if split.is_file():
        try:
            day = str(json.loads(split.read_text()).get("date", "")).split()[0] or None
        except ValueError:
            day = None
    if day is None and lines:
        try:
            day = dt.datetime.strptime(lines[0].strip(), "%a %b %d %H:%M:%S %Y").date().isoformat()
        except ValueError:
            day = None
    return name, day or dt.datetime.now(dt.timezone.utc).date().isoformat()


def _free(path: pathlib.Path) -> pathlib.Path:
    """`path`, or path with _call2, _call3, ... before its suffix where a file is already there."""
    if not path.exists():
        return path
    stem, suffix = (path.name[:-len(".tar.gz")], ".tar.gz") if path.name.endswith(".tar.gz") else \
        (path.stem, path.suffix)
    n = 2
    while (cand := path.with_name(f"{stem}_call{n}{suffix}")).exists():
        n += 1
    return cand


def land(files: pathlib.Path, command: str, timeout_s: int | None = None, root: pathlib.Path = ROOT) -> pathlib.Path:
    """Copy a call's files into root/<gpu>-<day>/ (see the module text) -> that folder."""
    files = pathlib.Path(files)
    if not files.is_dir():
        raise SystemExit(f"{files}: not a folder (give the device tool's files_at)")
    name, day = gpu_and_day(files)
    folder = root / f"{name.lower()}-{day}"
    folder.mkdir(parents=True, exist_ok=True)
    landed = []
    for src in sorted(files.iterdir()):
        if not src.is_file():
            continue
        if src.name == "logs.tgz":
            with tarfile.open(src) as tar:
                for member in tar.getmembers():
                    if not member.isfile() or pathlib.PurePosixPath(member.name).is_absolute() \
                            or ".." in pathlib.PurePosixPath(member.name).parts:
                        continue
                    dest = _free(folder / "logs" / pathlib.PurePosixPath(member.name).name)
                    dest.parent.mkdir(exist_ok=True)
                    with tar.extractfile(member) as f:
                        dest.write_bytes(f.read())
                    landed.append(dest)
            continue
        dest = _free(folder / src.name)
        shutil.copyfile(src, dest)
        landed.append(dest)
    summary = (files / "summary.txt").read_text(errors="replace").strip() if (files / "summary.txt").is_file() else ""
    with open(folder / "call.txt", "a") as f:
        f.write(f"command: {command}\n" + (f"timeout_s: {timeout_s}\n" if timeout_s else "")
                + f"landed: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {len(landed)} files\n"
                + (f"summary:\n{summary}\n" if summary else "") + "\n")
    return folder


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files_at", type=pathlib.Path, help="the folder the device tool's reply names as files_at")
    ap.add_argument("--command", required=True, help="the exact command the call ran")
    ap.add_argument("--timeout-s", type=int, help="the call's timeout_s")
    args = ap.parse_args(argv)
    folder = land(args.files_at, args.command, args.timeout_s)
    rel = folder.relative_to(ROOT.parents[2]) if folder.is_relative_to(ROOT.parents[2]) else folder
    measured = sorted((folder / "logs").glob("hetrl-measured_*.csv")) if (folder / "logs").is_dir() else []
    print(f"landed in {rel}; next (docs/gpu.md):")
    print(f"  python -m benchmarks.studies.gpu_vs_cost_model --dir {rel}   # before the measured table joins")
    for m in measured:
        print(f"  cp {rel}/logs/{m.name} hetrl/planner/data/operators/   # then the planner benchmark, say what moved")
    print(f"  write {rel}/README.md (what was measured, failed, fixed) and a line in benchmarks/results/gpu/README.md")


if __name__ == "__main__":
    main()
