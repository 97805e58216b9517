import os

import pytest

# precision=auto means bf16-mixed on a CPU with bf16 instructions and fp32 on one without: the suite pins "without"
# (precision.cpu_has_fast_bf16), so that every test means the same on every machine, Ray actors included (they inherit
# the environment); tests of the bf16 path ask for precision=bf16-mixed or set HETRL_CPU_BF16 themselves.
os.environ["HETRL_CPU_BF16"] = "0"


def pytest_collection_modifyitems(config, items):
    """GPU tests skip themselves on machines without CUDA (they are also deselected by default)."""
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
