#!/usr/bin/env bash
# The SmolLM2 draft recipe on the lent GPU machine (an H200 with PyTorch, no network), run from
# the repository root there after `device_transfer.py pack` here. Each call carries one chunk
# in .dev/ and runs one of:
#   bash build_scripts/gpu_train_draft.sh stage           # a chunk that does not complete the stream
#   bash build_scripts/gpu_train_draft.sh smoke           # GGUF whole: convert, 8 steps on the small corpus, timed
#   bash build_scripts/gpu_train_draft.sh train STEPS     # every chunk there: the run, then its curve
# Results (the draft in fp16 as a split tar, logs, the curve) go to $OUT (the device tool's folder).
set -euo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/stage/site:$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 build_scripts/device_transfer.py unpack --chunks .dev --to /tmp/stage
recipe=(python3 build_scripts/train_smollm2_draft.py --budget "${BUDGET:-gpu}" --device "${DEVICE:-cuda}")  # env: a CPU check
case "$1" in
  stage) ;;
  smoke)
    nvidia-smi --query-gpu=name,memory.total --format=csv || true
    "${recipe[@]}" --steps 8 --corpus-from /tmp/stage/files/smoke-corpus --work /tmp/wsmoke --until curve \
      2>&1 | tee "$OUT/smoke.log"
    cp /tmp/wsmoke/*.json "$OUT/" ;;
  train)
    "${recipe[@]}" --steps "$2" --corpus-from /tmp/stage/files/corpus --work /tmp/wgpu --until train \
      2>&1 | tee "$OUT/train.log"
    [ -f /tmp/wsmoke/target_only_outputs.json ] && cp /tmp/wsmoke/target_only_outputs.json /tmp/wgpu/
    "${recipe[@]}" --steps "$2" --corpus-from /tmp/stage/files/corpus --work /tmp/wgpu --until curve \
      2>&1 | tee "$OUT/curve.log"
    python3 -c "
from pathlib import Path
from dlite_trt.checkpoint import load_draft, save_draft
save_draft(load_draft(Path('/tmp/wgpu/student')).half(), Path('/tmp/draft-fp16'))"
    tar -cf - -C /tmp draft-fp16 | split -b 15M - "$OUT/draft.tar.part-"
    tar -cf "$OUT/results.tar" -C /tmp/wgpu $(cd /tmp/wgpu && ls *.json) ;;
  *) echo "usage: $0 stage|smoke|train STEPS" >&2; exit 2 ;;
esac
