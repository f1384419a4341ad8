"""Did MPI start the ranks the launcher started? (pure functions of the environment)

A launcher that starts N processes through a channel their MPI does not speak (``srun
--mpi=pmix`` for an MPICH built for PMI-2, an ``mpirun`` of another MPI than mpi4py's) gives
N singletons: N worlds of one rank that each train alone and write the same checkpoint, with
no error. ``singleton_refusal`` names that case so ``World`` raises on every process;
``unwired_srun_note`` names srun steps started without an MPI plug-in (``--mpi=none``, a
site's default), which may be meant (independent tasks) and only warrant a warning.

    >>> launched_size({"PMI_SIZE": "4"}, count_plain_srun=False)
    (4, 'PMI_SIZE')
    >>> launched_size({"SLURM_STEP_NUM_TASKS": "4"}, count_plain_srun=False)
    (None, '')
    >>> singleton_refusal({"SLURM_STEP_NUM_TASKS": "4", "SLURM_MPI_TYPE": "pmix"}, 1)[:46]
    'srun started 4 tasks (SLURM_STEP_NUM_TASKS, --'
"""

from typing import Mapping, Optional, Tuple

__all__ = ["launched_size", "singleton_refusal", "unwired_srun_note"]

_LAUNCHER_SIZES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")   # Open MPI's; MPICH's, Intel's, srun pmi2
_LAUNCHER_RANKS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")   # and srun's pmix


def launched_size(env: Mapping[str, str], count_plain_srun: bool) -> Tuple[Optional[int], str]:
    """How many ranks the launcher says it started, and the variable that says so.

    An srun step counts when it named an MPI plug-in (``SLURM_MPI_TYPE`` other than none),
    or always with ``count_plain_srun`` (the doctor: a check run under srun means MPI)."""
    for name in _LAUNCHER_SIZES:
        if env.get(name, "").isdigit():
            return int(env[name]), name
    tasks = env.get("SLURM_STEP_NUM_TASKS", "")
    plugin = env.get("SLURM_MPI_TYPE", "none")
    if tasks.isdigit() and (count_plain_srun or plugin != "none"):
        return int(tasks), "SLURM_STEP_NUM_TASKS"
    return None, ""


def singleton_refusal(env: Mapping[str, str], mpi_size: int) -> Optional[str]:
    """The error when the launcher started several ranks but MPI sees one, else ``None``."""
    launched, source = launched_size(env, count_plain_srun=False)
    if mpi_size == 1 and (launched is None or launched <= 1):
        for name in _LAUNCHER_RANKS:   # the launcher's rank 3 that MPI calls 0 of 1
            if env.get(name, "").isdigit() and int(env[name]) > 0:
                return (f"the launcher started this process as rank {env[name]} ({name}) "
                        f"but MPI sees a world of 1 rank: every process would run alone, "
                        f"train its own copy and write the same checkpoint. " + _fix(env, name))
    if mpi_size != 1 or launched is None or launched <= 1:
        return None
    if source == "SLURM_STEP_NUM_TASKS":
        started = (f"srun started {launched} tasks ({source}, --mpi="
                   f"{env.get('SLURM_MPI_TYPE')})")
    else:
        started = f"the launcher started {launched} ranks ({source}={launched})"
    return (f"{started} but MPI sees a world of 1 rank: every process would run alone, "
            f"train its own copy and write the same checkpoint. {_fix(env, source)}")


def _fix(env: Mapping[str, str], source: str) -> str:
    if env.get("SLURM_STEP_NUM_TASKS", "").isdigit():
        return ("srun's --mpi plug-in must be one this MPI speaks: pmix for Open MPI, pmi2 "
                "for MPICH and most of its derivatives (srun --mpi=list; SRUN_MPI in "
                "slurm/site.sh)")
    return ("launch with the mpirun/mpiexec of the MPI that mpi4py was built against, or "
            "rebuild mpi4py against the site's MPI (docs/install.md: MPICC=$(which mpicc) "
            "pip install --no-binary=mpi4py mpi4py); python -m mpistrat doctor checks it")


def unwired_srun_note(env: Mapping[str, str], mpi_size: int) -> Optional[str]:
    """A warning for an srun step of several tasks with no MPI plug-in, each a world of 1."""
    tasks = env.get("SLURM_STEP_NUM_TASKS", "")
    if mpi_size == 1 and tasks.isdigit() and int(tasks) > 1 and \
            env.get("SLURM_MPI_TYPE", "none") == "none" and \
            launched_size(env, count_plain_srun=False)[0] is None:
        return (f"srun started {tasks} tasks without an MPI plug-in (--mpi=none or the "
                f"site's default): each task is a world of 1 rank and nothing is averaged "
                f"between them; to train together, srun --mpi=pmix (Open MPI) or --mpi=pmi2 "
                f"(MPICH)")
    return None
