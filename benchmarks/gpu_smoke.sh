#!/usr/bin/env bash
# One GPU node, one command: the newest-jax smoke (the fast test tier on CPU under the node's jax) and
# the entry points on the GPU. Writes logs to $OUT (default: gpu_smoke_out/). Used for WORKSPACE.md
# section 9; the node had no network, so pure-python packages missing there came as wheels in .whl/.
OUT=${OUT:-gpu_smoke_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
{ nvidia-smi -L; python3 --version
  python3 -c "import jax, flax, optax, orbax.checkpoint as o; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"; } > "$OUT/env.txt" 2>&1
# 1. Newest jax: the fast tier (CPU, 8 forced devices, as in CI).
(time timeout 200 python3 -m pytest -q -m "not slow" -p no:cacheprovider -W ignore -rfE) > "$OUT/pytest_fast.log" 2>&1
echo "rc=$?" >> "$OUT/pytest_fast.log"
# 2. The entry points on the GPU.
run() { name=$1; shift; (time timeout "$@") > "$OUT/gpu_$name.log" 2>&1; echo "rc=$?" >> "$OUT/gpu_$name.log"; }
run spmd 100 python3 -m experiments.train --workdir=/tmp/r/spmd
run sim 80 python3 -m experiments.train --config=configs/default.py:algorithm=ripples_smart,executor=sim,num_workers=16,steps=500 \
  --config.hetero.slow_workers='(3,)' --config.hetero.slowdown=5.0 --workdir=/tmp/r/sim
run dsp 80 python3 -m experiments.train_dsp --config=configs/dsp.py:method=dsp,num_stages=4,epochs=20 --workdir=/tmp/r/dsp
run bench_engine 60 python3 -m benchmarks.bench_engine --cases=cnn1d/mnist1d --reps=10
for d in spmd sim dsp; do echo "== $d"; cat /tmp/r/$d/summary.json; done > "$OUT/summaries.txt" 2>&1
