#!/usr/bin/env bash
# One-command, idempotent set-up for a fresh Debian machine:
#   Debian's Open MPI and parallel HDF5, a virtual environment in .venv,
#   mpi4py, numpy, pytest, pytest-mpi, pytest-xdist, tqdm, JAX (CPU), scikit-learn and
#   matplotlib (the main job), h5py built against parallel HDF5, the optional
#   frameworks the tests port programs from (Keras 3, Flax, optax, Equinox,
#   ml_dtypes), protobuf and CRC-32C for TensorFlow's files, and Debian's
#   SimGrid for the scaling simulator.
#   A second run only checks and takes seconds.
#
# scripts/setup.sh --mpi mpich builds the second environment the test suite runs
# under (.venv-mpich): Debian's MPICH and its parallel HDF5, with mpi4py and h5py
# compiled from source against them, as a user does against a site's MPI
# (docs/install.md), and the same Python packages as .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

MPI_FLAVOR=openmpi
if [ "${1:-}" = "--mpi" ]; then MPI_FLAVOR=$2; shift 2; fi
# --packages-only: step 1 alone (the Debian packages), then stop. scripts/test.sh installs
# MPICH's packages this way in the foreground (apt may ask for sudo's password) and builds
# .venv-mpich in the background.
PACKAGES_ONLY=no
if [ "${1:-}" = "--packages-only" ]; then PACKAGES_ONLY=yes; shift; fi
case "$MPI_FLAVOR" in
    openmpi)
        VENV=${VENV:-.venv}             # (VENV names the Open MPI environment only)
        APT_PACKAGES="openmpi-bin libopenmpi-dev libhdf5-openmpi-dev hdf5-tools pkg-config python3-simgrid"
        MPICC=mpicc.openmpi; HDF5_PC=hdf5-openmpi; LIBRARY="Open MPI"
        SOURCE_MPI4PY=no ;;  # an mpi4py that loads Open MPI will do (checked below); a new
                             # environment builds it from source like the MPICH one
    mpich)
        VENV=${VENV_MPICH:-.venv-mpich}
        APT_PACKAGES="mpich libmpich-dev libhdf5-mpich-dev hdf5-tools pkg-config"
        MPICC=mpicc.mpich; HDF5_PC=hdf5-mpich; LIBRARY="MPICH"
        SOURCE_MPI4PY=yes ;;
    *) echo "setup: --mpi takes openmpi or mpich, not '$MPI_FLAVOR'" >&2; exit 2 ;;
esac
PY="$VENV/bin/python"
STAMP="$VENV/.mpistrat-setup"
want_stamp=$(cat scripts/setup.sh pyproject.toml | sha256sum | cut -c1-16)
# The MPI library that mpi4py must load in this environment (checked at the end and on every run).
check_mpi="from mpi4py import MPI; import h5py; assert h5py.get_config().mpi, 'h5py lacks MPI support'; \
v = MPI.Get_library_version(); assert '$LIBRARY' in v, 'mpi4py loads ' + v.splitlines()[0]"

sudo_if_needed() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

# 1. System packages (Debian's MPI and its parallel HDF5).
# Debian's own python3 needs python3-venv (and headers) before it can make a virtual environment.
if ! python3 -c "import venv, ensurepip" 2>/dev/null; then
    APT_PACKAGES="$APT_PACKAGES python3-venv python3-dev"
fi
missing=""
for p in $APT_PACKAGES; do
    dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
if [ -n "$missing" ]; then
    echo "setup: installing Debian packages:$missing"
    sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
fi
[ "$PACKAGES_ONLY" = no ] || exit 0

# 2. Virtual environment.
[ -x "$PY" ] || python3 -m venv "$VENV"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want_stamp" ] \
   && "$PY" -c "import mpistrat; $check_mpi" 2>/dev/null; then
    echo "setup: up to date ($VENV)"
    exit 0
fi

PIP="$PY -m pip install -q --disable-pip-version-check"
$PIP --upgrade pip "setuptools>=77" wheel
$PIP numpy "cython>=3" pkgconfig pytest pytest-mpi pytest-timeout "pytest-xdist>=3.2" tqdm filelock

# 3. mpi4py and h5py compiled against this MPI and its parallel HDF5. pip caches the wheels it
#    builds without the compiler in the key, so each MPI keeps a cache of its own.
USER_PIP_CACHE=${PIP_CACHE_DIR-unset}
export PIP_CACHE_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/pip-mpistrat-$MPI_FLAVOR"
if ! "$PY" -c "from mpi4py import MPI; assert '$LIBRARY' in MPI.Get_library_version()" 2>/dev/null \
   || { [ "$SOURCE_MPI4PY" = yes ] && ! "$PY" -c "import mpi4py, sys; sys.exit(not mpi4py.get_config())" 2>/dev/null; }; then
    echo "setup: building mpi4py against $LIBRARY ($MPICC)"
    "$PY" -m pip uninstall -y -q mpi4py 2>/dev/null || true
    MPICC=$MPICC $PIP --no-binary=mpi4py --no-build-isolation "mpi4py>=4.0"
fi
if ! "$PY" -c "import h5py; assert h5py.get_config().mpi" 2>/dev/null; then
    echo "setup: building h5py against parallel HDF5 for $LIBRARY (a few minutes the first time)"
    "$PY" -m pip uninstall -y -q h5py 2>/dev/null || true
    CC=$MPICC HDF5_MPI=ON HDF5_PKGCONFIG_NAME=$HDF5_PC \
        $PIP --no-binary=h5py --no-build-isolation h5py
fi
if [ "$USER_PIP_CACHE" = unset ]; then unset PIP_CACHE_DIR; else export PIP_CACHE_DIR=$USER_PIP_CACHE; fi

# 4. JAX for CPU (the TPUStrategy bridge is tested on virtual CPU devices;
#    jax.shard_map with check_vma needs 0.7 or later).
"$PY" -c "import jax, sys; sys.exit(tuple(map(int, jax.__version__.split('.')[:2])) < (0, 7))" \
    2>/dev/null || $PIP "jax[cpu]>=0.7"

# 5. What the main job (jobs/train.py) uses: scikit-learn's bundled digits, matplotlib's plot.
"$PY" -c "import sklearn, matplotlib" 2>/dev/null || $PIP scikit-learn matplotlib

# 6. Optional extras, imported lazily by the library and installed here for the tests:
#    the frameworks users bring (Keras 3 on JAX, Flax NNX, optax, Equinox, ml_dtypes'
#    bfloat16/float8), protobuf and CRC-32C (TensorFlow's checkpoints and TFRecord files),
#    cramjam (snappy blocks in TensorFlow's index files).
"$PY" -c "import keras, flax, optax, equinox, ml_dtypes, google.protobuf, google_crc32c, cramjam" \
    2>/dev/null || $PIP "keras>=3.10" "flax>=0.11" "optax>=0.2.5" "equinox>=0.13" "ml_dtypes>=0.5" \
    "protobuf>=5" "google-crc32c>=1.6" "cramjam>=2.9"

# 7. The package itself, editable.
$PIP --no-deps --no-build-isolation -e .

"$PY" -c "$check_mpi"
echo "$want_stamp" > "$STAMP"
echo "setup: done ($VENV)"
