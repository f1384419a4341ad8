"""The health check's start-up as another user's process meets it (issue 31): rank 0 listens
only on the addresses it offers, and a connection joins only with the job's token, sent over
MPI. A hostile process in rank 0's host that finds the port while the ranks connect and sends
`abort`, `end`, garbage, a hello without the token, a line that claims 1 GB and never ends,
or nothing at all, is dropped and logged; the ranks join and nothing ends. A hello whose token
holds a lone surrogate is one more dropped connection (it once raised past the hello check and
ended the job), and a flood of silent connections, more than rank 0 keeps waiting at once, costs
the flooder its own connections: the ranks still join (issue 42). The same attacks from another
user's processes, against real launches: tests/launcher/test_health_strangers.py."""

import os
import socket
import threading
import time

import numpy as np
import pytest

from mpistrat.runtime import health, peer_links

pytestmark = pytest.mark.numpy_only("sockets of the health check")

ATTACKS = {
    "abort": b'{"t": "abort", "cause": "rank 1 died (forged)"}\n',
    "end": b'{"t": "end", "cause": "forged end"}\n',
    "garbage": b"\x00\xff\xfe not json at all\n",
    "no token": b'{"t": "hello", "rank": 1}\n',
    "1 GB claim": b'{"t": "hello", "length": 1000000000, "data": "' + b"x" * (4 << 20),
    "silent": b"",
    "surrogate": b'{"t": "hello", "rank": 1, "token": "\\ud800"}\n',
    "huge rank": b'{"t": "hello", "rank": 1e999, "token": "x"}\n',
}
WORDS = {"abort": "lacks this job's token", "end": "lacks this job's token",
         "garbage": "not JSON", "no token": "lacks this job's token",
         "1 GB claim": "without a hello", "silent": "no hello when the ranks had joined",
         "surrogate": "lacks this job's token", "huge rank": "lacks this job's token"}


def _listening() -> set:
    """(address, port) of this process's listening IPv4 TCP sockets (/proc/net/tcp)."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    found = set()
    with open("/proc/net/tcp") as f:
        for row in f.readlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in mine:          # LISTEN, one of ours
                address, port = cols[1].split(":")
                found.add((socket.inet_ntoa(bytes.fromhex(address)[::-1]), int(port, 16)))
    return found


def _check(comm):
    """A health check over ``comm`` with every rank's real host, pid and place."""
    facts = comm.allgather((socket.gethostname(), os.getpid(), peer_links.place()))
    return health.HealthCheck(comm, [f[:2] for f in facts], 10.0, 3.0, [f[2] for f in facts])


def _new_listeners(before: set, outcome: dict) -> list:
    """Rank 0's listening sockets once they appear (at most 10 s), noted in ``outcome``."""
    deadline = time.monotonic() + 10
    targets = set()
    while not targets and time.monotonic() < deadline:
        targets = _listening() - before
        time.sleep(0.001)
    outcome["targets"] = sorted(targets)
    return outcome["targets"]


def _attack(before: set, outcome: dict) -> None:
    """Wait for rank 0's new listeners, then connect to each and send every attack."""
    targets = _new_listeners(before, outcome)
    socks = [(socket.create_connection(target, timeout=5), payload)
             for target in sorted(targets) for payload in ATTACKS.values()]
    for sock, payload in socks:
        try:
            sock.sendall(payload)
        except OSError:              # rank 0 dropped it while we still sent: as it should
            pass
    outcome["sent"] = len(socks)
    time.sleep(3)                    # (the silent ones stay open while the ranks join)
    for sock, _ in socks:
        sock.close()


@pytest.mark.mpi(min_size=2)
def test_hostile_connections_during_start_up_are_dropped_and_the_ranks_join(world):
    comm = world.comm.Dup()
    check = _check(comm)
    outcome: dict = {}
    try:
        if world.rank == 0:
            attacker = threading.Thread(target=_attack, args=(_listening(), outcome))
            attacker.start()
            with pytest.warns(UserWarning) as caught:
                error = check.connect(comm)
            attacker.join()
        else:
            time.sleep(2.0)          # the attacker's connections reach rank 0 first
            error = check.connect(comm)
        assert error is None, error
        assert sorted(check._links) == ([0] if world.rank else list(range(1, world.size)))
        assert not check._ending
        if world.rank == 0:
            texts = [str(w.message) for w in caught]
            assert outcome["targets"] and all(not a.startswith("0.0.0.0")
                                              for a, _ in outcome["targets"])
            if len(set(check.places)) == 1:   # every rank on rank 0's host: loopback only
                assert {a for a, _ in outcome["targets"]} == {"127.0.0.1"}, outcome
            for name, words in WORDS.items():
                assert sum(words in t for t in texts) >= 1, (name, texts)
            assert len(texts) >= len(WORDS) * len(outcome["targets"]), texts
        # the links joined are the ranks': a leave notice from each rank reaches rank 0
        if world.rank:   # (sent at once: rank 0 may not have read the hello yet)
            check._links[0].send({"t": "leave", "why": "test"})
        else:
            for rank, link in check._links.items():
                link.sock.settimeout(10)
                assert link.receive() == [{"t": "leave", "why": "test"}], rank
        total = world.comm.allreduce(world.rank + 1)
        assert total == world.size * (world.size + 1) // 2
    finally:
        check.close()
        comm.Free()


def _flood(before: set, outcome: dict, count: int) -> None:
    """Wait for rank 0's listeners, then hold ``count`` silent connections to each, opening
    a new one whenever rank 0 closes one, until the ranks have joined."""
    targets = _new_listeners(before, outcome)
    held, opened = [], 0
    for target in sorted(targets):
        for _ in range(count):
            try:
                held.append(socket.create_connection(target, timeout=5))
                opened += 1
            except OSError:
                break
    outcome["opened"] = opened
    outcome["flooded"].set()
    outcome["done"].wait(20)
    for sock in held:
        sock.close()


@pytest.mark.mpi(min_size=2)
def test_a_flood_of_silent_connections_costs_the_flooder_and_the_ranks_join(world):
    comm = world.comm.Dup()
    check = _check(comm)
    count = peer_links.MAX_PENDING + 100
    outcome: dict = {"flooded": threading.Event(), "done": threading.Event()}
    try:
        if world.rank == 0:
            flooder = threading.Thread(target=_flood, args=(_listening(), outcome, count))
            flooder.start()
            with pytest.warns(UserWarning) as caught:
                error = check.connect(comm)
            outcome["done"].set()
            flooder.join()
        else:
            time.sleep(4.0)          # the flood is in place before the ranks dial
            error = check.connect(comm)
        assert error is None, error
        assert sorted(check._links) == ([0] if world.rank else list(range(1, world.size)))
        if world.rank == 0:
            # (well past the per-source bound: the oldest were closed while the ranks joined;
            # on a loaded machine the ranks may join before all ``count`` are open)
            assert outcome["opened"] > 2 * peer_links.PENDING_PER_SOURCE, outcome
            texts = [str(w.message) for w in caught]
            assert any("without a hello (the oldest goes)" in t for t in texts), texts
            assert any("more connections that proved nothing" in t for t in texts), texts
            assert len(texts) <= peer_links.WARNED_DROPS + 1, len(texts)
        if world.rank:   # the links are the ranks': a message from each reaches rank 0
            check._links[0].send({"t": "leave", "why": "flood test"})
        else:
            for rank, link in check._links.items():
                link.sock.settimeout(10)
                assert link.receive() == [{"t": "leave", "why": "flood test"}], rank
    finally:
        check.close()
        comm.Free()
