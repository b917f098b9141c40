"""ripples_jax.allocator: the tunables reach a child process and change where glibc puts large blocks."""

import json
import subprocess
import sys

import pytest

from ripples_jax import allocator

# A child that mallocs 256 MB, writes to it, frees it, mallocs it again, and reports glibc's own
# counts (mallinfo2): bytes held in mmapped blocks (hblkhd) and in the heap (arena), while the block is
# held, and whether the second block is the first one reused.
PROBE = r"""
import ctypes, json
class Info(ctypes.Structure):
  _fields_ = [(k, ctypes.c_size_t) for k in
              ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
               "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.mallinfo2.restype = Info
n = 256 << 20
a = libc.malloc(n); ctypes.memset(a, 1, n)
held = libc.mallinfo2()
libc.free(ctypes.c_void_p(a))
b = libc.malloc(n)
print(json.dumps({"mmapped": held.hblkhd, "heap": held.arena, "reused": a == b}))
"""


def probe(env):
  out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables")
def test_tunables_put_large_blocks_on_the_heap_and_reuse_them():
  base = {k: v for k, v in allocator.env().items() if k != "GLIBC_TUNABLES"}
  default, tuned = probe(base), probe(allocator.env(base))
  assert default["mmapped"] >= 256 << 20 and default["heap"] < 256 << 20
  assert tuned["mmapped"] == 0 and tuned["heap"] >= 256 << 20 and tuned["reused"]


def test_env_keeps_other_tunables_and_replaces_ours():
  env = allocator.env({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0:glibc.malloc.mmap_max=7", "X": "1"})
  got = env["GLIBC_TUNABLES"].split(":")
  assert got[0] == "glibc.malloc.tcache_count=0" and "glibc.malloc.mmap_max=7" not in got
  assert got[1:] == list(allocator.TUNABLES) and env["X"] == "1"
  assert allocator.tuned(env) and not allocator.tuned({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=7"})
  assert allocator.command_prefix() == "GLIBC_TUNABLES=" + ":".join(allocator.TUNABLES)


def test_readme_starts_large_runs_with_these_tunables():
  import os

  readme = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")).read()
  assert allocator.command_prefix() + " \\\n" in readme
