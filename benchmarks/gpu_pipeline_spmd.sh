#!/usr/bin/env bash
# placement=spmd on the GPUs of one host: every pipeline method as one jitted program over a stage axis
# (pipeline/program.py) against single-GPU BP and data-parallel BP on the same K GPUs, each row a fresh
# process, rows alternated (benchmarks/pipeline_spmd.py). Prepared for a lent device machine; a few
# minutes on 2-8 GPUs. Writes $OUT (default gpu_pipeline_spmd_out/), the figures in the results format.
#   1 GPU: no pipeline to run (a stage needs a device): BP and the data-parallel step on it as a smoke.
#   2-8 GPUs: K = the GPU count, M = 2K micro-batches for gpipe, 1f1b and zbh1, a batch of 64 per GPU
#   through a wide MLP (compute-dominated stages on a GPU: 8192-wide layers, K x 2 of them).
set -uo pipefail
OUT=${OUT:-gpu_pipeline_spmd_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}  # the interpreter with jax (a venv's, or the machine's)
if ! "$PY" -c "import jax, sys; sys.exit(0 if jax.default_backend() == 'gpu' else 1)" 2>/dev/null; then
  echo "gpu_pipeline_spmd: jax has no GPU backend here (install jax[cuda12] of requirements.txt's version)" | tee "$OUT/failed.txt"
  exit 1
fi
{ nvidia-smi --query-gpu=name,memory.total --format=csv; "$PY" --version
  "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"; } > "$OUT/env.txt" 2>&1
K=$("$PY" -c "import jax; print(jax.local_device_count())")
K=$(( K > 8 ? 8 : K ))
WIDTH=${WIDTH:-8192}
if [ "$K" -lt 2 ]; then
  echo "1 GPU: pipelining needs >= 2 (a stage a device); BP and data-parallel BP on it as a smoke" | tee "$OUT/note.txt"
  ROWS=bp,dp_bp; K=1; LAYERS=2
else
  ROWS=bp,dp_bp,dsp,pipedream,pipemare,fr,ddg,gpipe,1f1b,zbh1; LAYERS=$(( 2 * K ))
fi
HIDDEN=$("$PY" -c "print(','.join(['$WIDTH'] * $LAYERS))")
(time timeout 900 "$PY" -m benchmarks.pipeline --placement=spmd --platform=gpu --num_stages="$K" \
  --model=mlp --hidden="$HIDDEN" --input_shape="$WIDTH" --batch=$(( 64 * K )) --microbatches=$(( 2 * K )) \
  --variants="$ROWS" --reps=3 --per_dispatch=16 --dispatches=3 --json_out="$OUT/pipeline_spmd_k$K.json") \
  > "$OUT/pipeline_spmd.log" 2>&1
echo "rc=$?" >> "$OUT/pipeline_spmd.log"
tail -n 16 "$OUT/pipeline_spmd.log"
