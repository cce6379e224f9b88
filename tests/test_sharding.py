"""Meshes and shardings, on the test's 8 CPU devices."""

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
