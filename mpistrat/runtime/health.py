"""The peer health check: a rank that dies, leaves or becomes unreachable ends the job.

With MPI alone, a rank that skips a collective and exits normally leaves the
others waiting forever (its ``MPI_Finalize`` waits for them too), and a host
whose link goes down is noticed by nothing for many minutes. Like TensorFlow's
multi-worker health check, mpistrat watches its peers, outside MPI and at no
cost to the collectives: when the world is made, every rank opens one TCP
connection to rank 0 (``MPISTRAT_HEALTH_CHECK``, on by default). Then:

* a rank that **dies** (killed, crashed) closes its connection without a leave
  notice: rank 0 sees it at once and tells every rank;
* a rank whose **host is unreachable** stops answering TCP keepalives: rank 0
  (and the unreachable rank, about rank 0) know it after
  ``MPISTRAT_HEALTH_TIMEOUT`` seconds (10);
* a rank that **leaves normally** sends a leave notice from its exit handler,
  before ``MPI_Finalize``; rank 0 relays the leaves. That alone is no error
  (ranks finish at different times); it is one when a rank then stays inside
  a collective for ``MPISTRAT_HEALTH_LEAVE_GRACE`` seconds (3), read from its
  Python stack (``wait_sites.py``).

Each rank then prints ``UnavailableError`` naming the rank, its host and pid,
what happened and what this rank was waiting in, and the job ends with
``MPI_Abort`` (exit code 1). A rank that is merely slow or stopped (SIGSTOP)
is alive: its kernel still answers, so nothing ends the job; bound such waits
with ``MPISTRAT_COLLECTIVE_TIMEOUT``.

    >>> from mpistrat.runtime import health
    >>> health.current() is None     # one process: nothing to watch
    True
"""

import atexit
import errno
import math
import os
import secrets
import selectors
import socket
import sys
import threading
import time
import warnings
from typing import Dict, List, Optional

from mpi4py import MPI

from mpistrat.runtime import settings, wait_sites
from mpistrat.runtime.peer_links import (Link, accept_ranks, dial, listen, local_addresses,
                                         place, short, tune, valid_message)

__all__ = ["HealthCheck", "start", "current", "announce_abort", "EXIT_CODE"]

EXIT_CODE = 1
CONNECT_SECONDS = 30.0   # for every rank to reach rank 0 when the check starts
RELAY_SECONDS = 0.5      # rank 0 relays leave notices at most this often
SAMPLE_SECONDS = 0.25    # stacks are sampled this often once a peer has left
END_SECONDS = 3.0        # rank 0 waits this long for the others to print before aborting
OUTPUT_SECONDS = 0.3     # and this long for the launcher to forward what they printed
_UNREACHABLE = (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN,
                errno.ENETDOWN)
_current: Dict[str, "HealthCheck"] = {}


def current() -> Optional["HealthCheck"]:
    """The health check running in this process, or ``None``."""
    return _current.get("check")


class HealthCheck:
    """The watch of one rank: rank 0 holds a link to every rank, the others one to rank 0."""

    def __init__(self, comm: MPI.Comm, peers: List[tuple], timeout: float, grace: float,
                 places: Optional[List[tuple]] = None):
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.peers = peers                     # (host, pid) of every rank
        self.places = places or [place()] * self.size   # where each rank reaches loopback
        self.timeout, self.grace = timeout, grace
        self.pid = os.getpid()
        self.left: Dict[int, str] = {}         # rank -> why, for ranks that left normally
        self._unrelayed: List[list] = []
        self._relayed_at = 0.0
        self._watched: Dict[int, tuple] = {}   # thread id -> (frame, since)
        self._links: Dict[int, Link] = {}
        self._lock = threading.Lock()
        self._leaving = self._ending = False
        self._selector = selectors.DefaultSelector()
        self._wake, self._waker = socket.socketpair()
        self._selector.register(self._wake, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="mpistrat-health", daemon=True)

    def name(self, rank: int) -> str:
        host, pid = self.peers[rank]
        return f"rank {rank}/{self.size} (host {host}, pid {pid})"

    # -- start (collective) ------------------------------------------------------------
    def connect(self, comm: MPI.Comm) -> Optional[str]:
        """Open the links; an error text (the check then stays off everywhere), or ``None``.
        Rank 0 listens only where the ranks are (``listen_addresses``); the offer and a
        random token go to the ranks over MPI, and only a connection that says the token
        joins (``peer_links.accept_ranks``)."""
        listeners = []
        try:
            if self.rank == 0:
                listeners = listen(self.listen_addresses(), self.size + 64)
                token = secrets.token_hex(16)
                comm.bcast((token, [(address, port) for _, address, port in listeners]), root=0)
                links, error = accept_ranks([sock for sock, _, _ in listeners], token,
                                            self.size, CONNECT_SECONDS)
                for link in links.values():
                    self._add(link)
                return error
            token, offer = comm.bcast(None, root=0)
            if self.places[self.rank] == self.places[0]:   # rank 0's host: loopback first
                offer = sorted(offer, key=lambda pair: not pair[0].startswith("127."))
            link, tried = dial(offer, token, self.rank, CONNECT_SECONDS)
            if link is None:
                return f"rank {self.rank} could not reach rank 0 at {tried}"
            self._add(link)
            return None
        except OSError as err:
            return f"rank {self.rank}: {err}"
        finally:
            for sock, _, _ in listeners:
                sock.close()

    def listen_addresses(self) -> List[str]:
        """Where rank 0 listens: loopback alone when every rank shares its host (its network
        namespace); else ``MPISTRAT_COORDINATOR_HOST`` or its interfaces' addresses, with
        loopback only when some rank shares its host."""
        local = [r for r in range(1, self.size) if self.places[r] == self.places[0]]
        if len(local) == self.size - 1:
            return ["127.0.0.1"]
        forced = settings.get("MPISTRAT_COORDINATOR_HOST")
        outside = [forced] if forced else [a for a in local_addresses()
                                           if not a.startswith("127.")]
        return outside + (["127.0.0.1"] if local else [])

    def _add(self, link: Link) -> None:
        tune(link.sock, self.timeout)
        link.sock.settimeout(None)
        self._links[link.rank] = link
        self._selector.register(link.sock, selectors.EVENT_READ, link)

    # -- the watch thread --------------------------------------------------------------
    def _run(self) -> None:
        while not self._leaving:
            wait = SAMPLE_SECONDS if self.left else None
            if self._unrelayed:
                wait = RELAY_SECONDS / 2
            for key, _ in self._selector.select(wait):
                if key.data is None:
                    self._wake.recv(64)
                elif not self._leaving:
                    self._read(key.data)
            if self._leaving or self._ending:
                return
            if self._unrelayed and time.monotonic() - self._relayed_at >= RELAY_SECONDS:
                self._relay([], self._unrelayed)
            if self.left:
                self._judge()

    def _read(self, link: Link) -> None:
        try:
            messages = link.receive()
        except (OSError, ValueError) as err:
            return self._lost(link, err)
        if messages is None:
            return self._lost(link, None)
        for message in messages:
            if not valid_message(message):   # (an authenticated rank never sends one)
                warnings.warn(f"mpistrat health check: rank {self.rank} ignored a malformed "
                              f"message from rank {link.rank}", stacklevel=2)
                continue
            kind = message.get("t")
            if kind == "leave":        # a rank leaves normally (to rank 0)
                link.left = True
                self._note_left(link.rank, message["why"])
            elif kind == "left":       # rank 0 relays leaves
                for rank, why in message["ranks"]:
                    self._note_left(int(rank), why)
                    link.left = link.left or int(rank) == 0
            elif kind in ("abort", "end"):
                self.end(message["cause"], told=True)

    def _note_left(self, rank: int, why: str) -> None:
        if rank not in self.left:
            self.left[rank] = why
            if self.rank == 0:
                self._unrelayed.append([rank, why])

    def _relay(self, extra: List[list], leaves: List[list]) -> None:
        message = {"t": "left", "ranks": leaves + extra}
        for link in list(self._links.values()):
            if not link.left:
                try:
                    link.send(message)
                except OSError:
                    pass
        self._unrelayed, self._relayed_at = [], time.monotonic()

    def _lost(self, link: Link, err: Optional[BaseException]) -> None:
        self._drop(link)
        if link.left or self._leaving:
            return
        if isinstance(err, OSError) and (isinstance(err, socket.timeout)
                                         or err.errno in _UNREACHABLE):
            cause = (f"{self.name(link.rank)} is unreachable: its host has not answered for "
                     f"{self.timeout:g} s (MPISTRAT_HEALTH_TIMEOUT; {err})")
        else:
            how = f" ({err})" if err is not None else ""
            cause = (f"{self.name(link.rank)} died: its connection closed without a leave "
                     f"notice{how} (killed, crashed, or ended without running exit handlers)")
        self.end(cause)

    def _drop(self, link: Link) -> None:
        if self._links.get(link.rank) is link:
            del self._links[link.rank]
            self._selector.unregister(link.sock)
            link.sock.close()

    def _judge(self) -> None:
        """End the job once a thread has waited in one collective for ``grace`` seconds
        since a peer left (a rank that left never joins another collective)."""
        now, mine = time.monotonic(), threading.get_ident()
        for ident, frame in sys._current_frames().items():
            frame = None if ident == mine else wait_sites.waiting_frame(frame)
            seen = self._watched.get(ident)
            if frame is None:
                self._watched.pop(ident, None)
            elif seen is None or seen[0] is not frame:
                self._watched[ident] = (frame, now)
            elif now - seen[1] >= self.grace:
                comm = wait_sites.comm_of(frame)
                gone = sorted(self.left)
                if comm is not None:
                    gone = list(wait_sites.members(comm, gone))
                if not gone:           # a collective without the ranks that left
                    self._watched[ident] = (frame, math.inf)
                    continue
                self.end(f"{self.name(gone[0])} left the job ({self.left[gone[0]]}) while "
                         f"the others wait for it in a collective it never joined (rank "
                         f"{self.rank} waited {self.grace:g} s: MPISTRAT_HEALTH_LEAVE_GRACE)",
                         frame=frame)
                return

    # -- ending the job ----------------------------------------------------------------
    def end(self, cause: str, told: bool = False, frame=None) -> None:
        """Print the named error on this rank and end the job (rank 0 tells every rank)."""
        with self._lock:
            if self._ending or self._leaving:
                return
            self._ending = True
        if frame is None:
            frame = sys._current_frames().get(threading.main_thread().ident)
            frame = wait_sites.waiting_frame(frame) or frame
        tag = f"[mpistrat rank {self.rank}/{self.size}]"
        sys.stderr.write(f"{tag} UnavailableError: {cause}; this rank "
                         f"{wait_sites.describe(frame)}; ending the job (mpistrat health "
                         f"check, see docs/troubleshooting.md)\n")
        sys.stderr.flush()
        if self.rank == 0:             # tell every rank, let them print, then abort
            for link in list(self._links.values()):
                try:
                    link.send({"t": "end", "cause": short(cause)})
                except OSError:
                    self._drop(link)
            self._await_closes(time.monotonic() + END_SECONDS)
            # Every rank has printed and flushed; the launcher forwards what they printed
            # through pipes that MPI_Abort's kill may cut (seen with MPICH's Hydra).
            time.sleep(OUTPUT_SECONDS)
        else:
            hub = self._links.get(0)
            if hub is not None and not told:
                try:
                    hub.send({"t": "abort", "cause": short(cause)})   # rank 0 tells the others
                except OSError:
                    hub = None
            for link in list(self._links.values()):
                self._drop(link)       # tells rank 0 that this rank has printed
            if hub is not None:
                time.sleep(END_SECONDS + 2)   # rank 0 aborts the job meanwhile
        _abort()

    def _await_closes(self, deadline: float) -> None:
        while self._links and time.monotonic() < deadline:
            for key, _ in self._selector.select(max(0.0, deadline - time.monotonic())):
                if key.data is not None:
                    try:
                        if key.data.receive() is not None:
                            continue
                    except (OSError, ValueError):
                        pass
                    self._drop(key.data)

    def leave(self) -> None:
        """This rank exits normally: tell rank 0 (rank 0 tells every rank), then close."""
        with self._lock:
            if self._leaving:
                return
            ending = self._ending
            self._leaving = not ending
        if ending:   # the watch thread is ending the job: never finalize under it
            time.sleep(END_SECONDS + 15)
            os._exit(EXIT_CODE)
        self._waker.send(b"x")
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2.0)
        last = getattr(sys, "last_value", None)
        why = (f"it exited after an uncaught {type(last).__name__}: {last}" if last is not None
               else "it exited normally")
        try:
            if self.rank == 0:
                self._relay([[0, short(why)]], self._unrelayed)
            elif 0 in self._links:
                self._links[0].send({"t": "leave", "why": short(why)})
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        for link in list(self._links.values()):
            self._drop(link)
        self._wake.close()
        self._waker.close()


def _abort() -> None:
    threading.Timer(10.0, os._exit, (EXIT_CODE,)).start()   # if MPI_Abort cannot end us
    MPI.COMM_WORLD.Abort(EXIT_CODE)


def start(comm: MPI.Comm) -> Optional[HealthCheck]:
    """Start the check over ``comm`` (collective; the world's communicator), or ``None``."""
    if comm.Get_size() == 1:
        return None
    on = settings.get("MPISTRAT_HEALTH_CHECK")
    facts = comm.allgather((on, socket.gethostname(), os.getpid(), place()))
    if len({f[0] for f in facts}) > 1:
        raise settings.SettingError(
            "MPISTRAT_HEALTH_CHECK differs between ranks (on at ranks "
            f"{[r for r, f in enumerate(facts) if f[0]]}, off at the others): set it alike")
    if not on:
        return None
    check = HealthCheck(comm, [f[1:3] for f in facts], settings.get("MPISTRAT_HEALTH_TIMEOUT"),
                        settings.get("MPISTRAT_HEALTH_LEAVE_GRACE"), [f[3] for f in facts])
    errors = [e for e in comm.allgather(check.connect(comm)) if e]
    if errors:
        check.close()
        if comm.Get_rank() == 0:
            warnings.warn(f"mpistrat health check off: {'; '.join(errors)} (rank 0 listened "
                          f"on {', '.join(check.listen_addresses())}; if a rank cannot route "
                          f"there, set MPISTRAT_COORDINATOR_HOST to an address of rank 0 every "
                          f"rank can reach; MPISTRAT_HEALTH_CHECK=0 turns the check off)",
                          stacklevel=2)
        return None
    _current["check"] = check
    check._thread.start()
    return check


def announce_abort(text: str) -> None:
    """This rank is about to end the job (the abort hook): tell the others why."""
    check = current()
    if check is not None and os.getpid() == check.pid and not check._leaving:
        with check._lock:
            if check._ending:
                return
            check._ending = True
        cause = f"{check.name(check.rank)} ended the job: {text}"
        for link in list(check._links.values()):
            try:
                link.send({"t": "end" if check.rank == 0 else "abort", "cause": short(cause)})
            except OSError:
                pass


def _at_exit() -> None:
    check = current()
    if check is not None and os.getpid() == check.pid:
        check.leave()


def _in_child() -> None:
    check = _current.pop("check", None)
    if check is not None:   # a forked child must not keep (or use) the parent's links
        for link in check._links.values():
            link.sock.close()


atexit.register(_at_exit)   # registered at import, before the library's other exit handlers,
os.register_at_fork(after_in_child=_in_child)   # so it runs after them (LIFO)
