"""Simulating our collectives on clusters we do not have (SimGrid), checked on ours.

The engine's own schedules (``collectives/schedules.py``) and a model of Open MPI's
collectives (``openmpi.py``) give the rounds of every all-reduce algorithm
(``programs.py``); ``player.py`` plays them on a SimGrid platform built from a
``platform.ClusterSpec``. ``predict.step`` answers for a whole gradient set with the
engine's own fusion and choices, ``python -m mpistrat plan`` on the command line;
``calibrate.py`` and ``validate.py`` fit and check the model on the namespace cluster
(``benchmarks/calibrate_sim.sh``); ``report.py`` makes the predictions of docs/scaling.md::

    from mpistrat.simulate.predict import infiniband, step
    from mpistrat.simulate.models import gradient_set
    result = step(infiniband(nodes=64, ranks_per_node=8), gradient_set("resnet50"), 0.1)
    result["allreduce_seconds"], result["efficiency"]

SimGrid is imported only by ``player.py``, in a child process.
"""
