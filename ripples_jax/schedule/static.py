"""Periodic group layouts: All-Reduce, the authors' Static GG (node layout), a hypercube and Moshpit's
grid.

A periodic schedule is just a tuple of layouts; round t uses layouts[t % len(layouts)]. Every layout
covers all workers (groups of one are explicit), so the engine's step has one fixed set of layouts and
the round only carries an index.
"""

from ripples_jax.collectives import Layout, canonical_layout


def allreduce_layouts(n: int) -> tuple[Layout, ...]:
  """Synchronous data parallel: one group of all workers every round."""
  return (canonical_layout([range(n)], n),)


def static_gg_layouts(n: int, workers_per_node: int = 4) -> tuple[Layout, ...]:
  """The authors' conflict-free periodic schedule, generalised to any workers per node.

  Their code, 4 GPUs per node, step mod 4: steps 1 and 3 average each node's 4 GPUs; step 0 averages
  every node's GPU 0 across nodes plus the pair {2,3} inside each node; step 2 every node's GPU 1 across
  nodes plus the pair {0,3}. In general, with leader r (0 on step 0, 1 on step 2): the inter-node group
  holds every node's local worker r; inside each node the worker after r stays alone and the others
  (r+2, r+3), (r+4, r+5), ... (local ids mod w) pair up. A trailing partial node (n % w workers) is
  treated as a smaller node.
  """
  w = workers_per_node
  nodes = [list(range(s, min(s + w, n))) for s in range(0, n, w)]
  intra = canonical_layout(nodes, n)
  if len(nodes) == 1:  # one node: only the intra-node all-reduce exists
    return (intra,)

  def inter(r):
    groups = [[node[r % len(node)] for node in nodes]]
    for node in nodes:
      m = len(node)
      if m < 3:
        continue
      rest = [node[(r + j) % m] for j in range(2, m)]
      groups += [rest[i : i + 2] for i in range(0, len(rest), 2)]
    # A node smaller than the leader index contributes its (r mod m) worker, which may then also sit
    # in a pair; keep the inter group and drop that worker from its pair.
    lead = set(groups[0])
    groups = [groups[0]] + [[i for i in g if i not in lead] for g in groups[1:]]
    return canonical_layout(groups, n)

  return (inter(0), intra, inter(1), intra)


def hypercube_layouts(n: int, group_size: int = 2) -> tuple[Layout, ...]:
  """Butterfly: round k groups workers that differ only in base-`group_size` digit k.

  After log_g(n) rounds every worker holds the exact global mean (for n a power of group_size).
  """
  g = group_size
  dims, m = 0, 1
  while m < n:
    m *= g
    dims += 1
  if m != n:
    raise ValueError(f"schedule.layout: hypercube needs num_workers a power of {g}, got {n}")
  layouts = []
  for k in range(dims):
    stride = g**k
    groups = {}
    for i in range(n):
      key = i - ((i // stride) % g) * stride
      groups.setdefault(key, []).append(i)
    layouts.append(canonical_layout(list(groups.values()), n))
  return tuple(layouts)


def default_grid(n: int) -> tuple[int, ...]:
  """Moshpit's default grid for n workers: the two-dimensional one closest to a square (16: (4, 4);
  8: (2, 4)), or (n,) when n is prime or below 4."""
  a = max((k for k in range(2, int(n**0.5) + 1) if n % k == 0), default=1)
  return (a, n // a) if a > 1 else (n,)


def grid_layouts(grid) -> tuple[Layout, ...]:
  """Moshpit SGD's groups (Ryabinin et al., 2021): worker i sits at the mixed-radix coordinates of i
  on `grid` (the last dimension fastest); layout k groups the workers that share every coordinate but
  the k-th. Invariant: averaging within the layouts 0..d-1 in turn (from any k, cyclically) gives
  every worker the exact mean, since each layout averages one coordinate away."""
  grid = tuple(int(g) for g in grid)
  n = 1
  for g in grid:
    n *= g
  stride = [1] * len(grid)
  for k in range(len(grid) - 2, -1, -1):
    stride[k] = stride[k + 1] * grid[k + 1]
  layouts = []
  for size, step in zip(grid, stride):
    groups = {}
    for i in range(n):
      groups.setdefault(i - ((i // step) % size) * step, []).append(i)
    layouts.append(canonical_layout(list(groups.values()), n))
  return tuple(layouts)
