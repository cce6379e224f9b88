"""Device meshes and the shardings the library places arrays with.

Today the library shards one thing: a rollout's rows, over a 1-D ``("data",)`` mesh,
with the params replicated on it (``sampling.sample(..., mesh=mesh)``). Every row of a
rollout is decoded independently, so each device runs its own prefill and decode loop
(``shard_map``) on its share of the prompts and their ``G`` completions, stopping when
its own rows have finished, with no communication; the random numbers are drawn for the
whole batch first, so the samples are the ones a single device draws.

.. code-block:: python

    mesh = sharding.make_mesh()            # every local device on the "data" axis
    rollout = sampler(params, prompts, prompt_mask, key, ...)   # Sampler(mesh=mesh)

On a CPU host, ``jax.config.update("jax_num_cpu_devices", k)`` (before JAX's first
computation) splits it into ``k`` devices; the devices' programs run concurrently, which
suits decode steps' small matmuls better than splitting each of them over the cores.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

DATA = "data"
"""The mesh axis that batch rows are split over."""
ROWS = PartitionSpec(DATA)
"""Leading axis split over ``data``, the rest whole (as a ``shard_map`` spec too)."""
WHOLE = PartitionSpec()
"""Not split: a full copy on every device."""


def make_mesh(num_devices: int | None = None, *, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D ``("data",)`` mesh over the first ``num_devices`` of ``devices`` (default:
    all of ``jax.devices()``)."""
    devices = list(jax.devices() if devices is None else devices)
    count = len(devices) if num_devices is None else num_devices
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= len(devices):
        raise ValueError(f"make_mesh: `num_devices` must be an integer in [1, {len(devices)}] (the devices "
                         f"available); got {num_devices!r}.")
    return jax.make_mesh((count,), (DATA,), axis_types=(AxisType.Auto,), devices=devices[:count])


def rows(mesh: Mesh) -> NamedSharding:
    """Leading axis split over the mesh's ``data`` axis, the rest whole."""
    return NamedSharding(mesh, ROWS)


def replicated(mesh: Mesh) -> NamedSharding:
    """A full copy on every device of the mesh."""
    return NamedSharding(mesh, WHOLE)


def data_size(mesh: Mesh) -> int:
    """Devices along the ``data`` axis."""
    if DATA not in mesh.shape:
        raise ValueError(f"The mesh needs a {DATA!r} axis to split rows over; its axes are {tuple(mesh.shape)}.")
    return mesh.shape[DATA]
