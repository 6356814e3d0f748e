"""Free TCP ports, for the rendezvous and servers relax starts (engines, process groups, local Ray nodes)."""

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now on `host` ("" for every interface of this node, where
    processes on other nodes connect to it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
