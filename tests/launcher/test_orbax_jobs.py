"""The Orbax face across jobs: steps saved by one world size, restored by another, bit for bit
(into a target tree, JAX arrays staying JAX arrays, and as saved)."""

import pytest

pytest.importorskip("jax")

TREE = """
import sys, numpy as np, jax, jax.numpy as jnp, mpistrat as ms
import mpistrat.checkpoint as ocp
from mpistrat.runtime import get_world
directory = sys.argv[1]

def tree(step):
    rng = np.random.default_rng(step)
    return {"params": {"kernel": jnp.asarray(rng.standard_normal((3000, 200), np.float32)),
                       "bias": rng.standard_normal(7)},
            "step": step, "history": [np.arange(step, step + 5), [1.5, (step, None)]]}
"""

SAVE = TREE + """
options = ms.CheckpointManagerOptions(max_to_keep=2)
with ms.CheckpointManager(directory, options=options) as mngr:
    for step in range(4):
        mngr.save(step, args=ocp.args.StandardSave(tree(step)))
say("saved", get_world().size, mngr.all_steps())
"""

RESTORE = TREE + """
mngr = ms.CheckpointManager(directory)
got = mngr.restore(None, args=ocp.args.StandardRestore(tree(0)))
leaves = zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(tree(3)))
same = all(np.asarray(a).tobytes() == np.asarray(b).tobytes() and np.asarray(a).dtype ==
           np.asarray(b).dtype for a, b in leaves)
typed = isinstance(got["params"]["kernel"], jax.Array) and type(got["step"]) is int
plain = mngr.restore(2)
as_saved = (plain["history"][1] == [1.5, (2, None)] and plain["step"] == 2 and
            plain["params"]["kernel"].tobytes() == np.asarray(tree(2)["params"]["kernel"]).tobytes())
say("restored", get_world().size, mngr.all_steps(), same and typed and as_saved)
"""


@pytest.mark.parametrize("writers,readers", [(2, 3), (3, 2)])
def test_orbax_steps_restore_at_another_world_size(launch, tmp_path, writers, readers):
    directory = str(tmp_path / "steps")
    saved = launch(writers, SAVE, directory)
    assert saved.returncode == 0, saved
    assert saved.output.count(f"saved {writers} [2, 3]") == writers, saved
    restored = launch(readers, RESTORE, directory)
    assert restored.returncode == 0, restored
    assert restored.output.count(f"restored {readers} [2, 3] True") == readers, restored
