"""Meshes and shardings, on the test's 8 CPU devices."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec

from jaxrl_llm import sharding


def test_the_default_mesh_puts_every_device_on_the_data_axis():
    mesh = sharding.make_mesh()
    assert mesh.axis_names == ("data",) and mesh.axis_types == (AxisType.Auto,)
    assert list(mesh.devices.flat) == jax.devices() and sharding.data_size(mesh) == 8


def test_rows_split_the_leading_axis_and_replicated_copies_everything():
    mesh = sharding.make_mesh(4)
    assert list(mesh.devices.flat) == jax.devices()[:4]
    x = np.arange(8 * 3).reshape(8, 3)
    split = jax.device_put(x, sharding.rows(mesh))
    assert sharding.rows(mesh).spec == PartitionSpec("data")
    assert [shard.data.shape for shard in split.addressable_shards] == [(2, 3)] * 4
    np.testing.assert_array_equal(np.concatenate([np.asarray(s.data) for s in split.addressable_shards]), x)
    copies = jax.device_put(x, sharding.replicated(mesh))
    assert all(np.array_equal(np.asarray(s.data), x) for s in copies.addressable_shards)


@pytest.mark.parametrize("count", [0, 9, 2.0, True])
def test_a_mesh_needs_a_device_count_that_exists(count):
    with pytest.raises(ValueError, match=r"`num_devices` must be an integer in \[1, 8\] \(the devices available\)"):
        sharding.make_mesh(count)


def test_a_mesh_without_a_data_axis_is_refused_with_its_axes():
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    with pytest.raises(ValueError, match=r"needs a 'data' axis to split rows over; its axes are \('fsdp',\)"):
        sharding.data_size(mesh)


# --- Meshes over data x fsdp x tensor, and the state's shardings by the rules ------------

MESHES = [(8, 1, 1), (1, 8, 1), (2, 4, 1), (2, 2, 2), (1, 4, 2)]  # data x fsdp x tensor


def test_a_three_axis_mesh_has_the_sizes_asked_for_and_refuses_what_does_not_fit():
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert dict(sharding.make_mesh(fsdp=4).shape) == {"data": 2, "fsdp": 4, "tensor": 1}  # data: the rest
    with pytest.raises(ValueError, match=r"2 x 4 x 2 = 16 devices; 8 are available"):
        sharding.make_mesh(data=2, fsdp=4, tensor=2)
    with pytest.raises(ValueError, match="not both"):
        sharding.make_mesh(4, fsdp=2)
    with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
        sharding.spec_for(PartitionSpec("embed"), (8,), mesh, (("embed", "model"),))


def _expected_spec(name: str, shape, fsdp: int, tensor: int) -> tuple:
    """Megatron's layout written out by parameter name (an independent reference for the
    ``fsdp_tensor`` rules): the model dimension over ``fsdp``, heads / MLP columns /
    vocabulary over ``tensor``, where the sizes divide."""

    def f(dim):
        return "fsdp" if fsdp > 1 and shape[dim] % fsdp == 0 else None

    def t(dim):
        return "tensor" if tensor > 1 and shape[dim] % tensor == 0 else None

    layouts = {
        "embed_tokens": lambda: (t(0), f(1)),
        "lm_head": lambda: (f(0), t(1)),
        "q_proj": lambda: (f(0), t(1)),
        "k_proj": lambda: (f(0), t(1)),
        "v_proj": lambda: (f(0), t(1)),
        "o_proj": lambda: (t(0), None, f(2)),
        "gate_proj": lambda: (f(0), t(1)),
        "up_proj": lambda: (f(0), t(1)),
        "down_proj": lambda: (t(0), f(1)),
    }
    spec = list(layouts[name]()) if name in layouts else []
    while spec and spec[-1] is None:
        spec.pop()
    return tuple(spec)


def _model_and_state(algorithm, param_dtype=None, *, num_layers=1, scan_layers=False):
    import jax.numpy as jnp

    from jaxrl_llm import models, training

    config = models.ModelConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        param_dtype=param_dtype or jnp.float32,
        scan_layers=scan_layers,
    )
    model, params = models.init(config, jax.random.key(0))
    return model, params, training.init_state(model, params, algorithm, training.TrainConfig())


def _layer_path(path: str) -> str:
    """A per-layer leaf's path string -> its stacked leaf's (``['layers'][1]['mlp']`` -> ``['layers']['mlp']``)."""
    head, layers, rest = path.partition("['layers'][")
    return head + "['layers']" + rest[rest.index("]") + 1 :] if layers else path


@pytest.mark.parametrize("data, fsdp, tensor", [(2, 2, 2), (1, 4, 2), (8, 1, 1)])
def test_a_stacked_state_is_split_as_its_layers_are_with_the_layers_axis_whole(data, fsdp, tensor):
    """Params, reference, critic backbone, Adam's moments and master copies of the stacked
    layout: each ``[L, ...]`` leaf takes its layers' spec by the rules, behind a whole
    ``layers`` axis; every other leaf the unrolled state's."""
    import jax.numpy as jnp

    from jaxrl_llm import algorithms, training
    from jaxrl_llm.training import optim

    mesh = sharding.make_mesh(data=data, fsdp=fsdp, tensor=tensor)
    policy, critic = optim.run_optimizers(algorithms.PPO, training.TrainConfig(), decay_steps=1)

    def shardings(scan_layers):
        _, _, state = _model_and_state(algorithms.PPO, jnp.bfloat16, num_layers=2, scan_layers=scan_layers)
        placements = sharding.state_shardings(
            state, mesh, sharding.RULES["fsdp_tensor"], optimizer=policy, critic_optimizer=critic
        )
        leaves = jax.tree_util.tree_flatten_with_path(state)[0]
        return {
            jax.tree_util.keystr(path): (leaf.shape, placement.spec)
            for (path, leaf), placement in zip(leaves, jax.tree.leaves(placements), strict=True)
        }

    unrolled, stacked = shardings(False), shardings(True)
    expected = {}
    for path, (shape, spec) in unrolled.items():
        if _layer_path(path) == path:
            expected[path] = (shape, spec)
        else:  # layers 0 and 1 alike: the stacked leaf's spec is theirs behind the layers' axis
            stacked_spec = PartitionSpec(None, *spec) if tuple(spec) else spec
            assert expected.setdefault(_layer_path(path), ((2, *shape), stacked_spec)) == ((2, *shape), stacked_spec)
    assert stacked == expected
    layer_specs = [spec for path, (_, spec) in stacked.items() if "['layers']['" in path]
    assert all(spec[0] is None for spec in layer_specs if tuple(spec))  # never split over layers
    # Split: the 7 matrices of params, critic; policy and critic Adam mu, nu and master. (The
    # reference is beside the state, placed as the params: training.fixed_shardings.)
    assert sum(1 for spec in layer_specs if tuple(spec)) == (7 * 8 if fsdp * tensor > 1 else 0)


def test_rules_that_split_the_layers_axis_are_refused():
    from jaxrl_llm import models

    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    message = r"sharding rules: the 'layers' axis \(stacked layers\) is never split"
    rules = (("layers", sharding.FSDP), ("embed", sharding.TENSOR))
    with pytest.raises(ValueError, match=message):
        sharding.spec_for(PartitionSpec("layers", "embed"), (2, 8), mesh, rules)
    with pytest.raises(ValueError, match=message):  # whatever the array: the table itself is refused
        sharding.spec_for(PartitionSpec("embed"), (8,), mesh, rules)
    _, stacked = models.init(
        models.ModelConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=4,
            scan_layers=True,
        ),
        jax.random.key(0),
    )
    with pytest.raises(ValueError, match=message):
        sharding.param_shardings(stacked, mesh, rules)
    for preset in sharding.RULES.values():  # no preset splits it
        assert "layers" not in dict(preset)
        sharding.param_shardings(stacked, mesh, preset)


@pytest.mark.parametrize("data, fsdp, tensor", MESHES)
def test_params_optimizer_state_and_critic_carry_the_shardings_the_rules_say(data, fsdp, tensor):
    import jax.numpy as jnp

    from jaxrl_llm import algorithms, training
    from jaxrl_llm.training import optim

    mesh = sharding.make_mesh(data=data, fsdp=fsdp, tensor=tensor)
    model, params, state = _model_and_state(algorithms.PPO, jnp.bfloat16)  # a critic and float32 master copies
    policy, critic = optim.run_optimizers(algorithms.PPO, training.TrainConfig(), decay_steps=1)
    rules = sharding.RULES["fsdp_tensor"]
    placed = jax.device_put(
        state, sharding.state_shardings(state, mesh, rules, optimizer=policy, critic_optimizer=critic)
    )
    fixed = training.fixed_params(params, algorithms.PPO, training.TrainConfig())
    fixed = jax.device_put(fixed, training.fixed_shardings(fixed, mesh, rules))
    checked = 0
    for field in ("params", "reference", "critic_params", "opt_state", "critic_opt_state"):
        for path, leaf in jax.tree_util.tree_flatten_with_path(
            getattr(fixed if field == "reference" else placed, field)
        )[0]:
            names = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
            name = next((n for n in reversed(names) if n not in ("value", "")), "")
            in_head = "head" in names
            if leaf.ndim >= 2 and not in_head:  # matrices: parameters, their moments and master copies
                assert tuple(leaf.sharding.spec) == _expected_spec(name, leaf.shape, fsdp, tensor), (field, names)
                checked += 1
            else:  # norms, the critic's head, counts, hyperparameters: whole
                assert leaf.sharding.is_fully_replicated, (field, names, leaf.sharding)
    # params, reference, critic backbone; policy and critic Adam mu, nu and master: 9 per matrix.
    assert checked == 9 * 9
    for leaf in jax.tree.leaves(
        placed._replace(params=None, critic_params=None, opt_state=None, critic_opt_state=None)
    ):
        assert leaf.sharding.is_fully_replicated


def test_a_state_built_from_params_on_a_mesh_keeps_their_shardings():
    # init_state builds the copy and the optimizer state in one program only for params on
    # one device: jitted on a mesh, the optimizer's zeros would come out replicated.
    from jaxrl_llm import algorithms, training

    model, params, _ = _model_and_state(algorithms.GRPO)
    mesh = sharding.make_mesh(fsdp=4, tensor=2)
    placed = jax.device_put(params, sharding.param_shardings(params, mesh, sharding.RULES["fsdp_tensor"]))
    state = training.init_state(model, placed, algorithms.GRPO, training.TrainConfig())
    checked = 0
    for field in ("params", "opt_state"):
        for path, leaf in jax.tree_util.tree_flatten_with_path(getattr(state, field))[0]:
            if leaf.ndim >= 2:  # the matrices and their moments
                names = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
                name = next(n for n in reversed(names) if n not in ("value", ""))
                assert tuple(leaf.sharding.spec) == _expected_spec(name, leaf.shape, 4, 2), (field, names)
                checked += 1
    assert checked == 3 * 9  # each matrix, its Adam mu and nu


def test_a_state_of_params_spread_leaf_by_leaf_over_devices_is_built_where_they_are():
    from jaxrl_llm import algorithms, training

    model, params, _ = _model_and_state(algorithms.GRPO)
    leaves, tree = jax.tree.flatten(params)
    devices = jax.devices()
    spread = jax.tree.unflatten(tree, [jax.device_put(x, devices[i % 2]) for i, x in enumerate(leaves)])
    state = training.init_state(model, spread, algorithms.GRPO, training.TrainConfig())
    for given, copy in zip(jax.tree.leaves(spread), jax.tree.leaves(state.params), strict=True):
        assert copy.devices() == given.devices() and np.array_equal(copy, given)


def test_fsdp_holds_an_eighth_of_the_matrices_on_each_device():
    from jaxrl_llm import algorithms, training
    from jaxrl_llm.training import optim

    _, params, state = _model_and_state(algorithms.GRPO)
    policy, _ = optim.run_optimizers(algorithms.GRPO, training.TrainConfig(), decay_steps=1)
    mesh = sharding.make_mesh(fsdp=8)
    placed = jax.device_put(state, sharding.state_shardings(state, mesh, sharding.RULES["fsdp"], optimizer=policy))
    fixed = training.fixed_params(params, algorithms.GRPO, training.TrainConfig())
    fixed = jax.device_put(fixed, training.fixed_shardings(fixed, mesh, sharding.RULES["fsdp"]))
    device = jax.devices()[0]

    def nbytes(tree, on_device):
        total = 0
        for leaf in jax.tree.leaves(tree):
            if leaf.ndim >= 2:
                total += (
                    sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
                    if on_device
                    else leaf.nbytes
                )
        return total

    for tree in (placed.params, placed.opt_state, fixed.reference):
        assert nbytes(tree, True) * 8 == nbytes(tree, False)


@functools.cache
def _single_device_step(method: str):
    """``(run, model, params, batch, train_step, score_metrics, new_state, metrics)`` of one
    step of ``method`` on one device, computed once per test process."""
    from jaxrl_llm import algorithms, models, training
    from tests.training.test_step import CONFIG, RUN, _batch

    algorithm = algorithms.get(method)
    # 8 prompts: 8 data devices split them. Adam divides by sqrt(v) + eps: a coordinate
    # whose gradient is rounding noise (a token no row holds) would step by about +-lr on
    # that noise; a larger eps keeps the comparison on the arithmetic sharding changes.
    run = dataclasses.replace(
        RUN,
        num_prompts=8,
        group_size=2,
        minibatch_size=8 if method == "ppo" else None,
        exact_kl=True,
        optimizer=dataclasses.replace(RUN.optimizer, adam_eps=1e-4),
    )
    model, params = models.init(CONFIG, jax.random.key(0))
    train_step = training.make_train_step(model, algorithm, run)
    batch = _batch(model, params, run=run)
    state, fixed = training.init_state(model, params, algorithm, run), training.fixed_params(params, algorithm, run)
    scored, score_metrics = jax.jit(train_step.score)(state, fixed, batch)
    new, metrics = jax.jit(train_step.update)(state, fixed, scored)
    return run, model, params, batch, train_step, score_metrics, new, metrics


# Every mesh at least once: GRPO on 1x8x1 and 2x2x2, PPO on 2x4x1 and 1x4x2, TRPO (the
# costliest to compile) on 2x2x2, DAPO on 8x1x1 and 1x4x2. (The full 4 x 5 cross passes
# too; its 20 compilations would take a quarter of CI's budget.)
STEP_CASES = [
    ("grpo", (1, 8, 1)),
    ("grpo", (2, 2, 2)),
    ("ppo", (2, 4, 1)),
    ("ppo", (1, 4, 2)),
    ("trpo", (2, 2, 2)),
    ("dapo", (8, 1, 1)),
    ("dapo", (1, 4, 2)),
]
assert {mesh for _, mesh in STEP_CASES} == set(MESHES)


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, mesh_shape", STEP_CASES, ids=[f"{method}-{'x'.join(map(str, mesh))}" for method, mesh in STEP_CASES]
)
def test_the_jitted_step_on_a_sharded_state_updates_like_the_single_device_step(method, mesh_shape):
    """The train step's halves, jitted over a state placed by the rules and a batch placed
    by ``batch_shardings`` (XLA partitions the rest), give the single-device step's
    losses and parameters, and the new state keeps the rules' shardings. PPO takes two
    shuffled minibatches, so rows are gathered across devices."""
    from jaxrl_llm import algorithms, training

    algorithm = algorithms.get(method)
    run, model, params, batch, train_step, expected_score_metrics, expected, expected_metrics = _single_device_step(
        method
    )

    mesh = sharding.make_mesh(data=mesh_shape[0], fsdp=mesh_shape[1], tensor=mesh_shape[2])
    state, fixed = training.init_state(model, params, algorithm, run), training.fixed_params(params, algorithm, run)
    shardings = training.state_shardings(state, algorithm, run, mesh, sharding.RULES["fsdp_tensor"])
    state = jax.device_put(state, shardings)
    fixed = jax.device_put(fixed, training.fixed_shardings(fixed, mesh, sharding.RULES["fsdp_tensor"]))
    placed_batch = jax.device_put(batch, training.batch.batch_shardings(mesh))
    scored, score_metrics = jax.jit(train_step.score)(state, fixed, placed_batch)
    new, metrics = jax.jit(train_step.update, out_shardings=(shardings, None))(state, fixed, scored)

    for name in ("kl_exact", "advantage_std"):
        np.testing.assert_allclose(
            float(score_metrics[name]), float(expected_score_metrics[name]), rtol=1e-5, atol=1e-7, err_msg=name
        )
    for name in ("loss", "grad_norm", "kl_k3"):
        np.testing.assert_allclose(
            float(metrics[name]), float(expected_metrics[name]), rtol=1e-5, atol=1e-7, err_msg=name
        )
    for got, want in zip(jax.tree.leaves(new.params), jax.tree.leaves(expected.params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)
    wanted = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}
    got_leaves = jax.tree_util.tree_flatten_with_path(new)[0]
    assert [jax.tree_util.keystr(p) for p, _ in got_leaves] == list(wanted)
    for path, got in got_leaves:
        if not jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key):  # a key's sharding covers its bits too
            want = wanted[jax.tree_util.keystr(path)]
            assert got.sharding.is_equivalent_to(want, got.ndim), (path, got.sharding, want)


@pytest.mark.slow
def test_the_jitted_step_on_a_sharded_stacked_state_updates_like_the_unrolled_single_device_step():
    """The stacked layout (``scan_layers``) on a data x fsdp x tensor mesh: the unrolled
    single-device step's losses and parameters (layer by layer), and the new state keeps
    the rules' shardings, each stacked leaf whole over its layers."""
    from jaxrl_llm import algorithms, models, training
    from jaxrl_llm.models import decoder

    algorithm = algorithms.get("grpo")
    run, model, params, batch, _, expected_score_metrics, expected, expected_metrics = _single_device_step("grpo")
    scanned, stacked = models.with_scan_layers(model, params, True)
    train_step = training.make_train_step(scanned, algorithm, run)
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    state, fixed = training.init_state(scanned, stacked, algorithm, run), training.fixed_params(stacked, algorithm, run)
    shardings = training.state_shardings(state, algorithm, run, mesh, sharding.RULES["fsdp_tensor"])
    state = jax.device_put(state, shardings)
    fixed = jax.device_put(fixed, training.fixed_shardings(fixed, mesh, sharding.RULES["fsdp_tensor"]))
    scored, score_metrics = jax.jit(train_step.score)(
        state, fixed, jax.device_put(batch, training.batch.batch_shardings(mesh))
    )
    new, metrics = jax.jit(train_step.update, out_shardings=(shardings, None))(state, fixed, scored)

    for name in ("kl_exact", "advantage_std"):
        np.testing.assert_allclose(
            float(score_metrics[name]), float(expected_score_metrics[name]), rtol=1e-5, atol=1e-7, err_msg=name
        )
    for name in ("loss", "grad_norm", "kl_k3"):
        np.testing.assert_allclose(
            float(metrics[name]), float(expected_metrics[name]), rtol=1e-5, atol=1e-7, err_msg=name
        )
    new_params = decoder.unstack_layers(jax.device_get(new.params))
    assert jax.tree.structure(new_params) == jax.tree.structure(expected.params)
    for got, want in zip(jax.tree.leaves(new_params), jax.tree.leaves(expected.params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)
    q_proj = new.params["layers"]["self_attn"]["q_proj"][...]
    assert q_proj.shape[0] == model.config.num_layers and tuple(q_proj.sharding.spec) == (None, "fsdp", "tensor")
    for got, want in zip(jax.tree.leaves(new), jax.tree.leaves(shardings), strict=True):
        if not jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key):  # a key's sharding covers its bits too
            assert got.sharding.is_equivalent_to(want, got.ndim), (got.sharding, want)


@pytest.mark.slow
@pytest.mark.parametrize("method, mesh_shape", [("grpo", (2, 2, 2))])
def test_train_on_a_mesh_runs_the_single_device_run(method, mesh_shape):
    """``training.train(..., mesh=)``: the state placed by the rules and kept so, the same
    metrics and parameters as on one device (the second step samples from the first's
    parameters, so rollouts agree too). PPO's critic on a mesh: the step tests above."""
    from jaxrl_llm import algorithms, models, training
    from tests.training.test_step import CONFIG, RUN, TASK

    algorithm = algorithms.get(method)
    run = dataclasses.replace(RUN, exact_kl=True)
    model, params = models.init(CONFIG, jax.random.key(0))
    expected, expected_history = training.train(model, params, algorithm, run, steps=2, task=TASK)
    mesh = sharding.make_mesh(data=mesh_shape[0], fsdp=mesh_shape[1], tensor=mesh_shape[2])
    state, history = training.train(model, params, algorithm, run, steps=2, task=TASK, mesh=mesh)

    for got, want in zip(history, expected_history):
        for name in ("reward", "loss", "kl_exact", "entropy", "completion_length", "grad_norm"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-6, err_msg=name)
    # atol 1e-4: the first step's KL gradient (policy = reference) is rounding noise, which Adam turns into moves
    # of up to lr |g| / (|g| + eps) that differ between the runs, 3.4e-5 with jax 0.12's XLA (bit-equal with 0.10).
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(expected.params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    q_proj = state.params["layers"][0]["self_attn"]["q_proj"][...]  # [E, H, D]: (fsdp, tensor) by the rules
    assert tuple(q_proj.sharding.spec) == ("fsdp", "tensor")
    assert len({s.device for s in q_proj.addressable_shards}) == 8
    with pytest.raises(ValueError, match="must be among data, fsdp, tensor"):
        training.train(
            model,
            params,
            algorithm,
            RUN,
            steps=1,
            task=TASK,
            mesh=jax.make_mesh((8,), ("model",), axis_types=(AxisType.Auto,)),
        )
