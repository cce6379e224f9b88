"""Checkpoints saved from a state sharded over 8 devices, restored onto other meshes.

orbax stores every array whole (its shards written into one zarr array each), so a
restore reads each device's slice for whatever sharding ``like`` asks for: fewer
devices, another layout, one device. The layers' params in either layout: per layer, or
stacked ``[L, ...]`` (``scan_layers``), split within each layer and whole over the layers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import algorithms, models, sharding, training
from jaxrl_llm.training.checkpoint import Checkpointer

# A failed orbax restore leaves its other reads' asyncio tasks behind; they surface later, in any test.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

RUN = training.TrainConfig()
# (method, param dtype, rules, saved on data x fsdp x tensor, restored onto 4 devices as data x fsdp x tensor,
# stacked layers).
CASES = [
    ("GRPO", jnp.float32, "fsdp", (1, 8, 1), (1, 4, 1), False),
    ("GRPO", jnp.float32, "fsdp_tensor", (2, 2, 2), (2, 2, 1), False),
    # bfloat16 params: AdamW keeps float32 master copies; PPO has a critic and its optimizer.
    ("PPO", jnp.bfloat16, "fsdp_tensor", (2, 2, 2), (1, 2, 2), False),
    ("PPO", jnp.bfloat16, "fsdp", (1, 8, 1), (1, 4, 1), False),
    ("GRPO", jnp.float32, "fsdp_tensor", (2, 2, 2), (1, 2, 2), True),
    ("PPO", jnp.bfloat16, "fsdp", (1, 8, 1), (2, 2, 1), True),
]


def _q_proj(params):
    """The first layer's q_proj kernel ``[E, H, D]``, or the stacked ones ``[L, E, H, D]``."""
    layers = params["layers"]
    return (layers["self_attn"] if "self_attn" in layers else layers[0]["self_attn"])["q_proj"][...]


def _state(name: str, param_dtype, scan_layers: bool = False):
    """A state whose every float leaf holds distinct random values (a shard restored to
    the wrong place, or from the wrong device, shows), and the model and params it is for."""
    config = models.ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        param_dtype=param_dtype,
        scan_layers=scan_layers,
    )
    model, params = models.init(config, jax.random.key(0))
    state = training.init_state(model, params, getattr(algorithms, name), RUN)
    leaves, treedef = jax.tree.flatten(state)
    keys = iter(jax.random.split(jax.random.key(1), len(leaves)))
    leaves = [
        jax.random.normal(next(keys), leaf.shape, leaf.dtype) if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf
        for leaf in leaves
    ]
    state = jax.tree.unflatten(treedef, leaves)._replace(step=jnp.asarray(7, jnp.int32))
    return model, params, state


def _placed_like(model, params, name: str, mesh, rules):
    """The abstract state with each leaf's sharding on ``mesh`` by ``rules``: what a run on
    that mesh passes to ``restore``."""
    algorithm = getattr(algorithms, name)
    abstract = jax.eval_shape(lambda p: training.init_state(model, p, algorithm, RUN), params)
    shardings = training.state_shardings(abstract, algorithm, RUN, mesh, sharding.RULES[rules])
    return jax.tree.map(
        lambda leaf, placement: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=placement), abstract, shardings
    ), shardings


def _assert_restored(restored, saved, shardings):
    assert jax.tree.structure(restored) == jax.tree.structure(saved)
    for got, want, placement in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), jax.tree.leaves(shardings)):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.sharding == placement, (got.sharding, placement)
        if jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # bitwise (finite values)
        for shard in got.addressable_shards:  # each device's data is its own slice
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(want)[shard.index])


@pytest.mark.parametrize(
    "name, param_dtype, rules, saved_on, restored_on, scan_layers",
    CASES,
    ids=[f"{c[0]}-{c[2]}-{'x'.join(map(str, c[3]))}{'-stacked' if c[5] else ''}" for c in CASES],
)
def test_a_state_saved_on_8_devices_restores_onto_4_devices_and_onto_one(
    tmp_path, name, param_dtype, rules, saved_on, restored_on, scan_layers
):
    model, params, state = _state(name, param_dtype, scan_layers)
    assert (state.critic_params is not None) == (name == "PPO")
    data, fsdp, tensor = saved_on
    mesh = sharding.make_mesh(data=data, fsdp=fsdp, tensor=tensor)
    _, saved_shardings = _placed_like(model, params, name, mesh, rules)
    saved = jax.device_put(state, saved_shardings)
    q_proj = _q_proj(saved.params)
    assert not q_proj.sharding.is_fully_replicated and len(q_proj.sharding.device_set) == 8
    if scan_layers:  # [L, E, H, D]: whole over the layers
        assert q_proj.shape[0] == model.config.num_layers and q_proj.sharding.spec[0] is None

    with Checkpointer(tmp_path / "run") as checkpoints:
        checkpoints.save(7, saved)

    # (a) four devices, another layout: a fresh process's Checkpointer on a smaller slice.
    data, fsdp, tensor = restored_on
    four = sharding.make_mesh(data=data, fsdp=fsdp, tensor=tensor, devices=jax.devices()[:4])
    assert set(four.devices.flat) == set(jax.devices()[:4])
    like, shardings = _placed_like(model, params, name, four, rules)
    with Checkpointer(tmp_path / "run") as checkpoints:
        restored = checkpoints.restore(7, like=like)
    _assert_restored(restored, state, shardings)
    assert _q_proj(restored.params).sharding.device_set == set(jax.devices()[:4])

    # (b) one device: a 1 x 1 x 1 mesh on a device the state was not saved from first, ...
    device = jax.devices()[5]
    one = sharding.make_mesh(data=1, fsdp=1, tensor=1, devices=[device])
    like, shardings = _placed_like(model, params, name, one, rules)
    with Checkpointer(tmp_path / "run") as checkpoints:
        restored = checkpoints.restore(like=like)
        _assert_restored(restored, state, shardings)
        assert {d for leaf in jax.tree.leaves(restored) for d in leaf.sharding.device_set} == {device}
        # ... and a `like` without shardings: the default device.
        plain = jax.eval_shape(lambda p: training.init_state(model, p, getattr(algorithms, name), RUN), params)
        restored = checkpoints.restore(7, like=plain)
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    _assert_restored(restored, state, jax.tree.map(lambda _: default, plain))
