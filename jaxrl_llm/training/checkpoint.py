"""A run's checkpoints: :class:`TrainState` s saved and restored with orbax's ``CheckpointManager``.

Usage::

    checkpoints = Checkpointer("runs/grpo")
    checkpoints.save(int(state.step), state, metadata={"reward": 0.7})
    ...
    like = jax.eval_shape(lambda p: init_state(model, p, algorithm, config), params)
    state = checkpoints.restore(like=like)  # the latest readable checkpoint
    state, history = train(..., state=state)

**Layout on disk** (orbax's)::

    <directory>/
      <step>/                              one finalized checkpoint per saved step
        _CHECKPOINT_METADATA               JSON: timestamps and our custom metadata (the
                                           caller's ``metadata``, the PRNG key impls and
                                           each array's digest)
        commit_success.txt
        state/                             the arrays: one OCDBT/zarr database
          _METADATA, _sharding, manifest.ocdbt, ocdbt.process_0/, d/, array_metadatas/
      <step>.orbax-checkpoint-tmp-<time>/  a save in progress (or one a crash left): never
                                           listed, restored or counted

A save is written under the temporary name and renamed to ``<step>`` when complete, so a
step directory is always a whole checkpoint (a rename is atomic on local and POSIX file
systems; on object stores orbax marks completion with ``commit_success.txt`` instead).

**What is stored.** The state is saved as a nested dict of arrays keyed by its pytree
path (``state["opt_state"]["inner"]["1"]...``), not as its own pytree: the containers
(``TrainState``, optax's NamedTuples, :class:`~jaxrl_llm.training.optim.Float32State`,
``None`` fields such as ``critic_params`` of a method without a critic, TRPO's empty
``opt_state``) come back from ``like``'s structure, so any pytree node round-trips, and
what holds no array stores nothing. Typed PRNG keys are stored as their raw bits
(``jax.random.key_data``) and re-wrapped with their impl, which the checkpoint records.

**What is verified.** Each checkpoint records, in its custom metadata (written into the
step directory before it is finalized), a 64-bit digest of every array it stores: two
sums over the array's bits, each bit pattern mixed with its position (see :func:`_check`).
They are computed on the devices by exact integer sums, so they do not depend on the
sharding, the number of processes or the file layout, and a restore onto another mesh
checks the same digests. A restore recomputes them on the restored arrays and checks that
every floating-point entry is finite; a checkpoint that fails either is treated as one that
cannot be read (a flipped byte in a data file decodes to wrong values without an error).
Checkpoints saved without digests (before they were recorded) are checked for
finiteness only. :func:`digests` gives the same digests of any pytree: a LoRA run
records its frozen base's, to check on resume that the base it reads is the one it
trained over.

**What is not stored.** The run's :class:`~jaxrl_llm.training.state.FixedParams` (the
reference, LoRA's base): they are inputs of the run, as the model is, not something a step
changes, and not part of the state. A checkpoint holds the state (for LoRA: the adapters,
their optimizer state and the counters), and ``training.train(model, params, ...,
state=state)`` takes the reference and the base from ``params`` again (the run directories
of :mod:`jaxrl_llm.runs` save a reference beside the state, and LoRA's base once).

A state with a non-finite floating-point entry is never saved: ``save`` raises before
writing or rotating anything, so the checkpoints already on disk, the newest good one
among them, stay.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxrl_llm.training.state import TrainState, check_tree

_ITEM = "state"
_OURS = "jaxrl_llm"  # our entry in the step's custom metadata, beside the caller's
_SHOWN = 5  # leaves named in a verification error


def _name(key) -> str:
    """One pytree path entry as a dict key of the saved tree."""
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def _is_key(leaf) -> bool:
    return jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _nest(flat: dict[tuple[str, ...], Any]) -> dict:
    """``{("a", "b"): x}`` -> ``{"a": {"b": x}}``."""
    nested: dict = {}
    for names, leaf in flat.items():
        node = nested
        for name in names[:-1]:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise ValueError(f"Checkpoint: the state's path {'/'.join(names)} runs through a leaf.")
        if names[-1] in node:
            raise ValueError(f"Checkpoint: two leaves of the state are both stored as {'/'.join(names)}.")
        node[names[-1]] = leaf
    return nested


def _paths(tree) -> list[tuple[str, ...]]:
    return [tuple(_name(k) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _data_sharding(key_leaf):
    """The sharding of ``key_data(key)`` for a key (array or abstract) with this sharding.

    A ``NamedSharding`` is used as it is: its spec leaves the trailing key-bits axis whole,
    and the key wrapped back carries exactly it (a spec padded with ``None`` would come
    back as an equivalent but unequal sharding on a one-device mesh)."""
    sharding = getattr(key_leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    if isinstance(key_leaf, jax.Array):
        return jax.random.key_data(key_leaf).sharding
    return sharding


def _fmix(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: a bijection of uint32 words that spreads each bit over all."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


@jax.jit
def _check(leaf: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(digest, non_finite)`` of an array: ``[2]`` uint32 sums, over its elements' bit
    patterns (zero-extended to 32 bits; 64-bit ones as two words), of two bijective mixes of
    the pattern and its position, and the count of its non-finite entries (``0`` unless
    floating). The sums wrap exactly, in any order: the same on any sharding. A change of
    one element always changes both; of several, a sum is unchanged with odds of about
    ``2**-32`` each."""
    if leaf.dtype == jnp.bool_:
        words = leaf.astype(jnp.uint32)
    else:
        words = jax.lax.bitcast_convert_type(leaf, jnp.dtype(f"uint{min(8 * leaf.dtype.itemsize, 32)}"))
        words = words.astype(jnp.uint32)
    index = jnp.zeros(words.shape, jnp.uint32)  # the row-major position (mod 2**32), built without a reshape
    for axis, size in enumerate(words.shape):
        index = index * jnp.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
    first = _fmix(words ^ (index * jnp.uint32(0x9E3779B9)))
    second = _fmix((words + index) * jnp.uint32(0x27D4EB2F) ^ jnp.uint32(0x165667B1))
    digest = jnp.stack([jnp.sum(first, dtype=jnp.uint32), jnp.sum(second, dtype=jnp.uint32)])
    floating = jnp.issubdtype(leaf.dtype, jnp.inexact)
    return digest, jnp.sum(~jnp.isfinite(leaf)) if floating else jnp.zeros((), jnp.int32)


def _checks(flat: dict[tuple[str, ...], Any]) -> dict[str, tuple[str, int]]:
    """``{path: (digest as 16 hex digits, non-finite entries)}`` of the stored arrays.

    One array at a time: many sharded programs in flight at once can deadlock the
    collectives of the CPU backend's simulated devices."""
    checks = {}
    for names, leaf in flat.items():
        digest, bad = jax.device_get(_check(leaf))
        checks["/".join(names)] = ("".join(f"{int(word):08x}" for word in digest), int(bad))
    return checks


def digests(tree) -> dict[str, str]:
    """``{path: digest}`` of every array of ``tree`` (paths joined by ``/`` as a checkpoint
    stores them, digests as 16 hex digits; see :func:`_check`): the same on any sharding,
    process count or file layout, so two loads of the same weights compare equal."""
    flat = {names: jax.random.key_data(leaf) if _is_key(leaf) else leaf for names, leaf in _flat(tree).items()}
    return {path: digest for path, (digest, _) in _checks(flat).items()}


def _flat(tree) -> dict[tuple[str, ...], Any]:
    return dict(zip(_paths(tree), jax.tree.leaves(tree), strict=True))


def _listed(paths: list[str]) -> str:
    return ", ".join(paths[:_SHOWN]) + (f" and {len(paths) - _SHOWN} more" if len(paths) > _SHOWN else "")


def _non_finite(flat: dict[tuple[str, ...], Any], checks: dict[str, tuple[str, int]]) -> list[str]:
    """The paths of the arrays with non-finite entries, each with their count."""
    return [
        f"{'/'.join(names)} ({checks['/'.join(names)][1]} of {leaf.size} entries)"
        for names, leaf in flat.items()
        if checks["/".join(names)][1]
    ]


def _verify(flat: dict[tuple[str, ...], Any], digests: dict[str, str] | None) -> None:
    """Raises ValueError if an array of the restored ``flat`` differs from its saved
    ``digests`` (``None``: saved without them), or holds a non-finite entry."""
    checks = _checks(flat)
    if digests is not None:
        changed = [path for path, (digest, _) in checks.items() if digests.get(path) != digest]
        if changed:
            raise ValueError(f"checksum mismatch in {_listed(changed)}: the stored data is not what was saved")
    non_finite = _non_finite(flat, checks)
    if non_finite:
        raise ValueError(f"non-finite values in {_listed(non_finite)}")


def _leaf(nested: dict, names: tuple[str, ...]):
    for name in names:
        nested = nested[name]
    return nested


def _target(like) -> dict:
    """``like`` as the abstract nested dict orbax restores into: shapes, dtypes, shardings
    (a leaf without one lands on the default device)."""
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    flat = {}
    for names, leaf in zip(_paths(like), jax.tree.leaves(like)):
        if _is_key(leaf):
            data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
            flat[names] = jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=_data_sharding(leaf) or default)
        else:
            sharding = getattr(leaf, "sharding", None) or default
            flat[names] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    return _nest(flat)


class Checkpointer:
    """The checkpoints of one run in ``directory`` (created on the first save).

    Args:
      directory: the run's checkpoint directory (a local path, made absolute, or an
        ``epath`` URL).
      max_to_keep: keep the last this many checkpoints (``None``: all); older ones are
        deleted after each save.

    Saves are synchronous by default (``save`` returns when the checkpoint is complete);
    ``save(..., wait=False)`` returns once the arrays are copied off the device and
    writes in the background, until :meth:`wait`, the next save, or :meth:`close`. Use it
    as a context manager to close it.

    Attributes:
      skipped: the checkpoints the last :meth:`restore` could not use, by step: why
        (``"ValueError: checksum mismatch in params/..."``, an orbax read error, ...).
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"Checkpointer: max_to_keep must be >= 1 or None; got {max_to_keep}.")
        directory = os.fspath(directory)
        # orbax wants absolute paths (a relative one fails mid-save); URLs (gs://...) as given.
        self.directory = directory if "://" in directory else os.path.abspath(directory)
        self._options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=False, enable_async_checkpointing=True
        )
        self._manager: ocp.CheckpointManager | None = None
        self.skipped: dict[int, str] = {}

    def _get(self, *, create: bool) -> ocp.CheckpointManager | None:
        if self._manager is None:
            if not os.path.isdir(self.directory):
                if not create:
                    return None
                os.makedirs(self.directory, exist_ok=True)
            # The handler named up front: a fresh manager otherwise cannot read the item's
            # metadata before its first save or restore.
            self._manager = ocp.CheckpointManager(
                self.directory, item_handlers={_ITEM: ocp.StandardCheckpointHandler()}, options=self._options
            )
        return self._manager

    def save(self, step: int, state: TrainState, *, metadata: dict | None = None, wait: bool = True) -> None:
        """Saves ``state`` (a TrainState, or any pytree of arrays) as checkpoint ``step``
        with the caller's JSON-serialisable ``metadata`` and the digest of each array, then
        deletes the checkpoints beyond ``max_to_keep``.

        Raises ValueError, before writing or deleting anything, if checkpoint ``step``
        exists already (orbax would skip it) or a floating-point entry of ``state`` is not
        finite (a NaN state saved would rotate the good checkpoints away)."""
        manager = self._get(create=True)
        manager.wait_until_finished()  # the previous save is listed before we look
        step = int(step)
        if step in manager.all_steps():
            raise ValueError(f"Checkpointer.save: {self.directory} already has a checkpoint of step {step}.")
        flat, impls = {}, {}
        for names, leaf in zip(_paths(state), jax.tree.leaves(state)):
            if _is_key(leaf):
                impls["/".join(names)] = str(jax.random.key_impl(leaf))
                leaf = jax.random.key_data(leaf)
            flat[names] = leaf
        checks = _checks(flat)
        non_finite = _non_finite(flat, checks)
        if non_finite:
            raise ValueError(
                f"Checkpointer.save: the state of step {step} has non-finite values in "
                f"{_listed(non_finite)}; not saved (the checkpoints in {self.directory!r} are kept)."
            )
        digests = {path: digest for path, (digest, _) in checks.items()}
        # force: orbax's own policy (save_interval_steps, "not after a later step") would
        # silently skip a save; the caller decides when to save.
        saved = manager.save(
            step,
            args=ocp.args.Composite(**{_ITEM: ocp.args.StandardSave(_nest(flat))}),
            force=True,
            custom_metadata={_OURS: {"prng_impls": impls, "digests": digests}, "metadata": metadata},
        )
        if not saved:
            raise RuntimeError(f"Checkpointer.save: orbax did not save step {step} in {self.directory}.")
        if wait:
            manager.wait_until_finished()

    def wait(self) -> None:
        """Blocks until a background save is complete (finalized on disk)."""
        if self._manager is not None:
            self._manager.wait_until_finished()

    def all_steps(self) -> list[int]:
        """The steps of the complete checkpoints, ascending."""
        manager = self._get(create=False)
        return sorted(manager.all_steps()) if manager is not None else []

    def reload(self) -> None:
        """Lists the checkpoints on disk again, after something else moved or deleted one
        (orbax keeps its own list: a step it still lists would not be saved again, and would
        count against ``max_to_keep``)."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.reload()

    def latest_step(self) -> int | None:
        """The step of the latest complete checkpoint, ``None`` if there is none. (A
        checkpoint being written, or a temporary directory a crash left, is not one.)"""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def metadata(self, step: int | None = None) -> dict | None:
        """The ``metadata`` saved with checkpoint ``step`` (default: the latest)."""
        step = self._existing(step, "metadata")[0]
        return self._manager.metadata(step).custom_metadata.get("metadata")

    def _existing(self, step: int | None, what: str) -> list[int]:
        """``[step]``, or every complete step latest first when ``step`` is None; raises
        FileNotFoundError when there is none."""
        self.wait()
        if not os.path.isdir(self.directory):
            raise FileNotFoundError(f"Checkpointer.{what}: no checkpoint directory {self.directory!r}.")
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"Checkpointer.{what}: no complete checkpoint in {self.directory!r}.")
        if step is None:
            return steps[::-1]
        if int(step) not in steps:
            raise FileNotFoundError(
                f"Checkpointer.{what}: no checkpoint of step {step} in {self.directory!r} (complete: {steps})."
            )
        return [int(step)]

    def restore(self, step: int | None = None, *, like: TrainState) -> TrainState:
        """Checkpoint ``step`` (default: the latest readable one) as a state with the
        structure, dtypes and shardings of ``like``, an abstract state (``jax.eval_shape``
        of :func:`~jaxrl_llm.training.init_state`, with ``sharding`` set on the leaves to
        place them; without, they land on the default device) or a real one (or any
        pytree saved, with ``like`` of its structure).

        The restored arrays are verified: their digests must be those saved (checkpoints
        saved without digests skip this) and their floating-point entries finite.
        Without ``step``, a latest checkpoint that cannot be read (a file deleted or
        truncated) or fails verification is skipped with a warning naming it and the
        error (for a digest, the leaves that differ), for the one before; :attr:`skipped`
        lists them.

        Raises:
          FileNotFoundError: no such directory, no complete checkpoint, or no such step.
          ValueError: the checkpoint does not fit ``like`` (the first differing path).
          RuntimeError: checkpoint ``step`` cannot be read or fails verification, or
            without ``step`` none can be used (each one's error in the message).
        """
        steps = self._existing(step, "restore")
        target = _target(like)
        errors, self.skipped = [], {}
        for i, s in enumerate(steps):
            try:
                step_metadata = self._manager.metadata(s)
                saved = step_metadata.item_metadata[_ITEM]
                impls = step_metadata.custom_metadata[_OURS]["prng_impls"]
                digests = step_metadata.custom_metadata[_OURS].get("digests")
                if saved is None:
                    raise ValueError("its array metadata cannot be read")
            except Exception as error:  # noqa: BLE001 (any unreadable checkpoint: try the previous)
                errors.append(self._unreadable(s, error, steps[i + 1 :], step is not None))
                continue
            check_tree(
                f"checkpoint {s}",
                getattr(saved, "tree", saved),
                target,
                "`like`",
                dtypes=True,
                advice=f"Was {self.directory!r} saved by another method, model or TrainConfig?",
            )
            try:
                restored = self._manager.restore(
                    s, args=ocp.args.Composite(**{_ITEM: ocp.args.StandardRestore(target)})
                )[_ITEM]
                _verify({names: _leaf(restored, names) for names in _paths(like)}, digests)
            except Exception as error:  # noqa: BLE001
                restored = None  # its arrays freed before the previous checkpoint is read
                errors.append(self._unreadable(s, error, steps[i + 1 :], step is not None))
                continue
            return self._unflatten(restored, like, impls, s)
        raise RuntimeError(f"Checkpointer.restore: no readable checkpoint in {self.directory!r}: " + "; ".join(errors))

    def _unreadable(self, step: int, error: Exception, rest: list[int], explicit: bool) -> str:
        self.skipped[step] = f"{type(error).__name__}: {str(error)[:500]}"
        message = f"checkpoint {step}: {self.skipped[step]}"
        if explicit:
            raise RuntimeError(f"Checkpointer.restore: {self.directory!r}: {message}") from error
        if rest:
            warnings.warn(f"Checkpointer.restore: {message}; falling back to checkpoint {rest[0]}.", stacklevel=3)
        return message

    @staticmethod
    def _unflatten(restored: dict, like, impls: dict[str, str], step: int) -> TrainState:
        leaves = []
        for names, want in zip(_paths(like), jax.tree.leaves(like)):
            leaf = _leaf(restored, names)
            if _is_key(want):
                impl = impls.get("/".join(names))
                if impl is None:
                    raise ValueError(
                        f"Checkpoint {step}: {'/'.join(names)} is a PRNG key in `like` but was not saved as one."
                    )
                leaf = jax.random.wrap_key_data(leaf, impl=impl)
                if leaf.dtype != want.dtype:
                    raise ValueError(
                        f"Checkpoint {step}: the key {'/'.join(names)} is {leaf.dtype}, but `like` needs {want.dtype}."
                    )
            leaves.append(leaf)
        return jax.tree.unflatten(jax.tree.structure(like), leaves)

    def close(self) -> None:
        """Waits for a background save and releases orbax's resources."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
