# slurm/site.sh: what differs between sites, in one place. Every template sources it after
# changing to the submit directory (submit from the repository's root, or set MPISTRAT_SITE to
# a copy of this file). Set the variables in the environment before sbatch (sbatch passes the
# submitting shell's environment by default), or edit the defaults below once for your site.
#
#   SITE_MODULES  modules to load before anything runs, e.g.
#                 "gcc/12.2 openmpi/4.1.6 hdf5/1.14.3-mpi python/3.11"  (default: none)
#   VENV          the virtual environment mpistrat was installed into (docs/install.md)
#                 (default .venv); PYTHON defaults to $VENV/bin/python
#   SRUN_MPI      srun's MPI plug-in: pmix (default), pmi2, cray_shasta, ...; `srun --mpi=list`
#                 shows the site's; it must match how the site's MPI was built
#
# Partition, account, QOS, time and GPUs need no edit: sbatch reads SBATCH_PARTITION,
# SBATCH_ACCOUNT, SBATCH_QOS, SBATCH_TIMELIMIT and SBATCH_GPUS_PER_NODE from the environment, or
# takes -p/-A/-q/-t/--gpus-per-node on its command line:
#   SBATCH_ACCOUNT=proj42 SBATCH_PARTITION=gpu SITE_MODULES="openmpi/4.1.6 hdf5/1.14.3-mpi" \
#       sbatch slurm/train_multi_node.sbatch
if [ -n "${SITE_MODULES:-}" ]; then
    if ! command -v module >/dev/null 2>&1; then   # batch shells may lack the module function
        for init in /etc/profile.d/lmod.sh /etc/profile.d/modules.sh /usr/share/lmod/lmod/init/bash; do
            [ -f "$init" ] && { source "$init"; break; }
        done
    fi
    # shellcheck disable=SC2086  # a list of modules
    module load $SITE_MODULES || { echo "slurm/site.sh: module load $SITE_MODULES failed" >&2; exit 1; }
fi
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-$VENV/bin/python}
SRUN_MPI=${SRUN_MPI:-pmix}
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "slurm/site.sh: no Python at '$PYTHON' (from $PWD): install mpistrat into a virtual" \
         "environment first (docs/install.md) and set VENV or PYTHON" >&2
    exit 1
fi
