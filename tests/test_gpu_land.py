"""benchmarks.gpu_land: a lent GPU's files land in a folder of their own (GPU and day), a second call beside the
first without overwriting it, the logs unpacked."""

import io
import json
import tarfile

import pytest

from benchmarks import gpu_land
from benchmarks.studies import gpu_vs_cost_model as study


def _call(path, device="NVIDIA H200", date="2026-12-09 05:10 UTC", logs=("pytest_gpu.log", "hetrl-measured_H200.csv")):
    path.mkdir()
    smi = (study.FIRST / "machine.txt").read_text().replace("NVIDIA H100 80GB HBM3", device)
    (path / "machine.txt").write_text(smi)
    split = json.loads((study.FIRST / "train_split_cuda.json").read_text())
    (path / "train_split_cuda.json").write_text(json.dumps(split | {"device_name": device, "date": date}))
    (path / "operators_cuda.csv").write_text((study.FIRST / "operators_cuda.csv").read_text())
    (path / "summary.txt").write_text("gpu_session all: 301 s on cuda\n")
    with tarfile.open(path / "logs.tgz", "w:gz") as tar:
        for name in logs:
            data = f"{name} of {path.name}\n".encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_a_call_lands_in_its_own_folder_and_a_second_beside_it(tmp_path):
    root = tmp_path / "gpu"
    first = gpu_land.land(_call(tmp_path / "a"), "bash scripts/gpu_session.sh all", 580, root=root)
    assert first == root / "h200-2026-12-09"
    got = sorted(p.relative_to(first).as_posix() for p in first.rglob("*") if p.is_file())
    assert got == ["call.txt", "logs/hetrl-measured_H200.csv", "logs/pytest_gpu.log", "machine.txt",
                   "operators_cuda.csv", "summary.txt", "train_split_cuda.json"]
    assert (first / "logs" / "pytest_gpu.log").read_text() == "pytest_gpu.log of a\n"
    second = gpu_land.land(_call(tmp_path / "b"), "bash scripts/gpu_session.sh ops", root=root)
    assert second == first
    assert (first / "logs" / "pytest_gpu.log").read_text() == "pytest_gpu.log of a\n"       # kept
    assert (first / "logs" / "pytest_gpu_call2.log").read_text() == "pytest_gpu.log of b\n"
    assert (first / "machine_call2.txt").is_file() and (first / "train_split_cuda_call2.json").is_file()
    call = (first / "call.txt").read_text()
    assert call.count("command: ") == 2 and "timeout_s: 580" in call and "301 s on cuda" in call
    other = gpu_land.land(_call(tmp_path / "c", device="NVIDIA H100 80GB HBM3", date="2026-12-10 01:00 UTC"),
                          "x", root=root)
    assert other.name == "h100-2026-12-10"
    study.main(["--dir", str(first)])        # the study reads a landed folder as it is
    assert (first / "cost_model.md").read_text().startswith("# The cost model beside a lent GPU (NVIDIA H200,")


def test_what_is_not_a_gpu_call_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="not a folder"):
        gpu_land.land(tmp_path / "nothing", "x", root=tmp_path / "gpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no machine.txt"):
        gpu_land.land(tmp_path / "empty", "x", root=tmp_path / "gpu")
    (tmp_path / "empty" / "machine.txt").write_text("no nvidia-smi (cpu smoke run)\ntorch 2.13.0\n")
    with pytest.raises(SystemExit, match="names no catalog GPU"):
        gpu_land.land(tmp_path / "empty", "x", root=tmp_path / "gpu")
    assert not (tmp_path / "gpu").exists()
