"""The host allocator for large simulator runs: glibc tunables that let XLA:CPU reuse its memory.

XLA:CPU allocates a program's temporaries (and its outputs not aliased to donated inputs) afresh at
every call. glibc serves blocks over 32 MB with fresh mmaps and returns them with munmap, so every
call's large blocks are faulted in and zeroed by the kernel again. The simulator's full round at 4,096
slots has ~2.5 GB of them (copies of the gradients and optimizer state XLA makes to read them while it
updates them in place), and their page zeroing cost more than the round's arithmetic
(docs/design.md 5.1). With TUNABLES the process takes every block from one heap (one arena, no
mmap), keeps what it frees (no trim) and backs it with transparent huge pages, so a round reuses the
last round's memory.

glibc reads GLIBC_TUNABLES once, when a process starts: they apply to processes started with
`env()`, never to the one that is running. Nothing here changes a run's numbers, only its speed and
peak memory.
"""

import os

TUNABLES = (
  "glibc.malloc.arena_max=1",  # one arena: other threads' arenas would mmap large blocks anyway
  "glibc.malloc.mmap_max=0",  # large blocks from the heap, kept on free and reused
  "glibc.malloc.trim_threshold=1000000000000",  # never hand the heap's top back to the kernel
  "glibc.malloc.hugetlb=1",  # transparent huge pages for the heap: 512x fewer faults
)


def env(base: dict | None = None) -> dict:
  """A copy of `base` (default os.environ) whose GLIBC_TUNABLES carry TUNABLES after its own."""
  out = dict(os.environ if base is None else base)
  have = [t for t in out.get("GLIBC_TUNABLES", "").split(":") if t]
  keys = {t.split("=")[0] for t in TUNABLES}
  out["GLIBC_TUNABLES"] = ":".join([t for t in have if t.split("=")[0] not in keys] + list(TUNABLES))
  return out


def tuned(environ: dict | None = None) -> bool:
  """Whether `environ` (default: this process's) carries every one of TUNABLES."""
  have = set((os.environ if environ is None else environ).get("GLIBC_TUNABLES", "").split(":"))
  return all(t in have for t in TUNABLES)


def command_prefix() -> str:
  """The shell prefix that starts a command with TUNABLES, for messages and docs."""
  return "GLIBC_TUNABLES=" + ":".join(TUNABLES)
