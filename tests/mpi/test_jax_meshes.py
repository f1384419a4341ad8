"""ms.nn's gradient all-reduce inside programs that lay their work over a mesh of this process's
devices (issue 44): a jitted step over a mesh alternating with one on a single device, steps
over two meshes, sharded gradients, ``shard_map`` and ``pmap`` (where JAX runs the host callback
once per device, on several threads at once: device ``i``'s values must meet device ``i``'s of
every other rank, in one collective), and the named refusals (``vmap``, a ``shard_map`` that
leaves mesh axes automatic); hvd.DistributedOptimizer's optax form inside ``shard_map`` too.

The file uses the devices JAX has: one by default, several under
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (tests/launcher/test_jax_bound_cores.py
runs it so, at 2 and 3 ranks, bound to cores and on one CPU)."""

import numpy as np
import pytest

import mpistrat as ms

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = jax.numpy
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

GLOBAL = 24          # rows per global batch (divisible by 1, 2, 3 and 4 ranks)


def _devices():
    return jax.local_devices()


def _data(steps=6):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(steps, GLOBAL, 4)).astype(np.float32)
    y = np.tanh(x @ np.array([[1.0], [-2.0], [0.5], [0.25]], np.float32)).astype(np.float32)
    return x, y


def _init():
    return {"w1": jnp.asarray(np.linspace(-0.5, 0.5, 4 * 8, dtype=np.float32).reshape(4, 8)),
            "b1": jnp.zeros(8, jnp.float32),
            "w2": jnp.asarray(np.linspace(0.3, -0.3, 8, dtype=np.float32).reshape(8, 1))}


def _loss(params, x, y):
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - y) ** 2)


def _rows(world):
    per = GLOBAL // world.size
    return slice(world.rank * per, (world.rank + 1) * per)


def _train_two_placements(tx, x, y, rows):
    """Even steps jitted over a mesh of every local device (batch and params sharded), odd
    steps jitted on the last device alone: two programs, two device sets, one stream."""
    devices = _devices()
    mesh = Mesh(np.array(devices), ("d",))
    batch, replicated = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())

    def step(params, state, xb, yb):
        grads = jax.grad(_loss)(params, xb, yb)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    on_mesh, on_one = jax.jit(step), jax.jit(step)
    params = _init()
    state = tx.init(params)
    for index, (xb, yb) in enumerate(zip(x, y)):
        xb, yb = xb[rows], yb[rows]
        if index % 2 == 0 and len(xb) % len(devices) == 0:
            params, state = jax.device_put((params, state), replicated)
            params, state = on_mesh(params, state, jax.device_put(xb, batch),
                                    jax.device_put(yb, batch))
        else:
            params, state = jax.device_put((params, state), devices[-1])
            params, state = on_one(params, state, jnp.asarray(xb), jnp.asarray(yb))
    return jax.tree.map(np.asarray, params)


@pytest.mark.mpi(min_size=1)
def test_steps_on_a_mesh_and_on_one_device_match_one_process(world, strategy):
    x, y = _data()
    tx = optax.chain(ms.nn.aggregate_gradients(strategy), optax.adam(0.05))
    mine = _train_two_placements(tx, x, y, _rows(world))
    reference = _train_two_placements(optax.adam(0.05), x, y, slice(None))
    for name in mine:
        assert len(set(world.comm.allgather(mine[name].tobytes()))) == 1, name
        np.testing.assert_allclose(mine[name], reference[name], rtol=2e-5, atol=2e-6)


@pytest.mark.mpi(min_size=1)
def test_flax_nnx_optimizer_aggregating_over_a_mesh_matches_one_process(world, strategy):
    nnx = pytest.importorskip("flax.nnx")
    x, y = _data(steps=4)
    mesh = Mesh(np.array(_devices()), ("d",))

    def train(rows, tx):
        model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.tanh,
                               nnx.Linear(8, 1, rngs=nnx.Rngs(1)))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer, xb, yb):
            grads = nnx.grad(lambda m: jnp.mean((m(xb) - yb) ** 2))(model)
            optimizer.update(model, grads)

        for xb, yb in zip(x, y):
            xb, yb = xb[rows], yb[rows]
            if len(xb) % len(mesh.devices) == 0:   # the batch over the mesh
                xb, yb = jax.device_put((xb, yb), NamedSharding(mesh, P("d")))
            step(model, optimizer, xb, yb)
        return [np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))]

    mine = train(_rows(world), optax.chain(ms.nn.aggregate_gradients(strategy),
                                           optax.adam(0.05)))
    reference = train(slice(None), optax.adam(0.05))
    for got, want in zip(mine, reference):
        assert len(set(world.comm.allgather(got.tobytes()))) == 1
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.mpi(min_size=1)
def test_sharded_gradients_of_two_meshes_alternating(world, strategy):
    """Gradients that are sharded arrays, from steps over two meshes (the devices in two
    orders), each with a main-thread reduce after it: every sum is the ranks' sum."""
    devices = _devices()
    meshes = [Mesh(np.array(devices), ("d",)), Mesh(np.array(devices[::-1]), ("d",))]
    width = 4 * len(devices)

    @jax.jit
    def step(w, x):
        grads = jax.grad(lambda w: jnp.sum(w * x) + 0.0 * jnp.sum(jnp.tanh(x @ x.T)))(w)
        return ms.nn.all_reduce_gradients(grads, strategy, "SUM")

    outs = []
    for index in range(8):
        mesh = meshes[index % 2]
        x = jax.device_put(jnp.full((width, width), float(world.rank + 1 + index)),
                           NamedSharding(mesh, P("d")))
        w = jax.device_put(jnp.zeros((width, width)), NamedSharding(mesh, P(None, "d")))
        outs.append(step(w, x))
        assert float(strategy.reduce("SUM", np.float32(1.0), axis=None)) == world.size
    for index, out in enumerate(outs):
        want = sum(rank + 1 + index for rank in range(world.size))
        np.testing.assert_array_equal(np.asarray(out), np.full((width, width), want))


@pytest.mark.mpi(min_size=1)
def test_inside_shard_map_each_device_meets_the_same_device_of_every_rank(world, strategy):
    devices = _devices()
    count = len(devices)
    mesh = Mesh(np.array(devices).reshape(count, 1), ("a", "b"))
    spec = P(("a", "b"))

    @jax.jit
    def step(x):
        def body(xs):   # one row per device: values differ by device and by rank
            grads = {"sum": jnp.sum(xs) * jnp.ones(3), "rows": xs * 2.0}
            return ms.nn.all_reduce_gradients(grads, strategy, "SUM")
        return jax.shard_map(body, mesh=mesh, in_specs=spec,
                             out_specs={"sum": spec, "rows": spec})(x)

    total = sum(rank + 1 for rank in range(world.size))
    for index in range(5):
        base = np.arange(count, dtype=np.float32) * 10 + index
        out = step(jax.device_put(base * (world.rank + 1), NamedSharding(mesh, spec)))
        np.testing.assert_array_equal(np.asarray(out["sum"]).reshape(count, 3),
                                      np.repeat((base * total)[:, None], 3, axis=1))
        np.testing.assert_array_equal(np.asarray(out["rows"]), base * 2 * total)
        assert float(strategy.reduce("SUM", np.float32(2.0), axis=None)) == 2 * world.size


@pytest.mark.mpi(min_size=1)
def test_pmap_means_over_ranks_device_by_device(world, strategy):
    count = len(_devices())
    mean = jax.pmap(lambda v: ms.nn.all_reduce_gradients({"g": v * 3.0}, strategy))
    base = np.arange(count * 2, dtype=np.float32).reshape(count, 2)
    out = mean(jnp.asarray(base * (world.rank + 1)))
    want = base * 3.0 * sum(rank + 1 for rank in range(world.size)) / world.size
    np.testing.assert_allclose(np.asarray(out["g"]), want, rtol=1e-6)


@pytest.mark.mpi(min_size=1)
def test_vmap_and_partly_automatic_shard_map_are_refused_by_name(world, strategy):
    with pytest.raises(ValueError, match="inside jax.vmap: .* call it outside the vmap"):
        jax.jit(jax.vmap(lambda v: ms.nn.all_reduce_gradients(v, strategy)))(jnp.ones((3, 2)))
    mesh = Mesh(np.array(_devices()).reshape(-1, 1), ("a", "b"))
    partly = jax.shard_map(lambda v: ms.nn.all_reduce_gradients(v, strategy), mesh=mesh,
                           in_specs=P("a"), out_specs=P("a"), axis_names={"a"})
    with pytest.raises(ValueError, match=r"over the axes \['a'\] of a mesh with the axes "
                                         r"\['a', 'b'\].*every mesh axis is manual"):
        jax.jit(partly)(jnp.ones(len(_devices())))
    # the stream is intact: a later aggregation and reduce still agree on every rank
    out = jax.jit(lambda v: ms.nn.all_reduce_gradients(v, strategy, "SUM"))(jnp.ones(2))
    np.testing.assert_array_equal(np.asarray(out), np.full(2, float(world.size)))


def _two_half_programs(strategy, halves):
    """Two shard_map programs with gradients of the same shapes, one on each half of the local
    devices (a generator step and a discriminator step): their calls must never meet."""
    def program(half, sign):
        mesh = Mesh(np.array(half), ("d",))

        def body(params, xs, ys):   # (the gradient of replicated params is summed over "d")
            share = 1.0 / jax.lax.axis_size("d")
            grads = jax.grad(lambda p: _loss(p, xs, sign * ys) * share)(params)
            grads = ms.nn.all_reduce_gradients(grads, strategy)
            return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

        step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d"), P("d")),
                                     out_specs=P()))
        return mesh, step
    return [program(half, sign) for half, sign in zip(halves, (1.0, -1.0))]


@pytest.mark.mpi(min_size=1)
def test_shard_map_programs_on_disjoint_halves_alternating_match_one_process(world, strategy):
    """A generator step on the first half of the devices and a discriminator step on the
    other half, gradients of the same shapes, dispatched without waiting: each call's parts
    come from its own program only (issue 44 review), on every rank."""
    devices = _devices()
    if len(devices) < 2:
        pytest.skip("needs 2 or more local JAX devices (--xla_force_host_platform_device_count)")
    half = len(devices) // 2
    halves = [devices[:half], devices[half:2 * half]]
    x, y = _data(steps=6)
    rows = _rows(world)
    programs = _two_half_programs(strategy, halves)
    params = [jax.device_put(_init(), NamedSharding(mesh, P())) for mesh, _ in programs]
    for xb, yb in zip(x, y):
        for which, (mesh, step) in enumerate(programs):    # no wait between the two
            batch = NamedSharding(mesh, P("d"))
            params[which] = step(params[which], jax.device_put(xb[rows], batch),
                                 jax.device_put(yb[rows], batch))
    mine = [jax.tree.map(np.asarray, p) for p in params]

    reference = [_init(), _init()]
    for xb, yb in zip(x, y):
        for which, sign in enumerate((1.0, -1.0)):
            grads = jax.grad(lambda p: _loss(p, jnp.asarray(xb), sign * jnp.asarray(yb)))(
                reference[which])
            reference[which] = jax.tree.map(lambda p, g: p - 0.1 * g, reference[which], grads)
    for got, want in zip(mine, reference):
        for name in got:
            assert len(set(world.comm.allgather(got[name].tobytes()))) == 1, name
            np.testing.assert_allclose(got[name], np.asarray(want[name]), rtol=2e-5, atol=2e-6)
    assert float(strategy.reduce("SUM", np.float32(1.0), axis=None)) == world.size


def _arrive(site, count, position, value, timeout, out):
    from mpistrat.collectives import host_callbacks
    try:
        out[position] = host_callbacks.gathered(
            count, position, [value], lambda parts: [[sum(p[0] for p in parts)]] * count,
            timeout, site)
    except Exception as err:  # noqa: BLE001 - the test looks at it
        out[position] = err


def _threads(*calls):
    """Each call on its own thread, started in the order given, apart enough to arrive so."""
    import threading
    import time
    threads = [threading.Thread(target=_arrive, args=call) for call in calls]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive()


@pytest.mark.mpi(min_size=1)
def test_gathered_joins_only_calls_of_one_traced_callback(world):
    """Two callbacks of the same device count whose devices come in crossed order: each call
    holds one callback's parts (matched by count and position alone they would mix)."""
    from mpistrat.collectives import host_callbacks
    first, second = host_callbacks.site("first"), host_callbacks.site("second")
    one, two = {}, {}
    _threads((first, 2, 0, 1.0, 10.0, one), (second, 2, 1, 100.0, 10.0, two),
             (second, 2, 0, 200.0, 10.0, two), (first, 2, 1, 2.0, 10.0, one))
    assert one == {0: [3.0], 1: [3.0]} and two == {0: [300.0], 1: [300.0]}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("timeout", [0.3, None])
def test_gathered_fails_a_call_a_device_skips_and_starts_again(world, monkeypatch, timeout):
    """A device that never comes (a branch it skips): the others stop waiting, even with no
    collective timeout (RENDEZVOUS_SECONDS), with an error naming the callback and the missing
    position; the device coming late raises instead of joining the next call's values; the
    next call meets again from a clean count."""
    from mpistrat.collectives import host_callbacks
    from mpistrat.errors import DeadlineExceededError
    monkeypatch.setattr(host_callbacks, "RENDEZVOUS_SECONDS", 0.3)
    site = host_callbacks.site("ms.nn.all_reduce_gradients at here.py:1")
    out = {}
    _threads((site, 3, 0, 1.0, timeout, out), (site, 3, 2, 3.0, timeout, out))
    for position in (0, 2):
        assert isinstance(out[position], DeadlineExceededError), out
        message = str(out[position])
        assert "here.py:1" in message and "positions [1] of the 3" in message, message
        assert ("RENDEZVOUS_SECONDS" in message) == (timeout is None), message
    late = {}
    _threads((site, 3, 1, 2.0, timeout, late))
    assert isinstance(late[1], DeadlineExceededError) and "after it had failed" in str(late[1])
    again = {}   # (a generous limit again: threads of a loaded machine start late)
    monkeypatch.setattr(host_callbacks, "RENDEZVOUS_SECONDS", 60.0)
    _threads(*[(site, 3, p, 10.0 * (p + 1), None if timeout is None else 60.0, again)
               for p in range(3)])
    assert again == {0: [60.0], 1: [60.0], 2: [60.0]}


@pytest.mark.mpi(min_size=1)
def test_horovod_optax_inside_shard_map_averages_device_by_device(world):
    """hvd.DistributedOptimizer's update inside shard_map (JAX runs its host callback once per
    device, on several threads): device i's gradients are averaged with device i's of every
    rank, in one collective per step, as ms.nn's are."""
    import mpistrat.horovod as hvd
    hvd.init()
    try:
        devices = _devices()
        count = len(devices)
        mesh = Mesh(np.array(devices), ("d",))
        spec = P("d")
        tx = hvd.DistributedOptimizer(optax.sgd(1.0))   # update = -(averaged gradient)

        @jax.jit
        def step(g):
            def body(gs):
                updates, _ = tx.update({"g": gs}, tx.init({"g": gs}))
                return updates["g"]
            return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(g)

        mean_factor = sum(rank + 1 for rank in range(world.size)) / world.size
        for index in range(4):
            base = np.arange(count * 2, dtype=np.float32) * 10 + index
            out = step(jax.device_put(base * (world.rank + 1), NamedSharding(mesh, spec)))
            np.testing.assert_allclose(np.asarray(out), -base * mean_factor, rtol=1e-6)
    finally:
        hvd.shutdown()
