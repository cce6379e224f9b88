"""The train state's bytes per device, counted from shardings alone, against a real placement.

``benchmarks/state_memory.py`` reports the state of a 0.5B model on each mesh without
allocating it: per leaf, ``prod(sharding.shard_shape(shape)) * itemsize`` on every device
of its sharding. Here the same count for the default (small) model is checked against
``jax.device_put`` of the real state on the 8 CPU devices, summing each device's
``addressable_shards``.
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
import state_memory  # noqa: E402

from jaxrl_llm import algorithms, models, sharding, training  # noqa: E402
from jaxrl_llm.runs import policy  # noqa: E402

CONFIG = models.ModelConfig(param_dtype=jnp.bfloat16)  # float32 master copies in AdamW's state
RUN = training.TrainConfig()


def _placed_bytes(state: dict) -> dict[jax.Device, dict[str, int]]:
    """Each device's bytes of a placed state (the benchmark's ``resident`` tree), by its columns."""
    totals: dict[jax.Device, dict[str, int]] = {}
    for field in state:
        for leaf in jax.tree.leaves(state[field]):
            for shard in leaf.addressable_shards:
                per_device = totals.setdefault(shard.device, dict.fromkeys(state_memory.GROUPS, 0))
                per_device[state_memory._group(field)] += shard.data.nbytes
    return totals


@pytest.mark.parametrize("name", ["GRPO", "PPO"])
def test_the_count_from_shardings_is_what_a_placed_state_holds_on_each_device(name):
    algorithm = getattr(algorithms, name)
    model, params = models.init(CONFIG, jax.random.key(0))
    state = state_memory.resident(
        training.init_state(model, params, algorithm, RUN), training.fixed_params(params, algorithm, RUN)
    )
    _, abstract = state_memory.abstract_state(CONFIG, algorithm, RUN)
    assert jax.tree.structure(abstract) == jax.tree.structure(state)

    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    single = state_memory.bytes_per_device(abstract, jax.tree.map(lambda _: one, abstract))
    assert single == _placed_bytes(state) == _placed_bytes(jax.device_put(state, one))
    single_total = state_memory.largest(single)["total"]
    assert single_total == sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    assert (single[jax.devices()[0]]["critic"] > 0) == algorithm.needs_critic

    layouts = state_memory.layouts()
    assert [(shape, preset) for shape, preset in layouts] == [
        ((8, 1, 1), "data_parallel"),
        ((1, 8, 1), "fsdp"),
        ((2, 4, 1), "fsdp"),
        ((2, 2, 2), "fsdp"),
        ((2, 2, 2), "fsdp_tensor"),
        ((1, 4, 2), "fsdp"),
        ((1, 4, 2), "fsdp_tensor"),
    ]
    for (data, fsdp, tensor), preset in layouts:
        mesh = sharding.make_mesh(data=data, fsdp=fsdp, tensor=tensor)
        rules = sharding.RULES[preset]
        counted = state_memory.bytes_per_device(
            abstract, policy.checkpoint_shardings(abstract, algorithm, RUN, mesh, rules)
        )
        placed = jax.device_put(state, policy.checkpoint_shardings(state, algorithm, RUN, mesh, rules))
        assert counted == _placed_bytes(placed), (data, fsdp, tensor, preset)
        assert len(counted) == 8
        # Every matrix of the default model divides by 8: each device holds 1/(fsdp x tensor)
        # of the state, plus what stays whole (norms, the critic's head, counters).
        share = state_memory.largest(counted)["total"] / single_total
        ideal = 1 / (fsdp * (tensor if preset == "fsdp_tensor" else 1))
        assert ideal <= share < ideal * 1.01, (data, fsdp, tensor, preset, share)
