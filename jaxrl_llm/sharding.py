"""Device meshes and the shardings the library places arrays with.

**Meshes and rules.** :func:`make_mesh` builds a mesh over the named axes ``data``,
``fsdp`` and ``tensor``. A rules table (:data:`RULES`) maps the model's logical axis names
(``vocab``, ``embed``, ``heads``, ``kv_heads``, ``head_dim``, ``mlp``, ``norm``; see
:func:`logical_axes`) to mesh axes, and :func:`param_shardings` /
:func:`state_shardings` turn it into the ``NamedSharding`` of every parameter and of the
whole :class:`~jaxrl_llm.training.TrainState` (optimizer moments follow their
parameters through ``optax.tree_utils.tree_map_params``):

.. code-block:: python

    mesh = sharding.make_mesh(data=2, fsdp=4)
    shardings = sharding.state_shardings(state, mesh, sharding.RULES["fsdp"], optimizer=...)
    state = jax.device_put(state, shardings)

A dimension is split only when its size is a multiple of the mesh axis's; otherwise it
stays whole (a 2-head KV projection on a 4-way ``tensor`` axis is replicated).

**Rollouts.** The sampler splits a rollout's rows over the ``data`` and ``fsdp`` axes,
with the params gathered whole on each device (``sampling.sample(..., mesh=mesh)``, which
says what happens when the prompts or rows do not split so; with a ``tensor`` axis the
params stay split by it). Every row of a rollout is decoded independently, so each
device runs its own prefill and decode loop (``shard_map``) on its share of the prompts
and their ``G`` completions, stopping when its own rows have finished, with no
communication; the random numbers are drawn for the whole batch first, so the samples
are the ones a single device draws.

.. code-block:: python

    mesh = sharding.make_mesh()            # every local device on the "data" axis
    rollout = sampler(params, prompts, prompt_mask, key, ...)   # Sampler(mesh=mesh)

On a CPU host, ``jax.config.update("jax_num_cpu_devices", k)`` (before JAX's first
computation) splits it into ``k`` devices; the devices' programs run concurrently, which
suits decode steps' small matmuls better than splitting each of them over the cores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

DATA = "data"
"""The mesh axis that batch rows are split over."""
FSDP = "fsdp"
"""The mesh axis that parameters and optimizer state are split over (and batch rows too)."""
TENSOR = "tensor"
"""The mesh axis that attention heads, MLP columns and the vocabulary are split over."""
AXES = (DATA, FSDP, TENSOR)
"""The mesh axes the library knows, in mesh order."""

Rules = tuple[tuple[str, str], ...]
"""``((logical_name, mesh_axis), ...)``: logical names not listed stay whole."""

RULES: dict[str, Rules] = {
    "data_parallel": (),
    "fsdp": (("embed", FSDP),),
    "fsdp_tensor": (("embed", FSDP), ("vocab", TENSOR), ("heads", TENSOR), ("kv_heads", TENSOR), ("mlp", TENSOR)),
}
"""Presets. ``data_parallel``: every parameter whole on every device. ``fsdp``: every
matrix split along its model dimension over ``fsdp`` (ZeRO-3: each device holds
``1/fsdp`` of parameters and optimizer state). ``fsdp_tensor``: that, and Megatron's
tensor parallelism over ``tensor``: query/key/value projections split by head, the
output projection by its input heads, the MLP's gate/up by column and down by row,
embeddings and output layer by vocabulary. Norm scales stay whole."""
TENSOR_PARALLEL: Rules = tuple((name, axis) for name, axis in RULES["fsdp_tensor"] if axis == TENSOR)
"""The tensor-parallel half of ``fsdp_tensor``: how the sampler keeps the params split
on a mesh with a ``tensor`` axis (the ``fsdp`` split is gathered once per rollout, not
at every decode step)."""
LAYERS = "layers"
"""The logical axis of stacked layers (``ModelConfig.scan_layers``): never split."""
ROWS = PartitionSpec(DATA)
"""Leading axis split over ``data``, the rest whole (as a ``shard_map`` spec too)."""
WHOLE = PartitionSpec()
"""Not split: a full copy on every device."""


def make_mesh(
    num_devices: int | None = None,
    *,
    fsdp: int | None = None,
    tensor: int | None = None,
    data: int | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A mesh over the first devices of ``devices`` (default: all of ``jax.devices()``).

    ``make_mesh(k)`` (or ``make_mesh()``: every device) is a 1-D ``("data",)`` mesh of
    ``k`` devices, what the sampler splits rows over. With ``fsdp`` or ``tensor`` it is
    the 3-D ``("data", "fsdp", "tensor")`` mesh of ``data x fsdp x tensor`` devices
    (``data`` defaults to the devices left over), e.g. ``make_mesh(data=2, fsdp=2,
    tensor=2)`` on 8 devices.
    """
    devices = list(jax.devices() if devices is None else devices)

    def size(name, value, default):
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= len(devices):
            hint = (
                " On a CPU, JAX_NUM_CPU_DEVICES=k (before JAX starts) splits it into k devices."
                if devices[0].platform == "cpu"
                else ""
            )
            raise ValueError(
                f"make_mesh: `{name}` must be an integer in [1, {len(devices)}] (the devices "
                f"available); got {value!r}.{hint}"
            )
        return value

    if fsdp is None and tensor is None and data is None:
        count = size("num_devices", num_devices, len(devices))
        return jax.make_mesh((count,), (DATA,), axis_types=(AxisType.Auto,), devices=devices[:count])
    if num_devices is not None:
        raise ValueError(
            "make_mesh: pass `num_devices` for a 1-D data mesh, or the axis sizes (data, fsdp, tensor), not both."
        )
    fsdp, tensor = size("fsdp", fsdp, 1), size("tensor", tensor, 1)
    data = size("data", data, max(len(devices) // (fsdp * tensor), 1))
    if data * fsdp * tensor > len(devices):
        raise ValueError(
            f"make_mesh: data x fsdp x tensor = {data} x {fsdp} x {tensor} = {data * fsdp * tensor} "
            f"devices; {len(devices)} are available."
        )
    return jax.make_mesh(
        (data, fsdp, tensor), AXES, axis_types=(AxisType.Auto,) * 3, devices=devices[: data * fsdp * tensor]
    )


def spec_for(logical: PartitionSpec, shape: tuple[int, ...], mesh: Mesh, rules: Rules) -> PartitionSpec:
    """The mesh ``PartitionSpec`` of an array whose dimensions have the logical names
    ``logical``: each name mapped by ``rules`` to a mesh axis of size > 1 that divides
    the dimension and is not used by an earlier one; ``None`` (whole) otherwise."""
    table = dict(rules)
    unknown = [axis for axis in table.values() if axis not in AXES]
    if unknown:
        raise ValueError(f"sharding rules: unknown mesh axis {unknown[0]!r}; the axes are {', '.join(AXES)}.")
    if LAYERS in table:
        raise ValueError(
            f"sharding rules: the {LAYERS!r} axis (stacked layers) is never split: each step of the layer scan "
            "reads one whole layer. Split the axes within a layer instead (embed, heads, kv_heads, mlp, vocab)."
        )
    used: set[str] = set()
    spec = []
    for name, dim in zip(tuple(logical) + (None,) * (len(shape) - len(logical)), shape):
        axis = table.get(name)
        if axis is not None and axis not in used and mesh.shape.get(axis, 1) > 1 and dim % mesh.shape[axis] == 0:
            used.add(axis)
            spec.append(axis)
        else:
            spec.append(None)
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def logical_axes(params) -> Any:
    """The pytree of ``PartitionSpec``s of logical axis names, one per parameter: the names
    the model's layers give their params (``nnx`` sharding metadata), which :data:`RULES`
    map to mesh axes."""
    return nnx.get_partition_spec(params)


def param_shardings(params, mesh: Mesh, rules: Rules):
    """The ``NamedSharding`` of each parameter of a model's params (arrays or
    ``jax.ShapeDtypeStruct``), by its logical axis names (:func:`logical_axes`) and ``rules``."""
    logical = logical_axes(params)
    return jax.tree.map(
        lambda names, leaf: NamedSharding(mesh, spec_for(names, leaf.shape, mesh, rules)),
        logical,
        params,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def state_shardings(state, mesh: Mesh, rules: Rules, *, optimizer, critic_optimizer=None):
    """The ``NamedSharding`` of every leaf of a :class:`~jaxrl_llm.training.TrainState`
    (arrays or abstract): the policy by ``rules``, the critic's backbone too
    (its head whole), optimizer moments and master copies like the parameters they belong
    to (``optax.tree_utils.tree_map_params`` with the ``optimizer`` that made them, and
    ``critic_optimizer`` for the critic's), everything else (step counts,
    hyperparameters, PRNG key, counters, running baseline) whole on every device."""
    whole = replicated(mesh)
    policy = param_shardings(state.params, mesh, rules)

    def optimizer_state(opt_state, params, shardings, transform):
        if transform is None or not jax.tree.leaves(opt_state):
            return jax.tree.map(lambda _: whole, opt_state)
        flat_shardings = dict(zip(_paths(params), jax.tree.leaves(shardings)))
        return optax.tree_utils.tree_map_params(
            transform,
            lambda leaf, path: None if leaf is None else flat_shardings[path],
            opt_state,
            _path_tree(params),
            transform_non_params=lambda _: whole,
            is_leaf=lambda x: x is None,
        )

    critic = critic_opt = None
    if state.critic_params is not None:
        critic = {
            "backbone": param_shardings(state.critic_params["backbone"], mesh, rules),
            "head": jax.tree.map(lambda _: whole, state.critic_params["head"]),
        }
        critic_opt = optimizer_state(state.critic_opt_state, state.critic_params, critic, critic_optimizer)
    rest = {
        name: jax.tree.map(lambda _: whole, getattr(state, name))
        for name in ("baseline", "key", "step", "skipped_updates", "consecutive_skips", "prompts_drawn")
    }
    return state._replace(
        params=policy,
        opt_state=optimizer_state(state.opt_state, state.params, policy, optimizer),
        critic_params=critic,
        critic_opt_state=critic_opt,
        **rest,
    )


def _paths(tree) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _path_tree(tree):
    """``tree`` with each leaf replaced by its path string (to find its sharding)."""
    return jax.tree.unflatten(jax.tree.structure(tree), _paths(tree))


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
