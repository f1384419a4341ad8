"""``python -m mpistrat info``: the table on rank 0, the facts, and ``--json``; ``tune``
into a missing directory; ``doctor`` on a working set-up at 1-3 ranks and on broken ones."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from mpistrat.__main__ import render
from tests.conftest import MPIRUN

# The MPI the launched ranks load: the one this process loads ("Open MPI v4.1.4, ..." or
# "MPICH Version: 4.0.2 ...", as mpistrat info shows it), and the standard it speaks.
LIBRARY = " ".join(MPI.Get_library_version().split()[:2])
STANDARD = f"(MPI {MPI.Get_version()[0]}."

INFO = "import sys, runpy\nsys.argv = ['mpistrat', 'info'] + sys.argv[1:]\n" \
       "runpy.run_module('mpistrat', run_name='__main__')\n"


def test_info_prints_one_row_per_rank_then_the_facts(launch):
    result = launch(3, INFO, limit=60)
    assert result.returncode == 0, result
    assert "\x00" not in result.output
    lines = result.output.splitlines()
    assert lines[0].split()[:5] == ["rank", "host", "node", "local", "rank"], result
    rows = [line.split() for line in lines[1:4]]
    assert [r[0] for r in rows] == ["0", "1", "2"], result
    assert [r[3] for r in rows] == ["0/3", "1/3", "2/3"] and all(r[5] == "host-mpi" for r in rows)
    assert sum(line.startswith("rank ") for line in lines) == 1, "only rank 0 prints"
    facts = {line[:16].strip(): line[16:] for line in lines[5:] if line[:16].strip()}
    assert facts["MPI"].startswith(LIBRARY) and STANDARD in facts["MPI"], result
    assert re.fullmatch(r"MPI_THREAD_\w+", facts["thread level"]), result
    assert facts["CUDA-aware MPI"].startswith(("yes: ", "no: ")), result
    assert "parallel (MPI-IO): yes" in facts["h5py"], result
    import jax
    assert facts["JAX"].startswith(jax.__version__), result
    assert facts["Slurm"] == "not inside an allocation", result


def test_info_json_is_one_document_on_rank_0(launch):
    result = launch(2, INFO, "--json", limit=60)
    assert result.returncode == 0, result
    document = json.loads(result.output[result.output.index("{"):])
    rows = document["ranks"]
    assert [r["rank"] for r in rows] == [0, 1] and all(r["size"] == 2 for r in rows)
    assert all(r["h5py_mpi"] is True and r["mpi"].startswith(LIBRARY) for r in rows)
    assert all("\x00" not in r["mpi"] for r in rows)
    assert rows[0]["jax_devices"] and rows[1]["jax_devices"] is None  # JAX once per node
    assert all(r["backends"]["numpy"] == "host-mpi" for r in rows)


def _row(rank, **changes):
    row = {"rank": rank, "size": 2, "host": f"n{rank}", "node": rank, "nodes": 2, "local_rank": 0,
           "local_size": 1, "device": "GPU 0 (H200)",
           "backends": {"numpy": "host-mpi", "cupy": "staged-host-mpi", "jax": None},
           "mpi": "Open MPI v4.1.6", "mpi_standard": "3.1", "mpi4py": "4.1",
           "thread_level": "MPI_THREAD_MULTIPLE", "cuda_aware_mpi": False,
           "cuda_aware_mpi_how": "asked", "nccl": True, "nccl_how": "imported", "h5py": "3.16",
           "hdf5": "1.14", "h5py_mpi": False, "checkpoint_mode": "parts", "cupy": "14.0",
           "gpus": ["H200"], "jax": None, "jax_devices": [],
           "slurm": {"SLURM_JOB_ID": "7", "SLURM_NNODES": "2"}}
    row.update(changes)
    return row


def test_render_names_disagreements_and_the_allocation():
    text = render([_row(0), _row(1, cuda_aware_mpi=True)])
    assert "GPU 0 (H200)" in text and "(not installed)" in text
    assert "CUDA-aware MPI  no: asked  (differs across ranks" in text
    assert "Slurm           job_id=7, nnodes=2" in text
    assert "JAX             not installed" in text


def test_info_tells_host_jax_arrays_truly(launch):
    """issue 16: CPU JAX arrays were described as "device memory copied through pinned host
    buffers"; on a CPU host they are read in place and reduced by the host algorithms."""
    result = launch(1, INFO, "--json", limit=60)
    assert result.returncode == 0, result
    row = json.loads(result.output[result.output.index("{"):])["ranks"][0]
    assert row["jax_platform"] == "cpu"
    jax_paths = [p for p in row["collective_paths"] if p["kind"] == "jax"]
    assert jax_paths and all(p["why"].startswith("host (CPU) JAX arrays: read in place")
                             and "pinned" not in p["why"] for p in jax_paths), jax_paths


def test_jax_paths_on_gpus_without_cupy_say_what_copies():
    import doctest
    import mpistrat.__main__ as main
    assert doctest.testmod(main).failed == 0
    row = {"kind": "jax", "bytes": 1 << 20, "backend": "staged-host-mpi", "algorithm": "ring",
           "why": "device memory copied through pinned host buffers; large"}
    told = main.jax_paths_told_truly([row], "gpu", cupy=False)[0]["why"]
    assert told.startswith("JAX GPU arrays copied whole to host memory by JAX") and \
        told.endswith("; large")
    assert main.jax_paths_told_truly([row], "gpu", cupy=True)[0]["why"] == row["why"]
    other = dict(row, kind="cupy")
    assert main.jax_paths_told_truly([other], "cpu", False) == [other]


TUNE = "import sys, runpy\nsys.argv = ['mpistrat', 'tune'] + sys.argv[1:]\n" \
       "runpy.run_module('mpistrat', run_name='__main__')\n"


def test_tune_into_a_missing_directory_fails_naming_it(launch, tmp_path):
    """Before, the command warned and exited 0 with no file written."""
    target = tmp_path / "missing" / "tuning.json"
    result = launch(2, TUNE, "--output", str(target), "--budget", "0.3", limit=120)
    assert result.returncode != 0, result
    assert f"could not write the tuning file {target}" in result.output, result
    assert not target.exists()


DOCTOR = "import sys, runpy\nsys.argv = ['mpistrat', 'doctor'] + sys.argv[1:]\n" \
         "runpy.run_module('mpistrat', run_name='__main__')\n"


def _rows(output):
    return {line[:17].strip(): line[17:].split(None, 1) for line in output.splitlines()
            if line[:17].strip() and line[17:21].strip() in ("PASS", "FAIL", "SKIP")}


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_doctor_passes_on_a_working_set_up(launch, tmp_path, ranks):
    result = launch(ranks, DOCTOR, "--dir", str(tmp_path / "ckpt"), limit=120,
                    env={"OMP_NUM_THREADS": "1"})     # (3 ranks on 2 cores: one thread each)
    assert result.returncode == 0, result
    rows = _rows(result.output)
    assert set(rows) == {"MPI launch", "settings", "libraries", "ranks and nodes", "threads",
                         "collectives", "GPUs", "arrays", "h5py", "checkpoint dir",
                         "Slurm"}, result
    assert rows["ranks and nodes"][1].startswith(f"{ranks} ranks on 1 node(s)"), result
    assert all(status != "FAIL" for status, _ in rows.values()), result
    assert "ready: every check passed" in result.output
    assert "(it did not exist: this check created it)" in rows["checkpoint dir"][1], result
    assert os.listdir(tmp_path / "ckpt") == []         # it cleaned up after itself


def _mpi_of_this_venv() -> str:
    from mpi4py import MPI
    return "MPICH" if "MPICH" in MPI.Get_library_version() else "Open MPI"


def test_doctor_names_more_ranks_than_cores_with_threads_unset(tmp_path):
    cores = len(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))
           and k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONUNBUFFERED"] = "1"
    (tmp_path / "job.py").write_text(DOCTOR)
    done = subprocess.run([str(MPIRUN), "--limit", "120", "-n", str(cores + 1), sys.executable,
                           str(tmp_path / "job.py"), "--dir", str(tmp_path), "--json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 1, done.stdout + done.stderr
    checks = {c["check"]: c for c in json.loads(done.stdout[done.stdout.index("{"):])["checks"]}
    assert checks["threads"]["status"] == "fail", checks
    assert f"{cores + 1} ranks on {cores} cores" in checks["threads"]["found"], checks
    assert "OMP_NUM_THREADS=1" in checks["threads"]["fix"]
    assert checks["collectives"]["status"] == "pass"   # the rest still ran


def test_doctor_names_settings_that_differ_between_ranks_in_its_table_and_json(tmp_path):
    command = [str(MPIRUN), "--limit", "120", "-n", "1", sys.executable, "-m", "mpistrat",
               "doctor", "--dir", str(tmp_path), "--json", ":", "-n", "1", "env",
               "MPISTRAT_VALIDATE=0", sys.executable, "-m", "mpistrat", "doctor", "--dir",
               str(tmp_path), "--json"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))
           and (not k.startswith("MPISTRAT_") or k == "MPISTRAT_MPI")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    checks = json.loads(done.stdout[done.stdout.index("{"):])["checks"]
    assert checks[0]["check"] == "settings" and checks[0]["status"] == "fail", checks
    assert "MPISTRAT_VALIDATE differs between ranks" in checks[0]["found"], checks


def test_doctor_names_missing_jax_for_jax_arrays(tmp_path):
    """--arrays jax in an environment where jax cannot be imported (hidden by a module that
    raises ImportError first on the path): the arrays check fails naming it."""
    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "jax.py").write_text("raise ImportError('No module named jax')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    env["PYTHONPATH"] = f"{tmp_path / 'hide'}:{Path(__file__).resolve().parents[2]}"
    done = subprocess.run([sys.executable, "-m", "mpistrat", "doctor", "--dir", str(tmp_path),
                           "--arrays", "jax", "--json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    checks = {c["check"]: c for c in json.loads(done.stdout[done.stdout.index("{"):])["checks"]}
    assert checks["arrays"]["status"] == "fail", checks
    assert "No module named jax" in checks["arrays"]["found"], checks
    assert "mpistrat[jax]" in checks["arrays"]["fix"]


def test_doctor_names_an_h5py_built_for_the_other_mpi_instead_of_crashing(tmp_path):
    """pip's cache handed this environment the other MPI's h5py (here: the other test
    environment's h5py, first on the path): doctor reads the shared libraries before anything
    loads it, names it with the fix and exits 1 (before: a segfault inside libhdf5)."""
    other = ".venv" if _mpi_of_this_venv() == "MPICH" else ".venv-mpich"
    root = Path(__file__).resolve().parents[2]
    found = sorted((root / other).glob("lib/python3*/site-packages/h5py"))
    if not found:
        pytest.skip(f"{other} (the other MPI's environment) has no h5py")
    (tmp_path / "other").mkdir()
    os.symlink(found[0], tmp_path / "other" / "h5py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    env["PYTHONPATH"] = f"{tmp_path / 'other'}:{root}"
    done = subprocess.run([sys.executable, "-m", "mpistrat", "doctor", "--dir", str(tmp_path),
                           "--json"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    checks = {c["check"]: c for c in json.loads(done.stdout[done.stdout.index("{"):])["checks"]}
    other_mpi = "Open MPI" if other == ".venv" else "MPICH"
    assert checks["libraries"]["status"] == "fail", checks
    assert f"h5py is linked to {other_mpi}" in checks["libraries"]["found"], checks
    assert "--no-cache-dir" in checks["libraries"]["fix"]
    assert "Segmentation" not in done.stdout + done.stderr


def test_doctor_json_is_one_document_with_every_check(launch, tmp_path):
    result = launch(2, DOCTOR, "--dir", str(tmp_path), "--json", limit=120)
    assert result.returncode == 0, result
    document = json.loads(result.output[result.output.index("{"):])
    assert [c["status"] for c in document["checks"]].count("fail") == 0
    assert {c["check"] for c in document["checks"]} >= {"collectives", "checkpoint dir"}


def test_doctor_fails_naming_a_directory_the_ranks_do_not_share(launch, tmp_path):
    """Each rank names its own directory (node-local scratch): the checkpoint check fails on
    every rank, with the fix; the exit status is 1."""
    script = ("import os, sys\n"
              "rank = os.environ.get('OMPI_COMM_WORLD_RANK') or os.environ['PMI_RANK']\n"
              "sys.argv[2] = os.path.join(sys.argv[2], rank)\n"
              + DOCTOR)
    result = launch(2, script, "--dir", str(tmp_path), limit=120)
    assert result.returncode == 1, result
    rows = _rows(result.output)
    assert rows["checkpoint dir"][0] == "FAIL", result
    assert "fix: name a directory on a file system that every node mounts" in result.output
    assert rows["collectives"][0] == "PASS"


def test_doctor_names_a_singleton_start(tmp_path):
    """An mpi4py built for another MPI: the launcher (here MPICH's PMI_SIZE) started 4 ranks,
    MPI sees one. The check fails with the rebuild as its fix."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    env.update(PMI_SIZE="4", PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, "-m", "mpistrat", "doctor", "--dir", str(tmp_path)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the launcher started 4 ranks but MPI sees 1" in done.stdout, done.stdout
    assert "--no-binary=mpi4py" in done.stdout


@pytest.mark.parametrize("launcher_env", [{"PMI_SIZE": "4"},
                                          {"SLURM_STEP_NUM_TASKS": "4", "SLURM_MPI_TYPE": "pmix"}])
def test_a_singleton_start_is_refused_by_the_strategy_before_anything_trains(tmp_path,
                                                                              launcher_env):
    """A real mpi4py singleton told by its environment that the launcher started 4 ranks:
    without the refusal it trains alone and writes the checkpoint the other 3 also write."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    env.update(launcher_env, PYTHONUNBUFFERED="1")
    script = ("import mpistrat as ms\n"
              "try:\n"
              "    ms.MultiWorkerMirroredStrategy()\n"
              "except ms.errors.UnavailableError as err:\n"
              "    print('refused:', err)\n"
              "else:\n"
              "    print('trained alone')\n")
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "refused: " in done.stdout and "but MPI sees a world of 1 rank" in done.stdout, \
        done.stdout + done.stderr
    assert "trained alone" not in done.stdout
