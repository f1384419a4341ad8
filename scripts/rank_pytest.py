"""Run pytest on one MPI rank: rank 0 prints to the terminal, other ranks to log files.

Usage (under mpirun): python scripts/rank_pytest.py LOG_PREFIX [pytest args...]
Rank r > 0 writes LOG_PREFIX.rank<r>.log; scripts/test.sh shows those logs
when a run fails, so the rank that failed or hung is always visible.
"""

import os
import sys

# The rank from the launcher's environment, before MPI starts: Open MPI, PMIx (srun --mpi=pmix),
# MPICH's Hydra and PMI-2 (PMI_RANK).
rank = next((int(os.environ[k]) for k in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
             if os.environ.get(k, "").isdigit()), 0)
prefix = sys.argv[1]
if rank != 0:
    fd = os.open(f"{prefix}.rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)

import pytest  # noqa: E402

sys.exit(pytest.main(["--with-mpi"] + sys.argv[2:]))
