#!/usr/bin/env bash
# The pipeline on the GPUs of one host (placement=devices, docs/design.md 4.6): K = the GPU count, every
# tick method and GPipe against the best single-GPU BP of the same process, each beside its ceiling, the
# per-stage programs' times and each GPU's peak memory (benchmarks/pipeline_devices.py). Prepared for a
# lent device machine; under 8 minutes on a host of 2-8 GPUs. Writes $OUT (default gpu_pipeline_out/).
# With one GPU there is no pipeline to run: it records the host and says so (a stage needs a device).
set -uo pipefail
OUT=${OUT:-gpu_pipeline_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total --format=csv; python3 --version
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } > "$OUT/env.txt" 2>&1
K=$(python3 -c "import jax; print(jax.local_device_count())" 2>/dev/null || echo 0)
if [ "$K" -lt 2 ]; then
  echo "$K GPU(s): placement=devices needs a GPU per stage and at least 2 stages; nothing run" | tee "$OUT/skipped.txt"
  exit 0
fi
MODEL=${MODEL:-resnet56}  # the deepest CIFAR ResNet here: 29 units, a balanced split up to K=8
SHAPE=${SHAPE:-32,32,3}
run() { name=$1; shift; (time timeout 420 "$@") > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; }
run pipeline python3 -m benchmarks.pipeline --placement=devices --num_stages="$K" --model="$MODEL" \
  --input_shape="$SHAPE" --variants=dsp,pipedream,gpipe --reps=3 --ticks=10 --bp_reps=10 --iterations=40 \
  --json_out="$OUT/pipeline_k$K.json"
tail -n 8 "$OUT/pipeline.log"
