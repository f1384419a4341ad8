"""scripts/cluster itself: isolation of the hosts, shaping, and clear errors on bad input
that leave the running cluster as it was."""

import shutil
import subprocess

import pytest

from .conftest import CLUSTER, HOSTS, RANKS_PER_HOST

pytestmark = pytest.mark.timeout(120)


def healthy(cluster):
    status = cluster.script("status").stdout
    return f"up, {HOSTS} hosts x {RANKS_PER_HOST} ranks" in status


def test_hosts_have_their_own_name_network_and_shared_memory(cluster):
    links = cluster.script("run", "node2", "ip", "-br", "link").stdout.split()
    assert "lo" in links and any(name.startswith("eth0") for name in links), links
    assert cluster.script("run", "node2", "hostname").stdout.strip() == "node2"
    routes = cluster.script("run", "node2", "ip", "route").stdout
    assert "default" not in routes and "198.18.0.0/24" in routes, routes
    hosts = cluster.script("run", "node1", "cat", "/etc/hosts").stdout
    assert "198.18.0.254 head" in hosts and f"198.18.0.{HOSTS} node{HOSTS}" in hosts
    # Nothing in the machine's own network namespace.
    own = subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True).stdout
    assert "198.18.0." not in own, own
    # /dev/shm is each host's own.
    cluster.script("run", "node1", "sh", "-c", "echo x > /dev/shm/mpistrat-cluster-probe")
    try:
        seen = cluster.script("run", "node2", "ls", "/dev/shm").stdout
        assert "mpistrat-cluster-probe" not in seen
    finally:
        cluster.script("run", "node1", "rm", "-f", "/dev/shm/mpistrat-cluster-probe")


def test_shape_puts_tbf_on_both_ends_of_every_link_and_off_removes_it(cluster):
    try:
        cluster.script("shape", "1gbit")
        for i in range(1, HOSTS + 1):
            node = cluster.script("run", f"node{i}", "tc", "qdisc", "show", "dev", "eth0").stdout
            head = cluster.script("run", "head", "tc", "qdisc", "show", "dev", f"sw{i}").stdout
            assert "tbf" in node and "rate 1Gbit" in node, node
            assert "tbf" in head and "rate 1Gbit" in head, head
        assert "links: 1gbit" in cluster.script("status").stdout
    finally:
        cluster.script("shape", "off")
    node = cluster.script("run", "node1", "tc", "qdisc", "show", "dev", "eth0").stdout
    assert "tbf" not in node and "links: unshaped" in cluster.script("status").stdout


@pytest.mark.parametrize("args,message", [
    (["up", "0"], "host count from 1 to 16"),
    (["up", "17"], "host count from 1 to 16"),
    (["up", "three"], "host count from 1 to 16"),
    (["up", "2", "0"], "RANKS_PER_HOST must be from 1 to 64"),
    (["up", "2", "2"], f"already up ({HOSTS} hosts x {RANKS_PER_HOST} ranks)"),
    (["mpirun", "-n", str(HOSTS * RANKS_PER_HOST + 1), "true"], "do not fit"),
    (["mpirun", "--layout", f"{HOSTS + 1}x1", "true"], f"the cluster has {HOSTS}"),
    (["run", "node9", "true"], "no host 'node9'"),
    (["shape", "fast"], "tc refused rate 'fast'"),
])
def test_bad_input_is_refused_clearly_and_the_cluster_stays_up(cluster, args, message):
    done = cluster.script(*args, check=False)
    assert done.returncode != 0, done
    assert message in done.stderr, done.stderr
    assert healthy(cluster)


def test_up_again_with_the_same_layout_is_a_no_op(cluster):
    done = cluster.script("up", HOSTS, RANKS_PER_HOST)
    assert "already up" in done.stderr
    assert healthy(cluster)


@pytest.mark.parametrize("dropped", ["-sys_admin,-net_admin", "-net_admin"])
def test_without_namespace_capabilities_up_says_so_and_changes_nothing(cluster, dropped):
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) is missing")
    done = subprocess.run(["setpriv", "--bounding-set", dropped, str(CLUSTER), "up", "2"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "cannot create namespaces here" in done.stderr, done.stderr
    assert "CAP_SYS_ADMIN" in done.stderr
    assert healthy(cluster)


def test_leftovers_of_a_crash_are_named_and_cleared_by_up(cluster):
    holder = (cluster.state_dir / "pids" / f"node{HOSTS}").read_text().strip()
    subprocess.run(["kill", "-9", holder], check=True)     # a host dies as in a crash
    for _ in range(50):
        status = cluster.script("status", check=False)
        if status.returncode != 0:
            break
        subprocess.run(["sleep", "0.1"])
    assert status.returncode != 0 and "broken (leftovers:" in status.stdout, status.stdout
    rebuilt = cluster.script("up", HOSTS, RANKS_PER_HOST, timeout=120)
    assert "removing leftovers of an earlier cluster" in rebuilt.stderr, rebuilt.stderr
    cluster.script("slurm-up", timeout=120)
    assert healthy(cluster)
    assert "idle" in cluster.script("status").stdout


def test_without_namespace_capabilities_the_tests_skip_with_the_reason(cluster, tmp_path):
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) is missing")
    import sys
    from .conftest import ROOT, job_env
    done = subprocess.run(
        ["setpriv", "--bounding-set", "-sys_admin,-net_admin", sys.executable, "-m", "pytest",
         "-q", "-rs", "--color=no", "-p", "no:cacheprovider",
         str(ROOT / "tests" / "cluster" / "test_script.py") + "::test_up_again_with_the_same_layout_is_a_no_op"],
        cwd=tmp_path, env=job_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 skipped" in done.stdout, done.stdout
    assert "namespaces are refused here" in done.stdout and "CAP_SYS_ADMIN" in done.stdout
    assert healthy(cluster)      # the skipped session did not touch the running cluster
