"""XLA:CPU inside control flow: a convolution's forward, input gradient and weight gradient, and a
dense layer's vjp, at the top level of a jitted function, inside lax.cond, and 4 of them in a lax.scan
(rolled and unrolled). Medians of 5 calls after a warm one, in ms (docs/design.md 5.3).

  python -m benchmarks.bench_control_flow --json_out=results/pipeline_spmd/control_flow.json
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.timing import print_json

_JSON = flags.DEFINE_string("json_out", "", "Where the JSON goes.")


def _ms(f, *args) -> float:
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(5):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(times))


def _cases():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(64, 32, 32, 16)).astype(np.float32))
  w = jnp.asarray(0.01 * rng.normal(size=(3, 3, 16, 16)).astype(np.float32))
  r = jnp.asarray(rng.normal(size=(64, 32, 32, 16)).astype(np.float32))
  conv = lambda x, w: jax.lax.conv_general_dilated(
    x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
  xd = jnp.asarray(rng.normal(size=(64, 2048)).astype(np.float32))
  wd = jnp.asarray(0.01 * rng.normal(size=(2048, 2048)).astype(np.float32))
  rd = jnp.asarray(rng.normal(size=(64, 2048)).astype(np.float32))
  dense = lambda x, w: jnp.tanh(x @ w)
  return {  # name: (one op as a function of the carry, the carry, the other operands)
    "conv_forward": (lambda c, w, r: conv(c, w), x, (w, r)),
    "conv_input_grad": (lambda c, w, r: jax.vjp(lambda x: conv(x, w), c)[1](r)[0], x, (w, r)),
    "conv_weight_grad": (lambda c, x, r: jax.vjp(lambda w: conv(x, w), c)[1](r)[0], w, (x, r)),
    "dense_weight_grad": (lambda c, x, r: jax.vjp(lambda w: dense(x, w), c)[1](r)[0], wd, (xd, rd)),
  }


def main(argv):
  del argv
  out = {}
  for name, (op, c, rest) in _cases().items():
    top = jax.jit(op)
    cond = jax.jit(lambda c, *a, op=op: jax.lax.cond(c.sum() < 1e30, lambda c: op(c, *a), lambda c: c, c))
    scan = lambda unroll, op=op: jax.jit(
      lambda c, *a: jax.lax.scan(lambda c, _: (c + 1e-3 * op(c, *a), None), c, jnp.arange(4), unroll=unroll)[
        0
      ]
    )
    out[name] = {
      "top_level_ms": _ms(top, c, *rest),
      "in_cond_ms": _ms(cond, c, *rest),
      "scan_of_4_ms": _ms(scan(1), c, *rest),
      "scan_of_4_unrolled_ms": _ms(scan(True), c, *rest),
    }
    print(name, {k: round(v, 2) for k, v in out[name].items()}, flush=True)
  out["jax"] = jax.__version__
  print_json(out, _JSON.value)


if __name__ == "__main__":
  app.run(main)
