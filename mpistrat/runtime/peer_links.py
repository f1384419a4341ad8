"""The health check's TCP links: one connection per peer, kept alive by the kernel.

Keepalives every second and a ``TCP_USER_TIMEOUT`` make the kernel drop a link
whose far host stops answering; the messages are newline-separated JSON::

    >>> import socket
    >>> from mpistrat.runtime.peer_links import Link
    >>> a, b = socket.socketpair()
    >>> Link(a, 1).send({"t": "hello", "rank": 1}); Link(b, 0).receive()
    [{'t': 'hello', 'rank': 1}]
"""

import json
import math
import socket
import threading
from typing import List, Optional

__all__ = ["Link", "local_addresses", "tune"]


def local_addresses() -> List[str]:
    """This host's IPv4 addresses, loopback last (asked of each interface)."""
    import fcntl
    import struct
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), 0x8915,  # SIOCGIFADDR
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            found.append(socket.inet_ntoa(packed[20:24]))
    return sorted(set(found), key=lambda a: (a.startswith("127."), a)) or ["127.0.0.1"]


def tune(sock: socket.socket, timeout: float) -> None:
    """Keepalives every second, and the kernel drops the link after ``timeout`` unanswered."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1),
                        ("TCP_KEEPCNT", max(1, math.ceil(timeout))),
                        ("TCP_USER_TIMEOUT", int(timeout * 1000)), ("TCP_NODELAY", 1)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class Link:
    """One connection: newline-separated JSON messages."""

    def __init__(self, sock: socket.socket, rank: int):
        self.sock, self.rank, self.buffer, self.left = sock, rank, b"", False
        self._lock = threading.Lock()   # the watch thread and the exit path both send

    def send(self, message: dict) -> None:
        with self._lock:
            self.sock.sendall((json.dumps(message) + "\n").encode())

    def receive(self) -> Optional[List[dict]]:
        """The messages that arrived (``None`` once the peer closed); raises ``OSError``."""
        data = self.sock.recv(1 << 16)
        if not data:
            return None
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        return [json.loads(line) for line in lines if line]
