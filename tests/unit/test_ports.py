"""relax.ports: free ports below the node's ephemeral range, where other processes' bind(0) and connections
cannot take them before relax's servers bind them."""

import random
import socket

from relax import ports


def test_a_free_port_lies_below_the_ephemeral_range_and_is_not_one_in_use(monkeypatch, tmp_path):
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("32768\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", range_file)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        in_use = taken.getsockname()[1]
        candidates = iter([in_use, in_use, 20001])
        monkeypatch.setattr(ports._random, "randint", lambda low, high: next(candidates))
        assert ports.free_port() == 20001  # the port in use is passed over
    monkeypatch.undo()
    random.seed(0)  # a process's own seeding does not make its picks another process's
    picks = {ports.free_port() for _ in range(20)}
    assert all(ports.LOWEST_PORT <= port < ports._ephemeral_start() for port in picks) and len(picks) > 1


def test_without_room_below_the_range_the_kernel_picks(monkeypatch, tmp_path):
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("1024 65535\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", range_file)
    assert 1024 <= ports.free_port() <= 65535
