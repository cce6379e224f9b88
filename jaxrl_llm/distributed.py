r"""Multi-process runs: one JAX process per host (or per GPU), one mesh over all of them.

JAX runs a mesh that spans several processes (GPU nodes, TPU pod slices, SLURM jobs)
with its own runtime: every process runs the same program, calls
:func:`initialize` first, builds the same global mesh over ``jax.devices()`` (all
processes' devices) and calls the same jitted functions in the same order. A
``jax.Array`` on that mesh is *global*: each process holds only the shards on its own
devices (``addressable_shards``), and XLA moves data between processes inside the
jitted computations.

What this module adds over JAX's own API is the host side of a batch split over the
rows axes ``("data", "fsdp")``:

.. code-block:: python

    distributed.initialize()                         # first; flags or the cluster's env
    mesh = sharding.make_mesh(fsdp=8)                # over every process's devices
    state = distributed.put(state, training.state_shardings(state, algorithm, config, mesh, rules))
    fixed = distributed.put(fixed, training.fixed_shardings(fixed, mesh, rules))  # reference, LoRA base
    rows = distributed.local_rows(mesh, batch_size)  # [b] global rows of this process
    rewards = reward_fn(completions[rows])           # host work on this process's rows only
    batch = distributed.global_array(local_batch, mesh, specs)  # [B, ...] global, from [b, ...] each
    scored, score_metrics = score(state, fixed, batch)
    state, update_metrics = update(state, fixed, scored)
    metrics = distributed.replicated_to_host({**score_metrics, **update_metrics})  # global already
    if distributed.is_main_process():
        log(metrics)

In a single process every helper is a plain conversion (``local_rows`` is every row,
``global_array`` is ``jax.device_put``, ``to_local`` is ``np.asarray``), so the same
code runs on one host.

**Which rows a process holds.** The mesh's device order decides it: a process holds the
rows of the shards on its devices, ``local_rows`` in increasing order (one contiguous
block on meshes from :func:`jaxrl_llm.sharding.make_mesh` over CPUs and GPUs; on a TPU
slice the topology may order a host's chips apart). ``global_array`` takes and
``to_local`` gives exactly those rows, in that order. Rows held by several processes
(a mesh whose ``tensor`` axis spans processes) are given by each of them, identically.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm import sharding

logger = logging.getLogger(__name__)

ROW_AXES = (sharding.DATA, sharding.FSDP)
"""The mesh axes a batch's rows are split over, in this order."""

_settings: dict[str, Any] | None = None  # what initialize() connected with


def initialize(
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
    timeout_s: int = 300,
) -> tuple[int, int]:
    """Connects this process to the others of the run (``jax.distributed.initialize``);
    returns ``(process_index, process_count)``.

    Call it first, before any JAX computation (or ``jax.devices()``) in the process.
    Arguments left ``None`` come from the environment: JAX detects SLURM
    (``srun``), Open MPI (``mpirun``), Cloud TPU VMs and Kubernetes jobs itself, and reads
    ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0), ``JAX_COORDINATOR_PORT``
    (the port, with a detected cluster) and ``JAX_LOCAL_DEVICE_IDS`` (``0,1,...``). On
    other launchers give ``coordinator_address``, ``num_processes`` and ``process_id``.

    Args:
      coordinator_address: ``host:port`` of process 0, where it serves the
        coordination service (a free port; every process gives the same one).
      num_processes: processes in the run.
      process_id: this process's index, ``0 <= process_id < num_processes``.
      local_device_ids: the local GPUs this process uses (default: all of them,
        except under SLURM / Open MPI on GPUs, where JAX gives each process the one GPU of
        its local rank).
      timeout_s: how long to wait for the other processes to connect.

    On CPUs, the processes' devices compute together through gloo (TCP), JAX's
    ``jax_cpu_collectives_implementation``; it is set to ``"gloo"`` unless a value
    was chosen (``"mpi"``). A second call with the same arguments returns the same
    answer (arguments left ``None`` match anything); different ones, or a first call after
    JAX started its backends, raise RuntimeError.
    """
    global _settings
    settings = dict(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=None if local_device_ids is None else tuple(local_device_ids),
    )
    if jax.distributed.is_initialized():
        given = {name: value for name, value in settings.items() if value is not None}
        if _settings is not None and any(_settings[name] != value for name, value in given.items()):
            raise RuntimeError(
                f"distributed.initialize: already connected with {_settings}; called again with "
                f"{given}. Initialise once per process."
            )
        return jax.process_index(), jax.process_count()
    if jax.config.jax_cpu_collectives_implementation is None:
        # Without it, a CPU computation over several processes' devices fails.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            local_device_ids=local_device_ids,
            initialization_timeout=timeout_s,
        )
    except ValueError as error:  # a value neither given nor found in the environment
        raise ValueError(
            f"distributed.initialize: {error} No cluster was detected (SLURM, Open MPI, Cloud TPU, Kubernetes): "
            "give coordinator_address='host:port' of process 0 (or set JAX_COORDINATOR_ADDRESS), num_processes "
            "and process_id."
        ) from error
    _settings = settings
    index, count = jax.process_index(), jax.process_count()
    logger.info(
        "JAX process %d of %d: %d local devices of %d (%s).",
        index,
        count,
        jax.local_device_count(),
        jax.device_count(),
        jax.devices()[0].platform,
    )
    return index, count


def is_main_process() -> bool:
    """Whether this is process 0, the one that writes logs, metrics files and exports."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Waits until every process reaches ``barrier(name)`` (after process 0 has written
    what the others read); nothing in one process."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils  # noqa: PLC0415

        multihost_utils.sync_global_devices(name)


def rows_sharding(mesh: Mesh) -> NamedSharding:
    """A batch's leading axis split over the mesh's ``data`` and ``fsdp`` axes (those it
    has), the rest whole: the placement of ``score``'s and ``update``'s inputs."""
    axes = tuple(axis for axis in ROW_AXES if axis in mesh.axis_names)
    return NamedSharding(mesh, PartitionSpec(axes or None))


def _sharding(mesh: Mesh, spec: PartitionSpec | None) -> NamedSharding:
    return rows_sharding(mesh) if spec is None else NamedSharding(mesh, spec)


def local_rows(mesh: Mesh, num_rows: int, *, spec: PartitionSpec | None = None) -> np.ndarray:
    """``[b]`` int: the global rows of a ``[num_rows, ...]`` array split by ``spec``
    (default :func:`rows_sharding`) that live on this process's devices, ascending.

    ``b = num_rows / (row devices) * (this process's row devices)``; every row in one
    process is ``np.arange(num_rows)``. Index host data with it: ``batch[local_rows(...)]``.
    """
    shard = _sharding(mesh, spec)
    splits = int(np.prod([mesh.shape[axis] for axis in _axes(shard.spec[0] if shard.spec else None)]))
    if num_rows % splits:
        raise ValueError(
            f"local_rows: {num_rows} rows cannot be split evenly over {splits} devices "
            f"({shard.spec}); use a multiple of {splits}."
        )
    starts = sorted(
        {index[0].indices(num_rows)[:2] for index in shard.addressable_devices_indices_map((num_rows,)).values()}
    )
    return np.concatenate([np.arange(start, stop) for start, stop in starts])


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def global_array(local, mesh: Mesh, spec=None):
    """Global ``jax.Array`` s from this process's part of them: ``local`` a pytree
    (``None`` leaves stay ``None``) whose leaves ``[b, ...]`` hold the rows
    :func:`local_rows` names for their spec, in that order, and become ``[B, ...]``.

    ``spec``: one ``PartitionSpec`` for every leaf (default: :func:`rows_sharding`'s), or
    a pytree of them shaped like ``local`` (``Batch(prompt_tokens=P("data"), ...,
    rewards=P(("data", "fsdp")), prompts_drawn=P())``). A leaf with spec ``P()`` is whole
    and the same on every process (a scalar such as a count).

    Every process calls it, with its own rows (``jax.make_array_from_process_local_data``;
    one process: ``jax.device_put``). No data crosses processes.
    """
    if spec is None or isinstance(spec, PartitionSpec):
        shard = _sharding(mesh, spec)
        return jax.tree.map(lambda leaf: _from_process(leaf, shard), local)

    def one(leaf_spec, leaf):
        return None if leaf is None else _from_process(leaf, _sharding(mesh, leaf_spec))

    return jax.tree.map(one, spec, local, is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None)


def _from_process(leaf, shard: NamedSharding) -> jax.Array:
    return jax.make_array_from_process_local_data(shard, np.asarray(leaf))


def put(tree, shardings):
    """``jax.device_put(tree, shardings)`` for values every process holds whole and
    identically (params from the same seed or file, a fresh train state): each process
    copies its shards from its own copy, with no communication.

    Across processes ``jax.device_put`` checks that a host value is the same everywhere
    with one collective per leaf, and refuses PRNG keys; this does neither. Leaves that
    are global arrays already are resharded by ``jax.device_put``.
    """
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    if isinstance(shardings, jax.sharding.Sharding):  # one for every leaf, as jax.device_put takes it
        shardings = jax.tree.map(lambda _: shardings, tree)

    def one(leaf, target):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            return jax.device_put(leaf, target)
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):  # placed as its raw bits
            data = put(jax.random.key_data(leaf), _key_data_sharding(target, leaf.ndim))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
        value = np.asarray(leaf)
        return jax.make_array_from_callback(value.shape, target, lambda index: value[index])

    return jax.tree.map(one, tree, shardings)


def _key_data_sharding(target: NamedSharding, ndim: int) -> NamedSharding:
    """The sharding of a key's bits (a trailing, whole axis) for a key placed by ``target``."""
    spec = tuple(target.spec) + (None,) * (ndim - len(target.spec))
    return NamedSharding(target.mesh, PartitionSpec(*spec, None))


def to_local(tree):
    """This process's part of each array of ``tree`` as NumPy: the rows
    :func:`local_rows` names for a row-split ``[B, ...]`` array, in that order (shards
    held twice, on replicas, taken once). The inverse of :func:`global_array`; in one
    process the whole array. No communication."""
    return jax.tree.map(_local, tree)


def _local(x) -> np.ndarray:
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    shards = {tuple(s.indices(n)[:2] for s, n in zip(shard.index, x.shape)): shard for shard in x.addressable_shards}
    # This process's blocks along each dimension, by start: their place in its part.
    starts = [sorted({bounds[d][0] for bounds in shards}) for d in range(x.ndim)]
    block = next(iter(shards.values())).data.shape
    out = np.empty(tuple(len(s) * b for s, b in zip(starts, block)), dtype=x.dtype)
    for bounds, shard in shards.items():
        where = tuple(
            slice(s.index(start) * b, (s.index(start) + 1) * b) for s, (start, _), b in zip(starts, bounds, block)
        )
        out[where] = np.asarray(shard.data)
    return out


def replicated_to_host(tree):
    """Each leaf of ``tree``, a fully replicated array (a jitted function's scalar metrics,
    step counters), as NumPy, read from a local copy. No communication.

    Raises ValueError for an array split over devices: use :func:`to_local` for this
    process's rows, :func:`gather` for the whole value."""

    def one(x):
        if not isinstance(x, jax.Array):
            return np.asarray(x)
        if not x.is_fully_replicated:
            raise ValueError(
                f"replicated_to_host: an array {x.shape} split by {x.sharding} is not whole on this "
                "process; use distributed.to_local for its rows or distributed.gather for all of it."
            )
        return np.asarray(x.addressable_data(0))

    return jax.tree.map(one, tree)


def _identity(tree):
    return tree


def _replicated(shard: jax.sharding.Sharding) -> NamedSharding:
    """A whole copy on each device of ``shard``."""
    if isinstance(shard, NamedSharding):
        return NamedSharding(shard.mesh, PartitionSpec())
    devices = sorted(shard.device_set, key=lambda device: device.id)
    return NamedSharding(Mesh(np.array(devices), ("devices",)), PartitionSpec())


def gather(tree):
    """The whole value of each array of ``tree`` as NumPy on every process (params to
    save or export). Collective: every process calls it, with arrays of the same
    shapes and shardings; the split ones are replicated in one jitted copy, so each
    process needs the memory for all of it."""
    leaves, treedef = jax.tree.flatten(tree)
    split = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and not x.is_fully_addressable]
    if split:
        targets = [_replicated(leaves[i].sharding) for i in split]
        whole = jax.jit(_identity, out_shardings=targets)([leaves[i] for i in split])
        for i, x in zip(split, whole):
            leaves[i] = x.addressable_data(0)
    return jax.tree.unflatten(treedef, [np.asarray(x) for x in leaves])


def process_sum(tree):
    """Each leaf (a host number or array, the same shape on every process) summed over
    processes, as NumPy, on every process. Collective; one process: the value itself.
    Float64 values are summed in float32 unless ``jax_enable_x64``."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    from jax.experimental import multihost_utils  # noqa: PLC0415

    return jax.tree.map(lambda stacked: stacked.sum(axis=0), multihost_utils.process_allgather(tree))


def process_mean(tree):
    """:func:`process_sum` divided by the number of processes: the mean of per-process
    means over equal numbers of rows (``local_rows`` gives each process as many)."""
    count = jax.process_count()
    return jax.tree.map(lambda total: total / count, process_sum(tree))
