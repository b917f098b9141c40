#!/usr/bin/env bash
# The hybrid on the GPUs of one host (placement=devices, docs/design.md 4.7): R = GPUs / 2 replicas of
# the 2-stage DSP pipeline, Smart GG against All-Reduce across replicas, homogeneous and one GPU 5x
# slower (padded ticks), each run beside the simulator fed with its measured costs
# (benchmarks/hybrid_devices.py). Prepared for a lent device machine; about 6 minutes on 4-8 GPUs.
# Writes $OUT (default gpu_hybrid_out/). Under 4 GPUs there is no R x K >= 2 x 2 grid: it says so.
set -uo pipefail
OUT=${OUT:-gpu_hybrid_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total --format=csv; python3 --version
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } > "$OUT/env.txt" 2>&1
N=$(python3 -c "import jax; print(jax.local_device_count())" 2>/dev/null || echo 0)
if [ "$N" -lt 4 ]; then
  echo "$N GPU(s): the hybrid on devices needs R x K >= 2 x 2 GPUs; nothing run" | tee "$OUT/skipped.txt"
  exit 0
fi
(time timeout 540 python3 -m benchmarks.hybrid_devices --replicas=$((N / 2)) --stages=2 --pad_s=0.02 \
  --seeds=0,1 --workdir="$OUT/runs" --json_out="$OUT/hybrid_devices.json") > "$OUT/hybrid.log" 2>&1
echo "rc=$?" >> "$OUT/hybrid.log"
tail -n 12 "$OUT/hybrid.log"
