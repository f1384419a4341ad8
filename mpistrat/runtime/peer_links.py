"""The health check's TCP links: one connection per peer, kept alive by the kernel.

Keepalives every second and a ``TCP_USER_TIMEOUT`` make the kernel drop a link
whose far host stops answering; the messages are newline-separated JSON, each at
most ``MAX_MESSAGE_BYTES``::

    >>> import socket
    >>> from mpistrat.runtime.peer_links import Link
    >>> a, b = socket.socketpair()
    >>> Link(a, 1).send({"t": "hello", "rank": 1}); Link(b, 0).receive()
    [{'t': 'hello', 'rank': 1}]

Who may join: rank 0 listens only where the ranks are (``listen``: loopback
when they share its host), and the offer goes to the ranks over MPI with a
random token. A connection counts as rank r only once its first line is a hello
carrying that token (compared as bytes), and rank 0 answers it with a welcome
(``accept_ranks``). Anything else (another user's process that found the port,
garbage, a line that never ends, a flood of silent connections) is dropped and
logged per connection: strangers get ``HELLO_SECONDS`` each to speak, at most
``PENDING_PER_SOURCE`` of them wait at once per source address (the oldest goes
first), and a rank whose connection was dropped before its welcome dials again
(``dial``) until the start-up deadline. Nothing a peer sends raises past its own
connection, so a stranger can neither end the job nor keep the check off.
"""

import hmac
import json
import math
import os
import selectors
import socket
import threading
import time
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["Link", "local_addresses", "place", "tune", "listen", "accept_ranks", "dial",
           "valid_message", "short", "MAX_MESSAGE_BYTES", "MAX_TEXT", "HELLO_BYTES",
           "WELCOME", "HELLO_SECONDS", "PENDING_PER_SOURCE", "MAX_PENDING"]

MAX_MESSAGE_BYTES = 1 << 24   # a longer line is no message of ours (a relay of 100,000
                              # leaves with their causes, each cut to MAX_TEXT, fits)
MAX_TEXT = 2000               # a cause or a leave's reason is cut to this many characters
HELLO_BYTES = 256             # a hello is one line of exactly this length (padded), so
                              # rank 0 never reads past it into the rank's first message
WELCOME = b"welcome".ljust(31) + b"\n"   # rank 0's answer to a valid hello (fixed length:
                                         # the rank never reads past it either)
HELLO_SECONDS = 5.0           # a connection must say its hello this soon after it is accepted
PENDING_PER_SOURCE = 64       # connections without a hello that wait at once, per source address
MAX_PENDING = 256             # ... and in all (each beyond it closes the oldest of the largest
                              # source: a flood costs the flooder its own connections)
WARNED_DROPS = 20             # drops warned one by one; the rest are counted in one warning


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


def place() -> Tuple[str, ...]:
    """Where this process can be reached on loopback: its machine's boot id and its network
    namespace (two ranks with the same place reach each other on 127.0.0.1; namespace
    hosts on one machine have different places). Falls back to the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        net = os.stat("/proc/self/ns/net")
        return (boot, f"{net.st_dev}:{net.st_ino}")
    except OSError:
        return (socket.gethostname(),)


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


def _welcomed(sock: socket.socket, deadline: float) -> bool:
    """Whether rank 0 answered the hello with ``WELCOME`` before ``deadline`` (it closes a
    connection it dropped, so a rank learns it at once and dials again)."""
    got = b""
    while len(got) < len(WELCOME):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        sock.settimeout(left)
        try:
            data = sock.recv(len(WELCOME) - len(got))
        except OSError:
            return False
        if not data:
            return False
        got += data
    return got == WELCOME


def dial(offer: Sequence[Tuple[str, int]], token: str, rank: int,
         seconds: float = 30.0) -> Tuple[Optional[Link], str]:
    """Rank ``rank``'s link to rank 0, welcomed after its hello with the job's token; the
    offered addresses are tried in turn, again and again, until ``seconds`` have passed
    (a stranger's flood may have made rank 0 drop an attempt). ``None`` and what was tried
    when no attempt was welcomed."""
    deadline = time.monotonic() + seconds
    tried: Dict[str, str] = {}
    pause = 0.01
    hello = json.dumps({"t": "hello", "rank": rank, "token": token})
    hello = hello.ljust(HELLO_BYTES - 1).encode() + b"\n"
    while True:
        for address, port in offer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None, ", ".join(f"{a} ({why})" for a, why in tried.items())
            try:
                sock = socket.create_connection((address, port), timeout=min(3.0, left))
            except OSError as err:
                tried[f"{address}:{port}"] = str(err)
                continue
            try:
                sock.sendall(hello)
                if _welcomed(sock, min(deadline, time.monotonic() + 2 * HELLO_SECONDS)):
                    sock.settimeout(None)
                    return Link(sock, 0), ""
                tried[f"{address}:{port}"] = "closed before its welcome"
            except OSError as err:
                tried[f"{address}:{port}"] = str(err)
            sock.close()
        time.sleep(pause)
        pause = min(0.5, pause * 2)


def _hello(line: bytes, token: bytes, size: int) -> Tuple[Optional[int], str]:
    """The rank a first line proves, or ``None`` and why not (never raises)."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        return None, "its first line is not JSON"
    if not isinstance(message, dict) or message.get("t") != "hello":
        return None, "its first line is not a hello"
    given = message.get("token")
    if not isinstance(given, str):
        return None, "its hello lacks this job's token"
    given = given.encode("utf-8", "surrogatepass")   # (a lone surrogate is bytes too)
    if not hmac.compare_digest(given, token):
        return None, "its hello lacks this job's token"
    rank = message.get("rank")
    if type(rank) is not int or not 0 < rank < size:
        return None, f"its hello names rank {short(repr(rank))[:40]}, not a rank of this job"
    return rank, ""


def _source(peer) -> str:
    """The address a connection counts against: loopback is one source however it binds."""
    return "127.0.0.0/8" if str(peer[0]).startswith("127.") else str(peer[0])


class _Drops:
    """The connections rank 0 dropped: the first ``WARNED_DROPS`` warned one by one, the
    rest counted per source and warned once at the end (a flood must not flood the log)."""

    def __init__(self):
        self.count, self.quiet = 0, {}

    def __call__(self, peer, why: str) -> None:
        self.count += 1
        if self.count <= WARNED_DROPS:
            warnings.warn(f"mpistrat health check: rank 0 dropped a connection from "
                          f"{peer[0]}:{peer[1]}: {why}", stacklevel=3)
        else:
            self.quiet[_source(peer)] = self.quiet.get(_source(peer), 0) + 1

    def summary(self) -> None:
        if self.quiet:
            each = ", ".join(f"{n} from {source}" for source, n in self.quiet.items())
            warnings.warn(f"mpistrat health check: rank 0 dropped {sum(self.quiet.values())} "
                          f"more connections that proved nothing ({each})", stacklevel=3)


class _Pending:
    """A connection still to say its hello."""
    __slots__ = ("sock", "peer", "buffer", "until")

    def __init__(self, sock, peer, until):
        self.sock, self.peer, self.buffer, self.until = sock, peer, b"", until


def accept_ranks(listeners: Sequence[socket.socket], token: str, size: int,
                 seconds: float) -> Tuple[Dict[int, Link], Optional[str]]:
    """Rank 0: the links of ranks 1..size-1, each proved by its hello and welcomed;
    connections that prove nothing are dropped with a warning, and nothing a connection
    sends raises past it. A rank that dials again (it missed its welcome) replaces its
    earlier link. An error text if ranks are missing after ``seconds``."""
    deadline = time.monotonic() + seconds
    secret = token.encode()
    links: Dict[int, Link] = {}
    pending: Dict[socket.socket, _Pending] = {}
    drop = _Drops()
    waiting = selectors.DefaultSelector()
    for listener in listeners:
        listener.setblocking(False)
        waiting.register(listener, selectors.EVENT_READ, None)

    def close(entry: _Pending, why: str) -> None:
        waiting.unregister(entry.sock)
        del pending[entry.sock]
        entry.sock.close()
        drop(entry.peer, why)

    def make_room(source: str) -> None:
        mine = [e for e in pending.values() if _source(e.peer) == source]
        if len(mine) >= PENDING_PER_SOURCE:
            close(mine[0], f"more than {PENDING_PER_SOURCE} connections from {source} "
                           f"without a hello (the oldest goes)")
        if len(pending) >= MAX_PENDING:
            counts: Dict[str, int] = {}
            for e in pending.values():
                counts[_source(e.peer)] = counts.get(_source(e.peer), 0) + 1
            largest = max(counts, key=counts.get)
            oldest = next(e for e in pending.values() if _source(e.peer) == largest)
            close(oldest, f"more than {MAX_PENDING} connections without a hello")

    def read(entry: _Pending) -> None:
        try:   # (never past the hello: what follows is the rank's first message)
            data = entry.sock.recv(HELLO_BYTES - len(entry.buffer))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        entry.buffer += data
        if data and b"\n" not in entry.buffer and len(entry.buffer) < HELLO_BYTES:
            return                                # (the hello is not complete yet)
        line, newline, _ = entry.buffer.partition(b"\n")
        if not data:
            return close(entry, "it closed before a complete hello")
        if not newline:
            return close(entry, f"it sent {len(entry.buffer)} bytes without a hello")
        rank, why = _hello(line, secret, size)
        if rank is None:
            return close(entry, why)
        waiting.unregister(entry.sock)
        del pending[entry.sock]
        entry.sock.setblocking(True)
        entry.sock.sendall(WELCOME)               # (a few bytes into an empty buffer)
        old = links.pop(rank, None)
        if old is not None:                       # the rank gave up on it and dialed again
            old.sock.close()
        links[rank] = Link(entry.sock, rank)

    def guarded(entry: _Pending) -> None:
        try:
            read(entry)
        except Exception as err:                  # noqa: BLE001 (nothing a peer sends ends us)
            if entry.sock in pending:
                close(entry, f"{type(err).__name__} while reading its hello")
            else:                                 # (its welcome could not be sent: the
                entry.sock.close()                #  rank sees the close and dials again)
                drop(entry.peer, f"{type(err).__name__} while welcoming it")

    try:
        while len(links) < size - 1:
            now = time.monotonic()
            if now >= deadline:
                missing = sorted(set(range(1, size)) - set(links))
                return links, (f"rank 0 heard no hello from ranks {missing} within "
                               f"{seconds:g} s")
            for entry in [e for e in pending.values() if e.until <= now]:
                close(entry, f"no hello within {HELLO_SECONDS:g} s")
            until = min([deadline] + [e.until for e in pending.values()])
            for key, _ in waiting.select(max(0.0, until - now)):
                if key.data is None:              # a listener: a new connection
                    try:
                        sock, peer = key.fileobj.accept()
                    except BlockingIOError:
                        continue
                    except OSError:               # (out of descriptors: never spin on it)
                        time.sleep(0.01)
                        continue
                    make_room(_source(peer))
                    sock.setblocking(False)
                    entry = _Pending(sock, peer, time.monotonic() + HELLO_SECONDS)
                    pending[sock] = entry
                    waiting.register(sock, selectors.EVENT_READ, entry)
                    guarded(entry)                # (a rank's hello is often there already)
                elif key.data.sock in pending:    # (not closed by make_room in this round)
                    guarded(key.data)
    finally:
        for entry in list(pending.values()):
            close(entry, "no hello when the ranks had joined")
        waiting.close()
        drop.summary()
    return links, None
