"""Where the coordination service and the CPU collectives listen.

bind_address and port_problem, for the coordination service: used by host.init_distributed (process 0)
and the local launcher; collectives_host, where gloo's listeners go.
"""

import errno
import ipaddress
import os
import socket

# Where this process's gloo listeners bind, when its launcher says so: a node launcher's --node_address
# (several nodes on one host, each on a loopback address of its own, bind there, not the coordinator's).
COLLECTIVES_HOST_ENV = "RIPPLES_COLLECTIVES_HOST"


def split_address(address: str) -> tuple[str, int]:
  """'host:port', '[v6]:port' -> (host without brackets, port)."""
  host, port = address.rsplit(":", 1)
  return host.strip("[]"), int(port)


def bind_address(coordinator_address: str) -> str | None:
  """The address process 0's coordination service (an unauthenticated key-value store) binds.

  It follows the coordinator address: a loopback address (127.0.0.1, ::1, localhost) binds loopback
  only, any other IP address that interface only. A host name gives None: JAX's default, every
  interface ([::]:port), since a host's own name may resolve to a loopback address on that host
  (Debian's 127.0.1.1) while the other hosts reach it through its network address.
  """
  host, port = split_address(coordinator_address)
  if host == "localhost":
    return f"127.0.0.1:{port}"
  try:
    ip = ipaddress.ip_address(host)
  except ValueError:
    return None
  return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def collectives_host(coordinator_address: str) -> str | None:
  """The address gloo's TCP listeners (the CPU collectives: unauthenticated tensor traffic) should bind:
  loopback when the coordinator is a loopback address (every process is on this host: the local
  launcher's case), else None, JAX's default (what this host's name resolves to; other hosts must reach it).
  A node launcher's --node_address (COLLECTIVES_HOST_ENV) comes first.
  """
  if given := os.environ.get(COLLECTIVES_HOST_ENV):
    return given
  host, _ = split_address(coordinator_address)
  if host == "localhost":
    return "127.0.0.1"
  try:
    return host if ipaddress.ip_address(host).is_loopback else None
  except ValueError:  # a host name
    return None


def port_problem(bind: str) -> int | None:
  """None when the service could bind `bind` ('host:port'; '[::]:port' for every interface), else the
  errno: EADDRINUSE (a process listens there: gRPC would fail or, with SO_REUSEPORT, share the port
  with it) or EADDRNOTAVAIL (not an address of this host)."""
  host, port = split_address(bind)
  every = host in ("", "::", "0.0.0.0")
  try:
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
  except OSError:  # IPv6 off on this host
    s, host = socket.socket(socket.AF_INET, socket.SOCK_STREAM), "0.0.0.0"
  with s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no conflict
    if s.family == socket.AF_INET6 and every:
      s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # [::] covers IPv4 too
    try:
      s.bind((host, port))
      s.listen(1)
    except OSError as e:
      return e.errno or errno.EADDRINUSE
  return None
