"""PipeMare's backward as published: the forward's activations, the backward's weights.

PipeMare (Yang, Zhang, Li, Re, Aberger, De Sa, "PipeMare: Asynchronous Pipeline Parallel DNN
Training", MLSys 2021) keeps one weight copy per stage. A batch's forward runs at the weights of its
time and keeps its activations, as any pipeline that does not recompute; its backward, S_k updates
later, runs at the weights of *its* time, which PipeMare's discrepancy correction replaces by an
estimate of the forward's, w_bkwd = w - S_k delta. So the gradient is taken with the activations of
the forward (the layer inputs, the nonlinearities' operands) and w_bkwd as every weight operand of
the backward pass: for y = W x, dL/dW = g_y x_fwd^T and dL/dx = W_bkwd^T g_y.

How, for any stage (a flax module): its train-mode forward is traced to a jaxpr (calls inlined) and
every value is classed: W (computed from the parameters alone), A (depends on the input or the model
state: an activation), C (a constant). The forward (`forward`) evaluates it at the forward's weights
and keeps the A values the backward reads. The backward (`backward`) evaluates the W values at
w_bkwd and runs reverse mode over the A equations, each equation's vjp taken at (its W operands at
w_bkwd, its A operands as the forward left them): nothing of the forward is recomputed. An equation
whose vjp needs no primal value (LINEAR) keeps nothing.

Invariants:
- With w_bkwd equal to the forward's weights the gradients are jax.vjp's of the stage (float order
  aside): the decomposition changes where a weight is read, nothing else.
- The kept values are the forward's, so the backward's weights enter only its matrix products, the
  weights' own transformations (reshapes, casts) and any other operation that reads a weight (a
  BatchNorm scale); an opaque call (custom_jvp, custom_vjp) that reads both a weight and an
  activation is differentiated as one operation at (w_bkwd, its activation operands).
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from ripples_jax.models import apply_model

# Equations whose vjp reads no primal value: their operands need not be kept.
LINEAR = frozenset(
  {
    "add",
    "add_any",
    "sub",
    "neg",
    "reshape",
    "broadcast_in_dim",
    "transpose",
    "reduce_sum",
    "convert_element_type",
    "concatenate",
    "slice",
    "pad",
    "squeeze",
    "expand_dims",
    "copy",
    "copy_p",
    "rev",
  }
)
INLINE = frozenset({"pjit", "jit", "closed_call", "core_call"})
W, A, C = "W", "A", "C"


@dataclasses.dataclass(frozen=True)
class Lit:
  value: object


@dataclasses.dataclass
class Eqn:
  prim: object
  params: dict
  ins: tuple  # value keys (int) or Lit
  outs: tuple  # value keys
  ctx: object


@dataclasses.dataclass
class Plan:
  """The stage's forward as a flat list of equations over numbered values, each value classed."""

  eqns: list
  kind: dict  # key -> W, A or C
  aval: dict  # key -> its abstract value
  invars: list  # keys of (params leaves, model state leaves, x)
  outvars: list  # keys of (y, new model state leaves)
  consts: dict  # key -> constant value
  kept: list  # the A keys the backward reads, in order
  out_tree: object
  num_params: int


def _flatten(closed, in_atoms, plan_eqns, consts, aval, counter):
  """Appends closed's equations to plan_eqns with calls inlined; returns its outputs' atoms."""
  env = {}
  for v, c in zip(closed.jaxpr.constvars, closed.consts):
    key = next(counter)
    consts[key], aval[key] = c, v.aval
    env[v] = key
  env.update(zip(closed.jaxpr.invars, in_atoms))
  read = lambda v: Lit(v.val) if isinstance(v, jcore.Literal) else env[v]
  for eqn in closed.jaxpr.eqns:
    ins = tuple(read(v) for v in eqn.invars)
    if eqn.primitive.name in INLINE and isinstance(eqn.params.get("jaxpr"), jcore.ClosedJaxpr):
      outs = _flatten(eqn.params["jaxpr"], ins, plan_eqns, consts, aval, counter)
    else:
      outs = []
      for v in eqn.outvars:
        outs.append(next(counter))
        aval[outs[-1]] = v.aval
      params = eqn.primitive.get_bind_params(eqn.params)
      plan_eqns.append(Eqn(eqn.primitive, params, ins, tuple(outs), eqn.ctx))
    for v, o in zip(eqn.outvars, outs):
      env[v] = o
  return [read(v) for v in closed.jaxpr.outvars]


def make_plan(stage, params, model_state, x) -> Plan:
  """The plan of stage's train-mode forward at the shapes of (params, model_state, x)."""
  fn = lambda p, ms, x: apply_model(stage, p, ms, x, train=True)
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(params, model_state, x)
  counter = iter(range(1 << 62))
  eqns, consts, aval = [], {}, {}
  invars = []
  for v in closed.jaxpr.invars:
    invars.append(next(counter))
    aval[invars[-1]] = v.aval
  outs = _flatten(closed, invars, eqns, consts, aval, counter)
  outvars = []
  for o in outs:  # an output that is a literal: a value of its own
    if isinstance(o, Lit):
      key = next(counter)
      consts[key], aval[key] = o.value, jax.typeof(o.value)
      o = key
    outvars.append(o)
  num_params = len(jax.tree.leaves(params))
  kind = {key: C for key in consts}
  kind.update({key: (W if i < num_params else A) for i, key in enumerate(invars)})
  kept = {}
  for e in eqns:
    in_kinds = {kind[a] for a in e.ins if not isinstance(a, Lit)}
    k = A if A in in_kinds else (W if W in in_kinds else C)
    kind.update({o: k for o in e.outs})
    if k == A and e.prim.name not in LINEAR:
      kept.update({a: None for a in e.ins if not isinstance(a, Lit) and kind[a] == A})
  tree = jax.tree.structure(out_shape)
  return Plan(eqns, kind, aval, invars, outvars, consts, list(kept), tree, num_params)


def _bind(e: Eqn, vals):
  with e.ctx.manager:
    out = e.prim.bind(*vals, **e.params)
  return list(out) if e.prim.multiple_results else [out]


def _read(env, a):
  return a.value if isinstance(a, Lit) else env[a]


def forward(plan: Plan, params, model_state, x):
  """The stage's forward at `params`: ((y, new model state), the kept activations)."""
  env = dict(plan.consts)
  env.update(zip(plan.invars, jax.tree.leaves((params, model_state, x))))
  for e in plan.eqns:
    env.update(zip(e.outs, _bind(e, [_read(env, a) for a in e.ins])))
  out = jax.tree.unflatten(plan.out_tree, [env[k] for k in plan.outvars])
  return out, [env[k] for k in plan.kept]


def _weight_values(plan: Plan, params):
  """Every W and C value at `params` (the equations that read no activation)."""
  env = dict(plan.consts)
  env.update(zip(plan.invars[: plan.num_params], jax.tree.leaves(params)))
  for e in plan.eqns:
    if e.outs and plan.kind[e.outs[0]] != A:
      env.update(zip(e.outs, _bind(e, [_read(env, a) for a in e.ins])))
  of = lambda kind: {k: v for k, v in env.items() if plan.kind[k] == kind}
  return of(W), of(C)


def _inexact(aval) -> bool:
  return jnp.issubdtype(aval.dtype, jnp.inexact)


def _zeros(aval):
  return jnp.zeros(aval.shape, aval.dtype)


def backward(plan: Plan, params_bwd, kept, cotangent):
  """(dL/d params, dL/d x) of the forward that left `kept`, with every weight operand of the backward
  at params_bwd; `cotangent` is dL/dy (the model state gets none)."""
  wvals, pull_w, cvals = jax.vjp(lambda p: _weight_values(plan, p), params_bwd, has_aux=True)
  env = {**cvals, **wvals, **dict(zip(plan.kept, kept))}
  ct = {plan.outvars[0]: cotangent}
  ct_w = {}
  for e in reversed(plan.eqns):
    if not any(o in ct for o in e.outs):  # no cotangent reaches it (W, C, integer or unused values)
      continue
    out_ct = [ct.pop(o, None) for o in e.outs]
    # A LINEAR equation's operands were not kept: zeros stand in (its vjp does not read them).
    vals = [_read(env, a) if isinstance(a, Lit) or a in env else _zeros(plan.aval[a]) for a in e.ins]
    diff = [
      i
      for i, a in enumerate(e.ins)
      if not isinstance(a, Lit) and plan.kind[a] != C and _inexact(plan.aval[a])
    ]

    def fn(*d, e=e, vals=vals, diff=diff):
      v = list(vals)
      for i, di in zip(diff, d):
        v[i] = di
      return _bind(e, v)

    outs, pull = jax.vjp(fn, *[vals[i] for i in diff])
    got = pull([c if c is not None else jnp.zeros_like(o) for c, o in zip(out_ct, outs)])
    for i, g in zip(diff, got):
      key = e.ins[i]
      into = ct_w if plan.kind[key] == W else ct
      into[key] = g if key not in into else into[key] + g
  (g_params,) = pull_w({k: ct_w.get(k, jnp.zeros_like(v)) for k, v in wvals.items()})
  x_key = plan.invars[-1]
  g_x = ct.get(x_key, _zeros(plan.aval[x_key]))
  return g_params, g_x
