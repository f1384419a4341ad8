"""``ClusterSpec``: job names to task addresses, as ``tf.train.ClusterSpec``.

A job's tasks are given as a list (task ``i`` at index ``i``) or as a dict
from task index to address (a sparse job); ``as_dict`` gives them back in
the same form. Under MPI the addresses only label the ranks (MPI does the
communication), so a TensorFlow program that builds one keeps working::

    >>> from mpistrat.cluster_spec import ClusterSpec
    >>> spec = ClusterSpec({"worker": ["host0:2222", "host1:2222"], "ps": {3: "host2:2222"}})
    >>> spec.jobs, spec.num_tasks("worker"), spec.task_indices("ps")
    (['ps', 'worker'], 2, [3])
    >>> spec.task_address("worker", 1)
    'host1:2222'
    >>> spec.as_dict()
    {'ps': {3: 'host2:2222'}, 'worker': ['host0:2222', 'host1:2222']}
    >>> spec.job_tasks("ps")
    [None, None, None, 'host2:2222']
"""

from typing import Any, Dict, List, Optional, Union

__all__ = ["ClusterSpec"]

Tasks = Union[List[str], Dict[int, str]]


def _job_tasks(job: Any, tasks: Any) -> Dict[int, str]:
    """One job's tasks as ``{index: address}``, or ``TypeError``/``ValueError`` naming the job."""
    if not isinstance(job, str) or not job:
        raise TypeError(f"ClusterSpec: a job name must be a non-empty string, got {job!r}")
    if isinstance(tasks, (list, tuple)):
        tasks = dict(enumerate(tasks))
    elif not isinstance(tasks, dict):
        raise TypeError(f"ClusterSpec: the tasks of job {job!r} must be a list of addresses or a "
                        f"dict from task index to address, got {type(tasks).__name__}")
    out = {}
    for index, address in tasks.items():
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise TypeError(f"ClusterSpec: job {job!r} has task index {index!r}; task indices "
                            f"are integers >= 0")
        if not isinstance(address, str):
            raise TypeError(f"ClusterSpec: task {index} of job {job!r} has address {address!r}; "
                            f"addresses are strings such as 'host:port'")
        out[index] = address
    return dict(sorted(out.items()))


class ClusterSpec:
    """Job names to task addresses (see the module docstring).

    ``cluster``: a dict ``{job: [address, ...] or {index: address}}``, or
    another ``ClusterSpec`` (copied). Jobs are kept sorted by name, as
    TensorFlow's cluster definition sorts them.
    """

    def __init__(self, cluster: Any):
        if isinstance(cluster, ClusterSpec):
            cluster = cluster.as_dict()
        if not isinstance(cluster, dict):
            raise TypeError(f"ClusterSpec: cluster must be a dict of job names to tasks or a "
                            f"ClusterSpec, got {type(cluster).__name__}")
        for job in cluster:
            if not isinstance(job, str) or not job:  # before sorting, which mixed types break
                raise TypeError(f"ClusterSpec: a job name must be a non-empty string, got {job!r}")
        self._jobs: Dict[str, Dict[int, str]] = {
            job: _job_tasks(job, cluster[job]) for job in sorted(cluster)}

    # -- queries ---------------------------------------------------------------
    @property
    def jobs(self) -> List[str]:
        """The job names, sorted."""
        return list(self._jobs)

    def _tasks(self, job_name: str) -> Dict[int, str]:
        try:
            return self._jobs[job_name]
        except (KeyError, TypeError):
            raise ValueError(f"No such job in cluster: {job_name!r} (jobs: {self.jobs})") from None

    def num_tasks(self, job_name: str) -> int:
        """How many tasks the job has (``ValueError`` for an unknown job)."""
        return len(self._tasks(job_name))

    def task_indices(self, job_name: str) -> List[int]:
        """The job's task indices, sorted."""
        return list(self._tasks(job_name))

    def task_address(self, job_name: str, task_index: int) -> str:
        """The address of one task (``ValueError`` for an unknown job or index)."""
        tasks = self._tasks(job_name)
        if task_index not in tasks:
            raise ValueError(f"No such task index {task_index} in job {job_name!r} "
                             f"(indices: {list(tasks)})")
        return tasks[task_index]

    def job_tasks(self, job_name: str) -> List[Optional[str]]:
        """Addresses indexed by task index, ``None`` where a sparse job has no task."""
        tasks = self._tasks(job_name)
        out: List[Optional[str]] = [None] * (max(tasks) + 1 if tasks else 0)
        for index, address in tasks.items():
            out[index] = address
        return out

    def as_dict(self) -> Dict[str, Tasks]:
        """``{job: [addresses]}`` for dense jobs, ``{job: {index: address}}`` for sparse ones."""
        return {job: (list(tasks.values()) if list(tasks) == list(range(len(tasks)))
                      else dict(tasks)) for job, tasks in self._jobs.items()}

    # -- comparisons and display -----------------------------------------------
    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, dict):
            try:
                other = ClusterSpec(other)
            except (TypeError, ValueError):
                return False
        return isinstance(other, ClusterSpec) and self._jobs == other._jobs

    def __ne__(self, other: Any) -> bool:
        return not self == other

    __hash__ = None  # mutable-looking, compared by value, as upstream

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"
