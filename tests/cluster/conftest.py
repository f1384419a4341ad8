"""A real multi-host cluster for the tests in this directory (``scripts/cluster``).

The session fixture ``cluster`` brings up ``head`` + ``node1..node3`` (Linux namespaces on
a bridge) with Slurm, and takes everything down at the end, also after failures. Tests
launch jobs on it through Open MPI over the rsh agent (``mpirun``) or through Slurm
(``srun --mpi=pmix``), in a layout of H hosts x R ranks (``2x2`` or ``3x1``). Where the
machine refuses namespaces, every test here is skipped with that reason.

Run: ``.venv/bin/python -m pytest tests/cluster`` (as root, outside MPI).
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "scripts" / "cluster"
HOSTS = 3             # node1..node3; layouts use the first H of them
RANKS_PER_HOST = 2
LAUNCHERS = ["mpirun", "srun"]
LAYOUTS = ["2x2", "3x1"]

# Defines say(): one write per line, so lines of different ranks do not interleave.
PRELUDE = (
    "import sys as _sys\n"
    "def say(*parts):\n"
    "    _sys.stdout.write(' '.join(str(p) for p in parts) + '\\n')\n"
    "    _sys.stdout.flush()\n"
)


def namespaces_refused():
    """Why this machine cannot build namespace hosts, or ``None`` when it can."""
    if sys.platform != "linux":
        return "namespace hosts need Linux"
    probe = "true"
    if shutil.which("ip"):   # the links that scripts/cluster up makes, in a throwaway namespace
        probe = ("ip link add mpistrat-b0 type bridge && "
                 "ip link add mpistrat-v0 type veth peer name mpistrat-v1")
    try:
        done = subprocess.run(["unshare", "--net", "--uts", "--mount", "--propagation",
                               "private", "/bin/sh", "-c", probe], capture_output=True, text=True,
                              timeout=20)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unshare is unusable here: {err}"
    if done.returncode != 0:
        return (f"namespaces are refused here ({done.stderr.strip() or 'unshare failed'}); "
                f"the cluster needs CAP_SYS_ADMIN and CAP_NET_ADMIN")
    return None


def parse_layout(layout: str):
    hosts, per_host = layout.split("x")
    return int(hosts), int(per_host)


def expected_host(rank: int, layout: str) -> str:
    """Block placement, as both mpirun --host and srun's default distribution do it."""
    return f"node{rank // parse_layout(layout)[1] + 1}"


class Launched:
    """The outcome of a job on the cluster."""

    def __init__(self, returncode: int, output: str, seconds: float, command):
        self.returncode, self.output, self.seconds = returncode, output, seconds
        self.command = command

    def rows(self):
        """The JSON objects that the job printed, one per line."""
        return [json.loads(line) for line in self.output.splitlines() if line.startswith("{")]

    def __repr__(self):
        return (f"<{' '.join(map(str, self.command[:12]))} ...: exit {self.returncode} after "
                f"{self.seconds:.1f}s>\n{self.output[-5000:]}")


def job_env(extra=None):
    """This process's environment without its own MPI/Slurm identity, importing our mpistrat."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "SLURM_"))}
    env.pop("MPISTRAT_COLLECTIVE_TIMEOUT", None)
    env.pop("MPISTRAT_RANKS_PER_NODE", None)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


class Cluster:
    """Handle on the running cluster: run commands on hosts, launch jobs."""

    def __init__(self):
        self.state_dir = Path(os.environ.get("MPISTRAT_CLUSTER_DIR", "/run/mpistrat-cluster"))

    def script(self, *args, timeout=120, check=True, env=None, cwd=None):
        done = subprocess.run([str(CLUSTER), *map(str, args)], capture_output=True, text=True,
                              timeout=timeout, env=job_env(env), cwd=cwd or ROOT)
        if check and done.returncode != 0:
            raise RuntimeError(f"scripts/cluster {' '.join(map(str, args))} failed "
                               f"({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done

    def command(self, launcher: str, layout: str, argv, nprocs=None, limit=120):
        """The command line that starts ``argv`` on every rank of ``layout``."""
        hosts, per_host = parse_layout(layout)
        n = nprocs or hosts * per_host
        if launcher == "mpirun":
            return [str(CLUSTER), "mpirun", "--limit", str(limit), "--layout", layout,
                    "-n", str(n), *argv]
        if launcher == "srun":
            return [str(CLUSTER), "run", "node1", "timeout", "--signal=TERM",
                    "--kill-after=10", str(limit), "srun", f"--nodes={hosts}",
                    f"--ntasks={n}", f"--ntasks-per-node={per_host}", "--mpi=pmix",
                    "--kill-on-bad-exit=1", *argv]
        raise ValueError(f"unknown launcher {launcher!r}")

    def launch(self, launcher: str, layout: str, argv, cwd, nprocs=None, limit=120, env=None):
        command = self.command(launcher, layout, argv, nprocs, limit)
        start = time.monotonic()
        done = subprocess.run(command, cwd=cwd, env=job_env(env), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=limit + 60)
        return Launched(done.returncode, done.stdout, time.monotonic() - start, command)


    def sbatch(self, script, *options, cwd, out_dir, env=None, timeout=180):
        """Submit ``script`` from node1 in ``cwd``, wait for it to leave the queue.

        Returns ``scontrol show job``'s text and the job's output (kept in ``out_dir``)."""
        out = Path(out_dir) / "slurm-%j.out"
        done = subprocess.run([str(CLUSTER), "run", "node1", "sbatch", "--parsable",
                               f"--output={out}", *options, str(script)], cwd=cwd,
                              env=job_env(env), capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch failed: {done.stdout}{done.stderr}")
        job_id = done.stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:   # polling squeue beats sbatch --wait's 10 s polls
            state = self.script("run", "head", "squeue", "-h", "-j", job_id, "-o", "%T",
                                check=False).stdout.strip()
            if state in ("", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                break
            time.sleep(0.5)
        else:
            self.script("run", "head", "scancel", job_id, check=False)
            raise TimeoutError(f"Slurm job {job_id} still {state} after {timeout}s")
        info = self.script("run", "head", "scontrol", "show", "job", job_id, check=False).stdout
        path = Path(str(out).replace("%j", job_id))
        return info, path.read_text() if path.exists() else ""


def cluster_pids(state: Path):
    """The pids of the hosts' holders and of the daemons, from the cluster's state files."""
    pids = []
    for pattern in ("pids/*", "slurm/*.pid", "munge/*.pid"):
        for path in state.glob(pattern):
            text = path.read_text().strip()
            if text.isdigit():
                pids.append(int(text))
    return pids


def leftovers(state: Path, pids):
    """What a cluster left on this machine: network namespaces, state, live processes."""
    found = [line.split()[0] for line in subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
        if line.startswith("mpistrat-")]
    if state.exists():
        found.append(str(state))
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if "\nState:\tZ" not in status:
            found.append(f"pid {pid}")
    return found


@pytest.fixture(scope="session")
def cluster():
    reason = namespaces_refused()
    if reason:
        pytest.skip(reason)
    handle = Cluster()
    handle.script("down", timeout=60, check=False)   # leftovers of a crashed run
    pids = []
    try:
        handle.script("up", HOSTS, RANKS_PER_HOST, timeout=300)
        handle.script("slurm-up", timeout=300)
        yield handle
    finally:
        pids = cluster_pids(handle.state_dir)
        handle.script("down", timeout=120, check=False)
    left = leftovers(handle.state_dir, pids)
    assert not left, f"scripts/cluster down left: {left}"


@pytest.fixture
def job(cluster, tmp_path):
    """``job(launcher, layout, script, *args)``: run a Python script on every rank."""

    def run(launcher, layout, script, *args, nprocs=None, limit=120, env=None):
        path = tmp_path / "job.py"
        path.write_text(PRELUDE + script)
        return cluster.launch(launcher, layout, [sys.executable, str(path), *map(str, args)],
                              cwd=tmp_path, nprocs=nprocs, limit=limit, env=env)

    return run
