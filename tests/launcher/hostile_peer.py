"""Another local user attacking a job's start-up (run as that user by
tests/launcher/test_health_strangers.py; standard library only).

    python hostile_peer.py SECONDS

Reads the job's ports from standard input, one a line (the test finds rank 0's listening
socket, as an attacker scanning the node's ports would; /proc/net/tcp, which every user can
read, lists it with its owner's uid), and attacks each one: hellos with a lone surrogate in the token, a
1 GB claim, garbage, forged ``abort``/``end`` lines, and a flood of silent connections,
reopened as fast as rank 0 closes them, until SECONDS have passed since the first port came
(so a job slow to start, on a loaded machine, is attacked as long as a quick one; without any
port it gives up after a minute). Prints ``ready`` when it watches, and what it did as one line
of JSON at the end."""

import json
import os
import resource
import select
import socket
import sys
import time

ATTACKS = [
    b'{"t": "hello", "rank": 1, "token": "\\ud800"}\n',                 # a lone surrogate
    b'{"t": "hello", "rank": 1, "token": "\\udfff\\ud800' + b"a" * 60 + b'"}\n',
    b'{"t": "hello", "length": 1000000000, "data": "' + b"x" * (1 << 20),  # a 1 GB claim
    b"\x00\xff\xfe not json at all\n",
    b'{"t": "abort", "cause": "forged"}\n',
    b'{"t": "end", "cause": "forged"}\n',
    b"[" * 255 + b"\n",
]


def owner(port: int) -> int:
    """The uid that /proc/net/tcp names for the listening socket on 127.0.0.1:port."""
    with open("/proc/net/tcp") as f:
        for row in f.readlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[1] == f"0100007F:{port:04X}":
                return int(cols[7])
    return -1


def new_ports() -> list:
    ports = []
    while select.select([sys.stdin], [], [], 0)[0]:
        line = sys.stdin.readline()
        if not line:
            break
        ports.append(int(line))
    return ports


def main() -> None:
    seconds = float(sys.argv[1])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    flood = min(hard - 64, 2000)
    end = time.monotonic() + 60.0        # until the first port; then SECONDS from it
    done = {"ports": [], "attacks": 0, "opened": 0, "refused": 0, "as_uid": os.getuid(),
            "owners": []}
    held = []
    print("ready", flush=True)
    while time.monotonic() < end:
        for port in new_ports():
            if not done["ports"]:
                end = time.monotonic() + seconds
            done["ports"].append(port)
            done["owners"].append(owner(port))
            for payload in ATTACKS:
                try:
                    sock = socket.create_connection(("127.0.0.1", port), timeout=1)
                    sock.sendall(payload)
                    held.append(sock)
                    done["attacks"] += 1
                except OSError:
                    done["refused"] += 1
        # the flood: silent connections to every port found, topped up as rank 0 drops them
        for port in done["ports"]:
            alive = []
            for sock in held:
                try:
                    sock.setblocking(False)
                    if sock.recv(1) == b"":
                        sock.close()
                        continue
                except BlockingIOError:
                    pass
                except OSError:
                    sock.close()
                    continue
                alive.append(sock)
            held = alive
            while len(held) < flood and time.monotonic() < end:
                try:
                    held.append(socket.create_connection(("127.0.0.1", port), timeout=0.5))
                    done["opened"] += 1
                except OSError:
                    done["refused"] += 1
                    break
        if not done["ports"]:
            time.sleep(0.0005)
    print(json.dumps(done), flush=True)


if __name__ == "__main__":
    main()
