"""Free TCP ports, for the rendezvous and servers relax starts (engines, process groups, local Ray nodes).

A port is chosen below the node's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range): the kernel hands ports
of that range to every bind(0) and outgoing connection of every process, so a port found free there can be taken
by another process (a Ray worker's connection, another engine's bind) before its server binds it; the engines
of parallel runs on one node then failed to start with EADDRINUSE. Below the range only explicit binds compete.
"""

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10000  # below: well-known and registered services' ports
TRIES = 100
_random = random.SystemRandom()  # not the random module's state, which a process may seed as another does


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now on `host` ("" for every interface of this node, where
    processes on other nodes connect to it), below the ephemeral range where it can; else one the kernel picks."""
    highest = _ephemeral_start() - 1
    for _ in range(TRIES if highest > LOWEST_PORT else 0):
        port = _random.randint(LOWEST_PORT, highest)
        if _bindable(host, port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_start() -> int:
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the common default
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True
