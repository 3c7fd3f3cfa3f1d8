"""Free local ports for the benchmark tests' stand-in servers."""

from __future__ import annotations

import socket


def free_ports(n: int) -> int:
    """A port ending in 0 whose next ``n - 1`` ports are free too, so that a stand-in can tell
    the servers apart by the last digit. Raises ``RuntimeError`` when 200 tries find none."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1]) // 10 * 10
        socks = [socket.socket() for _ in range(n)]
        try:
            for i, sock in enumerate(socks):
                sock.bind(("127.0.0.1", port + i))
            return port
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {n} free ports in a row")
