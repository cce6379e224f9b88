"""A run's policy: what its checkpoints hold (:func:`checkpointed`), the LoRA base kept
beside them (``base.json``, ``base/``), and the policy a checkpoint holds (:func:`restore_policy`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
from typing import Any

import jax

from jaxrl_llm import algorithms, distributed, models, sharding, training
from jaxrl_llm.runs import build
from jaxrl_llm.runs.config import RunConfig
from jaxrl_llm.runs.directory import (
    BASE_CHECKPOINT,
    BASE_FILE,
    CHECKPOINTS,
    RunDirectoryError,
    stored_config,
    write_json,
)


def policy_of(
    config: RunConfig, model: models.Model, params: models.Params, state: training.TrainState | None
) -> tuple[models.Model, models.Params]:
    """The policy of a run at ``state`` (``None``: before its first step, ``params`` itself):
    ``model`` over ``state.params``, or for a LoRA run the LoRA model over the base ``params``
    and the state's adapters."""
    lora = config.lora.build()
    if state is None:
        return model, params
    if lora is None:
        return model, state.params
    return models.lora.adapted(model, lora), training.policy_params(state, base=params)


REFERENCE = "ref_params"
"""A run's checkpoint entry for its reference, beside the state's fields (where the reference
was when the state held it, so the checkpoints of older runs keep their layout)."""


def checkpointed(state: training.TrainState, reference: models.Params | None) -> dict[str, Any]:
    """What a run's checkpoint holds: the state's fields and, under :data:`REFERENCE`, the
    reference of a run that keeps one (not LoRA's, adapters of zeros: :func:`training.fixed_params`)."""
    return {**state._asdict(), REFERENCE: reference}


def state_and_reference(stored: dict[str, Any]) -> tuple[training.TrainState, models.Params | None]:
    """The state and the reference of a run's checkpoint tree: :func:`checkpointed` undone."""
    return training.TrainState(**{name: stored[name] for name in training.TrainState._fields}), stored[REFERENCE]


def abstract_checkpoint(config: RunConfig, model: models.Model, params: models.Params) -> dict[str, Any]:
    """The run's checkpoint (:func:`checkpointed`) as shapes and dtypes, from its model's
    abstract ``params``: what a checkpoint restores into. A LoRA run's state has the
    adapters as its params."""
    algorithm, train = config.algorithm, config.train
    lora = config.lora.build()
    if lora is not None:
        lora_model = models.lora.adapted(model, lora)
        adapters = models.lora.abstract_adapters(lora_model)
        return checkpointed(
            jax.eval_shape(lambda a: training.init_state(lora_model, a, algorithm, train), adapters), None
        )
    state = jax.eval_shape(lambda p: training.init_state(model, p, algorithm, train), params)
    return checkpointed(state, jax.eval_shape(lambda p: training.fixed_params(p, algorithm, train), params).reference)


def checkpoint_shardings(
    like: dict[str, Any],
    algorithm: algorithms.Algorithm,
    config: training.TrainConfig,
    mesh: jax.sharding.Mesh,
    rules: sharding.Rules,
) -> dict[str, Any]:
    """The ``NamedSharding`` of every leaf of a run's checkpoint (:func:`checkpointed`) on
    ``mesh``: the state's (:func:`training.state_shardings`), and the reference's as the policy's."""
    state, reference = state_and_reference(like)
    reference = training.fixed_shardings(training.FixedParams(reference), mesh, rules).reference
    return checkpointed(training.state_shardings(state, algorithm, config, mesh, rules), reference)


def restore_checkpoint(
    checkpointer: training.Checkpointer, like: dict[str, Any], step: int | None = None
) -> tuple[training.TrainState, models.Params | None]:
    """The state and reference of checkpoint ``step`` (default: the latest readable one),
    restored into ``like`` (:func:`abstract_checkpoint`). A checkpoint saved with a reference
    the run does not keep (a method without a KL term, saved before it dropped it; a LoRA
    run's adapters of zeros, saved while its state held them) is read with it, and the
    reference dropped."""
    try:
        stored = checkpointer.restore(step, like=like)
    except ValueError as error:
        if like[REFERENCE] is not None or REFERENCE not in str(error):
            raise
        stored = checkpointer.restore(step, like={**like, REFERENCE: like["params"]}) | {REFERENCE: None}
    return state_and_reference(stored)


def placed(like, shardings):
    """Abstract leaves ``like`` with ``shardings`` set: what a checkpoint restores straight into its shards."""
    return jax.tree.map(
        lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where), like, shardings
    )


def save_base(
    run_dir: pathlib.Path, config: RunConfig, params: models.Params, tokenizer, *, stored: bool, main: bool
) -> None:
    """Records a LoRA run's base before its first step: ``base.json`` (``model.path``, or
    ``None`` when the base is ``stored`` in ``base/``, and the digest of every array) and,
    when ``stored``, the base itself (the built-in model, or weights a warm start changed)."""
    if stored:
        if main and (run_dir / BASE_CHECKPOINT).exists():  # a start that died before its first checkpoint
            shutil.rmtree(run_dir / BASE_CHECKPOINT)
        distributed.barrier("run's base cleared")
        with training.Checkpointer(run_dir / BASE_CHECKPOINT, max_to_keep=None) as checkpointer:
            checkpointer.save(0, params)
    digests = training.checkpoint.digests(params)
    record = {"path": None if stored else config.model.path, "digests": digests}
    if not stored:  # a model directory or GGUF file: its config and tokenizer must stay too
        record.update(_model_file_digests(config.model.path, tokenizer))
    if main:
        write_json(run_dir / BASE_FILE, record)


def _model_file_digests(path: str, tokenizer) -> dict[str, str]:
    """SHA-256 digests of a model directory's or GGUF file's config (as :func:`models.read_config`
    reads it) and of ``tokenizer``, the run's, read from it (its vocabulary, added tokens and
    chat template): what a LoRA run's base is besides its arrays."""
    config = dataclasses.asdict(models.read_config(path))
    vocabulary = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "added": sorted((t.content, i) for i, t in tokenizer.added_tokens_decoder.items()),
        "chat_template": tokenizer.chat_template,
    }
    return {
        f"{name}_digest": hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
        for name, value in (("config", config), ("tokenizer", vocabulary))
    }


def load_base(
    run_dir: str | os.PathLike, config: RunConfig, task, *, mesh: jax.sharding.Mesh | None = None
) -> models.Params:
    """A LoRA run's base, as its first step had it: ``model.path``'s weights, or those
    stored in ``base/``; read straight into their shards on ``mesh``.

    Raises RunDirectoryError: no readable ``base.json`` or ``base/``, or an array whose
    digest differs from the one recorded (the model directory's weights changed since the
    run started)."""
    run_dir = pathlib.Path(run_dir)
    record = base_record(run_dir)
    if record["path"] is None:
        _, like = build.model(config, task, abstract=True)
        if mesh is not None:
            like = placed(like, sharding.param_shardings(like, mesh, sharding.RULES[config.mesh.rules]))
        try:
            with training.Checkpointer(run_dir / BASE_CHECKPOINT) as checkpointer:
                params = checkpointer.restore(0, like=like)
        except (FileNotFoundError, RuntimeError) as error:
            raise RunDirectoryError(f"the base of the LoRA run in {str(run_dir)!r} cannot be read: {error}") from None
        where = f"{run_dir / BASE_CHECKPOINT}"
    else:
        _, params = build.model(config, task, mesh=mesh)
        where = f"model.path {record['path']!r}"
        now = _model_file_digests(record["path"], task.tokenizer)
        if changed := [name.removesuffix("_digest") for name in now if name in record and record[name] != now[name]]:
            raise RunDirectoryError(
                f"the base of the LoRA run in {str(run_dir)!r} ({where}) is not the one it started from: its "
                f"{' and its '.join(changed)} changed since (a setting such as rms_norm_eps, or token ids). Put "
                "back the model it trained over, or start a new run."
            )
    digests, expected = training.checkpoint.digests(params), record["digests"]
    changed = sorted(name for name in digests.keys() | expected.keys() if digests.get(name) != expected.get(name))
    if changed:
        listed = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        raise RunDirectoryError(
            f"the base of the LoRA run in {str(run_dir)!r} ({where}) is not the one it started from: "
            f"{len(changed)} of its arrays differ from the digests in {BASE_FILE} ({listed}). Put back "
            "the weights it trained over, or start a new run."
        )
    return params


def base_record(run_dir: str | os.PathLike) -> dict[str, Any]:
    """A LoRA run's ``base.json``: ``{"path": model.path or None, "digests": {path: digest}}``.

    Raises RunDirectoryError: it is missing, not JSON, or lacks either key."""
    path = pathlib.Path(run_dir) / BASE_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(record, dict) or not {"path", "digests"} <= record.keys():
            raise ValueError(f"it must hold `path` and `digests`; got {record!r:.200}")
    except (OSError, ValueError) as error:
        raise RunDirectoryError(
            f"{str(path)!r}, the LoRA run's record of its base (where it is, its arrays' digests), cannot be "
            f"used: {error}."
        ) from None
    return record


def restore_policy(run_dir: str | os.PathLike, step: int | None = None):
    """``(config, task, model, params, step)`` of checkpoint ``step`` of a run (default: the
    latest readable one); of a LoRA run, the LoRA model and its base and adapters together
    (``models.lora.split`` takes them apart, ``models.lora.merge`` makes a plain model)."""
    run_dir = pathlib.Path(run_dir)
    config = stored_config(run_dir)
    if config is None:
        raise RunDirectoryError(f"{str(run_dir)!r} holds no run.")
    build.check_model_path(config.model)
    task = build.run_task(config)
    model, abstract_params = build.model(config, task, abstract=True)
    with training.Checkpointer(run_dir / CHECKPOINTS) as checkpointer:
        if not checkpointer.all_steps():
            raise RunDirectoryError(f"{str(run_dir)!r} has no complete checkpoint yet.")
        state, _ = restore_checkpoint(checkpointer, abstract_checkpoint(config, model, abstract_params), step)
    base = None if config.lora.build() is None else load_base(run_dir, config, task)
    return config, task, *policy_of(config, model, base, state), int(state.step)
