"""The health check's TCP links: one connection per peer, kept alive by the kernel.

Keepalives every second and a ``TCP_USER_TIMEOUT`` make the kernel drop a link
whose far host stops answering; the messages are newline-separated JSON, each at
most ``MAX_MESSAGE_BYTES``::

    >>> import socket
    >>> from mpistrat.runtime.peer_links import Link
    >>> a, b = socket.socketpair()
    >>> Link(a, 1).send({"t": "hello", "rank": 1}); Link(b, 0).receive()
    [{'t': 'hello', 'rank': 1}]

Who may join: rank 0 listens only on the addresses it offers (``listen``), and
the offer goes to the ranks over MPI with a random token. A connection counts as
rank r only once its first line is a hello carrying that token and a rank not
yet seen (``accept_ranks``); anything else (another user's process that found
the port, garbage, a line that never ends) is dropped and logged, and never
holds up the ranks or ends the job.
"""

import hmac
import json
import math
import selectors
import socket
import threading
import time
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["Link", "local_addresses", "tune", "listen", "accept_ranks", "dial",
           "valid_message", "short", "MAX_MESSAGE_BYTES", "MAX_TEXT", "HELLO_BYTES"]

MAX_MESSAGE_BYTES = 1 << 24   # a longer line is no message of ours (a relay of 100,000
                              # leaves with their causes, each cut to MAX_TEXT, fits)
MAX_TEXT = 2000               # a cause or a leave's reason is cut to this many characters
HELLO_BYTES = 256             # a hello is one line of exactly this length (padded), so
                              # rank 0 never reads past it into the rank's first message


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
        """The messages that arrived (``None`` once the peer closed); raises ``OSError``, or
        ``ValueError`` for a line that is not JSON or longer than ``MAX_MESSAGE_BYTES``."""
        data = self.sock.recv(1 << 16)
        if not data:
            return None
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        if len(self.buffer) > MAX_MESSAGE_BYTES or any(len(x) > MAX_MESSAGE_BYTES for x in lines):
            raise ValueError(f"a message over {MAX_MESSAGE_BYTES} bytes")
        return [json.loads(line) for line in lines if line]


def short(text: str) -> str:
    """``text`` cut to ``MAX_TEXT`` characters (a cause may embed a whole traceback)."""
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + " ... (cut)"


def valid_message(message) -> bool:
    """Whether ``message`` is one the watch acts on, with fields of the right types::

        >>> valid_message({"t": "end", "cause": "rank 1 died"}), valid_message({"t": "end"})
        (True, False)
    """
    if not isinstance(message, dict):
        return False
    kind = message.get("t")
    if kind == "leave":
        return isinstance(message.get("why"), str)
    if kind in ("abort", "end"):
        return isinstance(message.get("cause"), str)
    if kind == "left":
        ranks = message.get("ranks")
        return isinstance(ranks, list) and all(
            isinstance(r, list) and len(r) == 2 and type(r[0]) is int and isinstance(r[1], str)
            for r in ranks)
    return False


# -- start-up: who may join ------------------------------------------------------------------
def listen(addresses: Sequence[str], backlog: int) -> List[Tuple[socket.socket, str, int]]:
    """One listening socket on each address that can be bound, on a free port:
    ``(socket, address, port)``; ``OSError`` when none can."""
    made, errors = [], []
    for address in dict.fromkeys(addresses):
        try:
            sock = socket.create_server((address, 0), backlog=backlog)
        except OSError as err:
            errors.append(f"{address} ({err})")
            continue
        made.append((sock, address, sock.getsockname()[1]))
    if not made:
        raise OSError(f"rank 0 could not listen on any of {', '.join(errors)}")
    return made


def dial(offer: Sequence[Tuple[str, int]], token: str, rank: int) -> Tuple[Optional[Link], str]:
    """Rank ``rank``'s link to rank 0 at the first offered address that answers, having sent
    its hello with the job's token; or ``None`` and what was tried."""
    tried = []
    for address, port in offer:
        try:
            sock = socket.create_connection((address, port), timeout=3.0)
        except OSError as err:
            tried.append(f"{address}:{port} ({err})")
            continue
        hello = json.dumps({"t": "hello", "rank": rank, "token": token})
        sock.sendall(hello.ljust(HELLO_BYTES - 1).encode() + b"\n")
        return Link(sock, 0), ""
    return None, ", ".join(tried)


def _hello(line: bytes, token: str, size: int, joined) -> Tuple[Optional[int], str]:
    """The rank a first line proves, or ``None`` and why not."""
    try:
        message = json.loads(line)
    except ValueError:
        return None, "its first line is not JSON"
    if not isinstance(message, dict) or message.get("t") != "hello":
        return None, "its first line is not a hello"
    given = message.get("token")
    if not isinstance(given, str) or not hmac.compare_digest(given.encode(), token.encode()):
        return None, "its hello lacks this job's token"
    rank = message.get("rank")
    if type(rank) is not int or not 0 < rank < size or rank in joined:
        return None, f"its hello names rank {rank!r}, not a rank still to join"
    return rank, ""


def _dropped(peer, why: str) -> None:
    warnings.warn(f"mpistrat health check: rank 0 dropped a connection from "
                  f"{peer[0]}:{peer[1]}: {why}", stacklevel=3)


def accept_ranks(listeners: Sequence[socket.socket], token: str, size: int,
                 seconds: float) -> Tuple[Dict[int, Link], Optional[str]]:
    """Rank 0: the links of ranks 1..size-1, each proved by its hello; connections that
    prove nothing are dropped with a warning. An error text if ranks are missing after
    ``seconds``."""
    deadline = time.monotonic() + seconds
    links: Dict[int, Link] = {}
    waiting = selectors.DefaultSelector()
    for listener in listeners:
        listener.setblocking(False)
        waiting.register(listener, selectors.EVENT_READ, None)
    try:
        while len(links) < size - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, size)) - set(links))
                return links, f"rank 0 heard nothing from ranks {missing} within {seconds:g} s"
            for key, _ in waiting.select(left):
                if key.data is None:              # a listener: a new connection
                    try:
                        sock, peer = key.fileobj.accept()
                    except OSError:               # (out of descriptors: never spin on it)
                        time.sleep(0.01)
                        continue
                    if len(waiting.get_map()) - len(listeners) >= 4 * size + 64:
                        sock.close()              # (a flood of connections saying nothing)
                        _dropped(peer, "too many connections without a hello")
                        continue
                    sock.setblocking(False)
                    waiting.register(sock, selectors.EVENT_READ, [b"", peer])
                    continue
                sock, (buffer, peer) = key.fileobj, key.data
                try:   # (never past the hello: what follows is the rank's first message)
                    data = sock.recv(HELLO_BYTES - len(buffer))
                except OSError:
                    data = b""
                buffer += data
                if data and b"\n" not in buffer and len(buffer) < HELLO_BYTES:
                    key.data[0] = buffer          # (the hello is not complete yet)
                    continue
                waiting.unregister(sock)
                line, newline, _ = buffer.partition(b"\n")
                if not data:
                    rank, why = None, "it closed before a complete hello"
                elif not newline:
                    rank, why = None, f"it sent {len(buffer)} bytes without a hello"
                else:
                    rank, why = _hello(line, token, size, links)
                if rank is None:
                    sock.close()
                    _dropped(peer, why)
                    continue
                sock.setblocking(True)
                links[rank] = Link(sock, rank)
    finally:
        for key in list(waiting.get_map().values()):
            if key.data is not None:   # (a connection still without a hello)
                key.fileobj.close()
                _dropped(key.data[1], "no hello when the ranks had joined")
        waiting.close()
    return links, None
