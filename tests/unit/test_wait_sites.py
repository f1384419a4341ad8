"""How the health check reads a wait for peers from a Python stack (runtime/wait_sites.py)."""

import sys

from mpistrat.runtime import wait_sites

SOURCE = """
import sys
def all_reduce(what):
    return sys._getframe()
def _watch():
    return sys._getframe()
"""


def module(name):
    space = {"__name__": name}
    exec(compile(SOURCE, f"{name.replace('.', '/')}.py", "exec"), space)
    return space


def test_a_frame_of_a_communicating_module_is_a_wait_and_is_described_with_its_caller():
    frame = module("mpistrat.collectives.fake")["all_reduce"]("all_reduce SUM")
    assert wait_sites.waiting_frame(frame) is frame
    text, line = wait_sites.describe(frame), sys._getframe().f_lineno   # the caller's live line
    assert text == f"waits in all_reduce SUM (all_reduce, called at test_wait_sites.py:{line})"


def test_local_modules_idle_loops_and_user_code_are_not_waits():
    assert wait_sites.waiting_frame(module("mpistrat.data.dataset")["all_reduce"]("x")) is None
    assert wait_sites.waiting_frame(module("mpistrat.preemption")["_watch"]()) is None
    here = sys._getframe()
    assert wait_sites.waiting_frame(here) is None
    assert wait_sites.describe(here).startswith("runs test_wait_sites.py:")
    assert wait_sites.describe(None) == "has no Python frame"


def test_the_communicator_in_scope_is_found_along_the_stack():
    from mpi4py import MPI
    space = module("mpistrat.collectives.other")
    exec("def reduce(comm):\n    return sys._getframe()\n", space)
    assert wait_sites.comm_of(space["reduce"](MPI.COMM_SELF)) is MPI.COMM_SELF
    assert wait_sites.members(MPI.COMM_SELF, [0]) == (0,)
