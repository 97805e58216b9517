#!/usr/bin/env bash
# What a lent GPU's time goes to (../shared/GPU.md, docs/gpu.md). The prepared call is `all`: every stage below in
# turn, each cut at its own budget (keeping the rows it finished), about 8 minutes in all, at most 8 files under
# $OUT and a summary printed last:
#
#   a checks  nvidia-smi, torch/transformers versions, the copy-bandwidth and bf16-matmul ceilings, `pytest -m gpu`
#   b train   python -m benchmarks.train_split --device cuda: `hetrl train` per phase (seconds, MFU) on random-weight
#             models of real shapes (config:qwen2.5-1.5b, config:qwen2.5-0.5b), bf16
#   c paper   `hetrl bench dualkv --layer paper`: the DualKV paper's Table 2 cell P x mb = 8Kx8, then 16Kx8
#   d ops     python -m hetrl.bench.operators: GEMM, attention (decode, prefill), MoE layer and copy tables for the cost model
#
# Single stages (checks, train, paper, qwen3, ops) run alone, with the whole call's budget each.
# Before the call, here: `bash scripts/gpu_wheels.sh` (writes the git-ignored .whl/). The call:
#   device run, carry [".whl"], timeout_s 580, command "bash scripts/gpu_session.sh all"
# Then land what came back (python -m benchmarks.gpu_land FILES_AT --command ...: a folder of its own under
# benchmarks/results/gpu/) and commit it. The CPU smoke run (tests/test_gpu_call.py):
# `OUT=/tmp/o GPU_SESSION_DEVICE=cpu bash scripts/gpu_session.sh all` (tiny sizes, a minute).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:?usage: gpu_session.sh all|checks|train|paper|qwen3|ops}
OUT=${OUT:-/tmp/gpu_out}
DEVICE=${GPU_SESSION_DEVICE:-cuda}
BUDGET=${GPU_SESSION_SECONDS:-540}      # a single stage's own limit, inside the call's 600 s
mkdir -p "$OUT"
if [ "$DEVICE" != cpu ] && [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/wheels.log" 2>&1 || { echo "installing .whl failed: see wheels.log"; tail -5 "$OUT/wheels.log"; }
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}   # the smoke test's own entries kept (what the device lacks)
fi
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
PY=python3

layer() {   # layer NAME: the layer benchmark, the paper's cells first, cut at the stage's budget; then its table
  local name=$1 rows="$OUT/dualkv_layer_$1_${DEVICE}.jsonl" cases=(8Kx8 16Kx8 32Kx4 8Kx32 5Kx4 5Kx8 5Kx16 5Kx32
    8Kx4 8Kx16 16Kx4 16Kx16 16Kx32 32Kx8 32Kx16 32Kx32) layer=$1 repeats=5
  [ -n "${LAYER_CASES:-}" ] && read -r -a cases <<< "$LAYER_CASES"
  if [ "$DEVICE" = cpu ]; then cases=(128x4 64x2); layer=tiny; repeats=1; rows="$OUT/dualkv_layer_tiny_cpu.jsonl"; fi
  [ "$name" = qwen3-8b ] && repeats=3
  rm -f "$rows"
  timeout "$BUDGET" $PY -m hetrl bench dualkv --layer "$layer" --device "$DEVICE" --checkpointing --repeats $repeats \
    --cases "${cases[@]}" --out "$OUT" > "$OUT/layer_$name.log" 2>&1
  echo "layer $name: exit $? (124: cut at ${BUDGET} s; the rows finished are kept)"
  $PY - "$rows" "$repeats" "$OUT" <<'EOF'
import sys
from hetrl.bench import dualkv_layer
res = dualkv_layer.from_rows(sys.argv[1], repeats=int(sys.argv[2]))
dualkv_layer.write(res, sys.argv[3])
print(dualkv_layer.markdown(res))
EOF
}

checks() {
    { nvidia-smi 2>/dev/null || echo "no nvidia-smi ($DEVICE smoke run)"; $PY -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, 'triton', triton.__version__)"; } > "$OUT/machine.txt" 2>&1
    [ "$DEVICE" = cpu ] || $PY - > "$OUT/ceilings.txt" 2>&1 <<'EOF'
import torch
dev = torch.device("cuda")
print(torch.cuda.get_device_name(dev))
def timed(fn, n=20):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / 1e3 / n
a = torch.randn(1 << 28, device=dev)            # 1 GiB fp32, random (not zeros)
b = torch.empty_like(a)
t = timed(lambda: b.copy_(a))
print(f"device-to-device copy: {2 * a.numel() * 4 / t / 1e12:.2f} TB/s (bytes read + written)")
x, y = (torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16) for _ in range(2))
t = timed(lambda: x @ y)
print(f"bf16 8192^3 matmul: {2 * 8192**3 / t / 1e12:.0f} TFLOP/s")
EOF
    timeout "$BUDGET" $PY -m pytest -m gpu -q -p no:cacheprovider tests > "$OUT/pytest_gpu.log" 2>&1
    echo "pytest -m gpu: exit $? (5 on a CPU: no GPU test runs there)"
    [ -f "$OUT/ceilings.txt" ] && cat "$OUT/ceilings.txt" >> "$OUT/machine.txt"
    tail -3 "$OUT/machine.txt"; tail -5 "$OUT/pytest_gpu.log"
}

train() {
  local models=(config:qwen2.5-1.5b config:qwen2.5-0.5b) steps=4
  if [ "$DEVICE" = cpu ]; then models=(tiny); steps=3; fi   # 3: the last one profiled
  timeout "$BUDGET" $PY -m benchmarks.train_split --device "$DEVICE" --models "${models[@]}" --steps $steps \
    --out "$OUT" --work /tmp/split_runs_$$ > "$OUT/train_split.log" 2>&1
  echo "train_split: exit $? (124: cut at ${BUDGET} s; the models finished are kept)"; tail -8 "$OUT/train_split.log"
}

ops() {
  local quick=()
  [ "$DEVICE" = cpu ] && quick=(--quick --models qwen3-4b)
  timeout $((BUDGET + 30)) $PY -m hetrl.bench.operators --device "$DEVICE" --out "$OUT" --budget-s "$BUDGET" \
    "${quick[@]}" > "$OUT/operators.log" 2>&1
  echo "operators: exit $?"; tail -2 "$OUT/operators.log"
}

all() {   # the prepared call: a-d with their budgets (seconds), then at most 8 files: the tables, the rest tarred
  local t0=$SECONDS
  BUDGET=${A_S:-110} checks
  BUDGET=${B_S:-200} train
  BUDGET=${C_S:-110} LAYER_CASES="8Kx8 16Kx8" layer paper
  BUDGET=${D_S:-60} ops
  ( cd "$OUT" && tar czf logs.tgz --exclude logs.tgz --exclude 'train_split_*.json' --exclude 'dualkv_layer_*.json' \
      --exclude 'operators_*.csv' --exclude 'operators_*.json' --exclude machine.txt --exclude summary.txt \
      --remove-files -- * 2>/dev/null )
  {
    echo "gpu_session all: $((SECONDS - t0)) s on $DEVICE"; tail -1 "$OUT/machine.txt" 2>/dev/null
    ls -la "$OUT"
  } > "$OUT/summary.txt"
  cat "$OUT/summary.txt"
}

case "$STAGE" in
  all) all ;;
  checks) checks ;;
  train) train ;;
  paper) layer paper ;;
  qwen3) layer qwen3-8b ;;
  ops) ops ;;
  *) echo "unknown stage $STAGE: all | checks | train | paper | qwen3 | ops" >&2; exit 2 ;;
esac
