"""launch_check (pure): several processes launched but a world of 1 is named; srun without an
MPI plug-in is a warning; a world that matches the launcher passes."""

from mpistrat.runtime.launch_check import launched_size, singleton_refusal, unwired_srun_note


def test_the_launchers_own_counts_are_read_first():
    assert launched_size({"OMPI_COMM_WORLD_SIZE": "3", "PMI_SIZE": "9"}, False) == \
        (3, "OMPI_COMM_WORLD_SIZE")
    assert launched_size({"PMI_SIZE": "2", "SLURM_STEP_NUM_TASKS": "8"}, False) == (2, "PMI_SIZE")
    assert launched_size({"PMI_SIZE": "x"}, False) == (None, "")


def test_an_srun_step_counts_only_with_a_plugin_unless_asked():
    step = {"SLURM_STEP_NUM_TASKS": "4"}
    assert launched_size(step, count_plain_srun=False) == (None, "")
    assert launched_size(step, count_plain_srun=True) == (4, "SLURM_STEP_NUM_TASKS")
    assert launched_size(dict(step, SLURM_MPI_TYPE="none"), False) == (None, "")
    assert launched_size(dict(step, SLURM_MPI_TYPE="pmi2"), False) == (4, "SLURM_STEP_NUM_TASKS")


def test_a_world_of_one_under_a_launcher_of_several_is_refused_with_the_fix():
    srun = singleton_refusal({"SLURM_STEP_NUM_TASKS": "4", "SLURM_MPI_TYPE": "pmix"}, 1)
    assert srun.startswith("srun started 4 tasks (SLURM_STEP_NUM_TASKS, --mpi=pmix) but MPI "
                           "sees a world of 1 rank")
    assert "pmi2 for MPICH" in srun and "SRUN_MPI" in srun
    other = singleton_refusal({"OMPI_COMM_WORLD_SIZE": "2"}, 1)
    assert "(OMPI_COMM_WORLD_SIZE=2)" in other and "--no-binary=mpi4py" in other


def test_matching_worlds_and_single_launches_pass():
    assert singleton_refusal({"PMI_SIZE": "4"}, 4) is None
    assert singleton_refusal({"PMI_SIZE": "1"}, 1) is None
    assert singleton_refusal({}, 1) is None
    assert singleton_refusal({"SLURM_STEP_NUM_TASKS": "4"}, 1) is None   # no plug-in: a note


def test_srun_without_a_plugin_is_a_note_not_an_error():
    note = unwired_srun_note({"SLURM_STEP_NUM_TASKS": "3"}, 1)
    assert note.startswith("srun started 3 tasks without an MPI plug-in")
    assert unwired_srun_note({"SLURM_STEP_NUM_TASKS": "3", "SLURM_MPI_TYPE": "pmix"}, 1) is None
    assert unwired_srun_note({"SLURM_STEP_NUM_TASKS": "1"}, 1) is None
    assert unwired_srun_note({"SLURM_STEP_NUM_TASKS": "3"}, 3) is None


def test_a_launcher_rank_above_0_in_a_world_of_1_is_refused_without_a_size():
    """srun --mpi=pmix with a site default that sets no SLURM_MPI_TYPE: PMIX_RANK says 2."""
    refusal = singleton_refusal({"PMIX_RANK": "2", "SLURM_STEP_NUM_TASKS": "4"}, 1)
    assert refusal.startswith("the launcher started this process as rank 2 (PMIX_RANK) but "
                              "MPI sees a world of 1 rank")
    assert "srun's --mpi plug-in" in refusal
    assert singleton_refusal({"PMIX_RANK": "0"}, 1) is None
    assert singleton_refusal({"PMI_RANK": "1", "PMI_SIZE": "2"}, 2) is None
