#!/usr/bin/env bash
# What a lent GPU's 30 minutes go to (../shared/GPU.md), one device call per stage (each under its 10-minute limit),
# everything written under $OUT (logs, tables, JSON), a short table printed last:
#
#   checks   nvidia-smi, torch/transformers versions, the copy-bandwidth and bf16-matmul ceilings, `pytest -m gpu`
#   paper    `hetrl bench dualkv --layer paper --device cuda --checkpointing`: the DualKV paper's Table 2 cells first
#            (P x mb = 8Kx8, 16Kx8, 32Kx4, 8Kx32), then the rest of the grid while time lasts; the table is built
#            from the rows finished so far even when the stage's time runs out (#20 items 4, 6, 7)
#   qwen3    the same for the real Qwen3-8B layer
#   train    python -m benchmarks.train_split --device cuda: `hetrl train` per phase on config:smollm2-135m and
#            config:qwen2.5-0.5b (random weights) (#20 item 8)
#
# Before the first call, here: `bash scripts/gpu_wheels.sh` (writes the git-ignored .whl/). Each call:
#   device run, carry [".whl"], command "bash scripts/gpu_session.sh STAGE"
# Then copy what came back under benchmarks/results/gpu/ and commit it. Smoke-test here with
# `OUT=/tmp/o GPU_SESSION_DEVICE=cpu bash scripts/gpu_session.sh paper` (tiny layer on CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:?usage: gpu_session.sh checks|paper|qwen3|train}
OUT=${OUT:-/tmp/gpu_out}
DEVICE=${GPU_SESSION_DEVICE:-cuda}
BUDGET=${GPU_SESSION_SECONDS:-540}      # a stage's own limit, inside the call's 600 s
mkdir -p "$OUT"
if [ "$DEVICE" != cpu ] && [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/wheels.log" 2>&1 || { echo "installing .whl failed: see wheels.log"; tail -5 "$OUT/wheels.log"; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
PY=python3

layer() {   # layer NAME: the layer benchmark, the paper's cells first, cut at the stage's budget; then its table
  local name=$1 rows="$OUT/dualkv_layer_$1_${DEVICE}.jsonl" cases=(8Kx8 16Kx8 32Kx4 8Kx32 5Kx4 5Kx8 5Kx16 5Kx32
    8Kx4 8Kx16 16Kx4 16Kx16 16Kx32 32Kx8 32Kx16 32Kx32) layer=$1 repeats=5
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

case "$STAGE" in
  checks)
    { nvidia-smi; $PY -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, 'triton', triton.__version__)"; } > "$OUT/machine.txt" 2>&1
    $PY - > "$OUT/ceilings.txt" 2>&1 <<'EOF'
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
    echo "pytest -m gpu: exit $?"
    cat "$OUT/machine.txt" | tail -2; cat "$OUT/ceilings.txt"; tail -15 "$OUT/pytest_gpu.log"
    ;;
  paper) layer paper ;;
  qwen3) layer qwen3-8b ;;
  train)
    timeout "$BUDGET" $PY -m benchmarks.train_split --device "$DEVICE" --steps 4 --out "$OUT" --work /tmp/split_runs \
      > "$OUT/train_split.log" 2>&1
    echo "train_split: exit $?"; tail -20 "$OUT/train_split.log"
    ;;
  *) echo "unknown stage $STAGE: checks | paper | qwen3 | train" >&2; exit 2 ;;
esac
