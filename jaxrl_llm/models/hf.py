"""Hugging Face checkpoints in both directions, through safetensors; GGUF files read too.

:func:`from_pretrained` reads ``config.json`` with ``transformers.AutoConfig`` (which also
upgrades transformers-4 files) and the weights tensor by tensor, from ``model.safetensors``
or the shards an index lists, straight into a params tree built abstractly
(:func:`jaxrl_llm.models.layout.read_weights`): no random initialisation and no second full
copy in host memory. Given a GGUF file it reads that instead (:mod:`jaxrl_llm.models.gguf`).
With ``mesh=``, each tensor goes straight into its shards (the sharding rules of
:mod:`jaxrl_llm.sharding`): every device receives only its own slice, read from the file
on its own.

:func:`save_pretrained` writes a directory that ``transformers.AutoModelForCausalLM``
loads: config and weights and, as an export, the tokenizer (with its chat template, loaded
back by ``AutoTokenizer``) and ``generation_config.json`` (the stop ids). It writes through
:func:`jaxrl_llm.models.staging.staged_directory`: into a hidden directory next to the
target, swapped in with two renames when complete, so an interrupted save never leaves a
half-written checkpoint at the path, and the leftovers of a save whose process died are
cleaned up (or the previous checkpoint renamed back) by the next save or load of that path
on the same machine.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import numbers
import os
import pathlib
from collections.abc import Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import transformers
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl_llm import sharding as sharding_lib
from jaxrl_llm.models import gguf, layout, lora, quantize
from jaxrl_llm.models.config import ModelConfig, dtype_from_name
from jaxrl_llm.models.functional import Model, Params
from jaxrl_llm.models.staging import recover, staged_directory

INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)
"""What a Hugging Face tokenizer may save (transformers 4 and 5, fast and slow): the names a
save with a tokenizer replaces, so that no file of the previous tokenizer survives beside it."""


def _weight_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """Tensor name -> the safetensors file that holds it: the index's map, else every tensor of
    ``model.safetensors``, else of every ``*.safetensors`` file."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / WEIGHTS_FILE
    files = [single] if single.is_file() else sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"No weights in {directory}: expected *.safetensors files (or {INDEX_FILE}).")
    names = {}
    for file in files:
        with safe_open(file, framework="numpy") as f:
            names.update({name: file for name in f.keys()})
    return names


class _Safetensors(contextlib.AbstractContextManager):
    """A checkpoint directory's safetensors files as a :class:`~jaxrl_llm.models.layout.TensorSource`,
    each file opened when first read and closed on exit."""

    def __init__(self, directory: pathlib.Path):
        self.description = str(directory)
        self._files = _weight_files(directory)
        self._open: dict[pathlib.Path, Any] = {}

    def _handle(self, name: str):
        file = self._files[name]
        if file not in self._open:
            self._open[file] = safe_open(file, framework="numpy").__enter__()
        return self._open[file]

    def names(self) -> Collection[str]:
        return self._files.keys()

    def get_slice(self, name: str):
        return self._handle(name).get_slice(name)

    def get_tensor(self, name: str) -> np.ndarray:
        return self._handle(name).get_tensor(name)

    def __exit__(self, *exc_info) -> None:
        for handle in self._open.values():
            handle.__exit__(None, None, None)


def read_weights(
    directory: pathlib.Path,
    config: ModelConfig,
    *,
    extra: tuple[str, ...] = (),
    mesh: jax.sharding.Mesh | None = None,
    rules: sharding_lib.Rules | None = None,
) -> tuple[Model, Params, dict[str, np.ndarray]]:
    """The decoder of ``config`` read from the safetensors files in ``directory``
    (:func:`jaxrl_llm.models.layout.read_weights`: ``extra`` tensors returned as stored).

    Raises:
      FileNotFoundError: no weights in ``directory``.
      ValueError: a missing, unexpected or misshapen tensor.
    """
    with _Safetensors(directory) as source:
        return layout.read_weights(source, config, extra=extra, mesh=mesh, rules=rules)


def read_config(path: str | os.PathLike, *, dtype: Any = jnp.float32, compute_dtype: Any | None = None) -> ModelConfig:
    """The :class:`~jaxrl_llm.models.ModelConfig` of a checkpoint: a Hugging Face directory's
    ``config.json`` or a GGUF file's metadata (:func:`jaxrl_llm.models.gguf.read_config`),
    with ``dtype`` parameters and ``compute_dtype`` activations (default: ``dtype``).

    Raises:
      FileNotFoundError: neither a GGUF file nor a directory with ``config.json``.
      ValueError: an unsupported architecture or option.
    """
    dtype = dtype_from_name(dtype)
    compute_dtype = dtype_from_name(compute_dtype or dtype)
    if (file := gguf.find_file(path)) is not None:
        return gguf.read_config(file, param_dtype=dtype, dtype=compute_dtype)
    hf_config = transformers.AutoConfig.from_pretrained(checkpoint_directory(path), local_files_only=True)
    return ModelConfig.from_hf(hf_config, param_dtype=dtype, dtype=compute_dtype)


def from_pretrained(
    path: str | os.PathLike,
    dtype: Any = jnp.float32,
    *,
    compute_dtype: Any | None = None,
    mesh: jax.sharding.Mesh | None = None,
    rules: sharding_lib.Rules | None = None,
    quantization: str | None = None,
    scan_layers: bool = False,
) -> tuple[Model, Params]:
    """Loads a Hugging Face checkpoint directory or a GGUF file (Llama, Mistral, Qwen2, Qwen3).

    A Hugging Face directory: leftovers of a save to ``path`` that died on this machine are
    cleaned up first, as :func:`save_pretrained` describes; a checkpoint moved aside by a
    save that died mid-swap is renamed back to ``path``.

    A GGUF file (llama.cpp's format; :mod:`jaxrl_llm.models.gguf`), or a directory holding
    one and no ``config.json``: the config comes from its metadata and each tensor is
    dequantized to float32 (any GGML type, Q4_1 to K- and I-quants) before it is cast to
    ``dtype``; the tokenizer is :func:`jaxrl_llm.models.load_tokenizer` of the same path.

    With ``mesh``, every parameter is created already sharded, with
    ``sharding.param_shardings(params, mesh, rules)``: each device's shard is read from
    the file on its own (``jax.make_array_from_callback``), so no device ever holds a whole
    tensor that the rules split, and the host holds at most one tensor's shards at a time.
    The values equal those of the load without a mesh, bit for bit.

    .. code-block:: python

        mesh = sharding.make_mesh(fsdp=4, tensor=2)
        model, params = models.from_pretrained(path, jnp.bfloat16, mesh=mesh)  # FSDP + tensor
        model, params = models.from_pretrained("SmolLM2-135M-Instruct.Q4_1.gguf")  # dequantized

    Args:
      path: a directory with ``config.json`` and the weights: ``model.safetensors``, or
        ``model.safetensors.index.json`` and the files it lists, else every ``*.safetensors``
        file there; or a ``.gguf`` file, or a directory holding one ``.gguf`` file and no
        ``config.json``. Symlinks are resolved.
      dtype: the parameters' dtype (``jnp.float32``, ``jnp.bfloat16``, or its name).
      compute_dtype: the activations' dtype; defaults to ``dtype``.
      mesh: place the parameters on this mesh (:func:`jaxrl_llm.sharding.make_mesh`);
        ``None``: whole, on the default device.
      rules: the logical-axis rules that place them (default
        ``sharding.RULES["fsdp_tensor"]``, as :func:`jaxrl_llm.training.train` uses);
        only with ``mesh``.
      quantization: ``"int8"``: each projection quantized as it is read, from its values
        in ``dtype`` (:mod:`jaxrl_llm.models.quantize`; equal to ``quantize.quantize`` of the
        load without it, bit for bit), so no device holds more than one unquantized
        projection at a time: a frozen base for LoRA at a byte per projection weight (from a
        GGUF file: its dequantized values, requantized with a scale per output channel).
      scan_layers: read the layers into the stacked layout (``ModelConfig.scan_layers``),
        each ``[L, ...]`` leaf from its ``L`` per-layer tensors; else one subtree per layer.

    Returns:
      ``(model, params)`` for :func:`jaxrl_llm.models.forward` and friends.

    Raises:
      FileNotFoundError: the directory, its config or its weights are missing.
      ValueError: an unsupported architecture or option, a missing or unexpected
        tensor, or a tensor whose shape does not match the config (names both shapes);
        ``rules`` without ``mesh``, or rules naming an unknown mesh axis.
    """
    if rules is not None and mesh is None:
        raise ValueError(
            "from_pretrained: `rules` place the parameters on a mesh; pass `mesh=` too (sharding.make_mesh(...))."
        )
    options = dict(quantization=quantization, scan_layers=scan_layers)
    if (file := gguf.find_file(path)) is not None:
        config, tensors = gguf.read_checkpoint(file, param_dtype=dtype, dtype=compute_dtype or dtype)
        model, params, _ = layout.read_weights(tensors, dataclasses.replace(config, **options), mesh=mesh, rules=rules)
    else:
        config = dataclasses.replace(read_config(path, dtype=dtype, compute_dtype=compute_dtype), **options)
        model, params, _ = read_weights(checkpoint_directory(path), config, mesh=mesh, rules=rules)
    return model, params


def checkpoint_directory(path: str | os.PathLike) -> pathlib.Path:
    """``path`` resolved, after the recovery :func:`from_pretrained` describes.

    Raises:
      FileNotFoundError: the directory or its ``config.json`` is missing.
    """
    directory = pathlib.Path(path).resolve()
    recover(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"Checkpoint directory {directory} does not exist.")
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"No config.json in {directory}.")
    return directory


def save_pretrained(
    path: str | os.PathLike,
    model: Model,
    params: Params,
    *,
    tokenizer: transformers.PreTrainedTokenizerBase | None = None,
    generation_config: transformers.GenerationConfig | Mapping[str, Any] | None = None,
    max_shard_bytes: int = 2 * 1024**3,
) -> None:
    """Writes a checkpoint that transformers loads and generates with.

    ``path`` is resolved first: ``"."`` and ``".."`` work, and for a symlink the directory it
    points to is written (the link stays). The directory gets:

    * ``config.json``, with the model's token ids (bos, eos, pad);
    * the weights, in ``model.safetensors`` or, beyond ``max_shard_bytes``, in
      ``model-XXXXX-of-YYYYY.safetensors`` shards listed in ``model.safetensors.index.json``;
    * with ``tokenizer``, its files as ``tokenizer.save_pretrained`` writes them
      (``tokenizer.json``, ``tokenizer_config.json`` with the special tokens,
      ``chat_template.jinja``), so ``AutoTokenizer.from_pretrained(path)`` loads it;
    * with ``tokenizer`` or ``generation_config`` (an export rather than a save of new
      weights), ``generation_config.json``: ``generation_config`` with the token ids it
      leaves ``None`` filled in, each from the model config, else from ``tokenizer``:
      ``bos_token_id``, ``eos_token_id`` (the config's ``eos_token_ids``, an int for one id,
      a list for several) and ``pad_token_id``. So ``generate`` stops at the model's EOS
      ids unasked. ``generation_config={}`` writes the ids alone.

    The arguments are checked before anything is written: a tokenizer with an id beyond the
    model's ``vocab_size``, a generation config that transformers would refuse to save, or a
    token id outside ``[0, vocab_size)`` raise without touching the file system. The tokenizer
    is then loaded back from the staging directory with ``AutoTokenizer`` and compared with
    the one given (vocabulary, special ids, padding side, chat template, the ids of probe
    texts); a difference raises before the swap, leaving ``path`` as it was.

    The checkpoint is written into a hidden staging directory next to ``path``
    (``.{name}.saving.*``) and swapped in when complete: the existing directory is renamed
    aside (``.{name}.old.*``), the staging directory renamed to ``path``, the old one removed.
    An interrupted save therefore never leaves a half-written checkpoint at ``path``, nor
    weights beside another save's tokenizer.

    What an existing directory at ``path`` keeps: everything except the previous
    checkpoint's ``config.json``, ``model.safetensors``, index and the shards that index
    lists, and the files this save writes; with ``tokenizer``, every previous tokenizer file
    (:data:`TOKENIZER_FILES`) goes too, even one the new tokenizer does not write. So a save
    of weights alone keeps the tokenizer files and ``generation_config.json``; an export
    replaces ``generation_config.json`` (to keep its sampling defaults, pass them back:
    ``generation_config=transformers.GenerationConfig.from_pretrained(path)``). Other
    ``*.safetensors`` files (a critic, an optimizer state), subdirectories and symlinks (as
    symlinks) are kept, carried into the new directory by hard link, or copied across file
    systems. A process whose working directory was ``path`` or inside it is moved into the
    new directory.

    Recovery: every save and :func:`from_pretrained` of ``path`` first cleans up after saves
    to it whose process died on this machine (same host name and pid namespace; a pid reused
    by a later process counts as dead). Their staging directories are removed; a previous
    checkpoint they renamed aside goes back to ``path`` if ``path`` is missing (a death
    between the two renames), else is removed. Leftovers of running processes and of other
    machines are never touched.

    Permissions: new files get ``0o666 & ~umask`` and the directory ``0o777 & ~umask``, as
    with transformers; carried-over files keep theirs.

    Args:
      path: the checkpoint directory; created if missing.
      model, params: from :func:`from_pretrained` or :func:`jaxrl_llm.models.init`. A model
        with LoRA adapters is saved merged (:func:`jaxrl_llm.models.lora.merge`, in the
        base's dtype): a checkpoint of full weights that needs no ``peft`` to load. For the
        adapters alone, :func:`jaxrl_llm.models.lora.save_adapter`. An int8 model is saved
        dequantized (:func:`jaxrl_llm.models.quantize.dequantize`, in ``param_dtype``).
      tokenizer: a ``transformers`` tokenizer whose ids lie in ``[0, vocab_size)`` (one from
        ``AutoTokenizer`` or :func:`jaxrl_llm.tasks.build_char_tokenizer`, with its
        ``chat_template`` if set); ``None`` writes none and keeps the directory's.
      generation_config: a ``transformers.GenerationConfig`` (copied, not modified) or a dict
        of its fields, e.g. ``{"do_sample": True, "temperature": 0.7, "top_p": 0.95,
        "top_k": 20}``; ``None``: the token ids alone (greedy decoding) when ``tokenizer`` is
        given, else no ``generation_config.json`` is written.
      max_shard_bytes: the largest weights file; more weights go to several shards.

    Raises:
      ValueError: ``path`` resolves to the file system root; the tokenizer holds ids the
        model cannot embed, or transformers would load it back as a different tokenizer
        (transformers 5 rebuilds every ``qwen2`` checkpoint's tokenizer as ``Qwen2Tokenizer``);
        the generation config is invalid (transformers' message) or names a token id outside
        ``[0, vocab_size)``.
      TypeError: ``generation_config`` is neither a ``GenerationConfig`` nor a dict, or
        ``tokenizer`` is not a transformers tokenizer.
      NotADirectoryError: ``path`` exists and is not a directory.
    """
    if model.config.lora is not None:
        model, params = lora.merge(model, params)
    model, params = quantize.dequantize(model, params)
    target = pathlib.Path(path).resolve()
    if not target.name:
        raise ValueError(f"Cannot save a checkpoint as the file system root {target}; pass a directory below it.")
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"Cannot save a checkpoint to {target}: it is a file, not a directory.")
    if tokenizer is not None:
        _check_tokenizer(tokenizer, model.config.vocab_size)
    generation = (
        None
        if tokenizer is None and generation_config is None
        else _generation_config(model.config, generation_config=generation_config, tokenizer=tokenizer)
    )

    def replaced() -> set[str]:  # the previous checkpoint's files, read once the staging directory is written
        return _replaced_names(target) | ({*TOKENIZER_FILES} if tokenizer is not None else set())

    with staged_directory(target, replaced=replaced) as staging:
        model.config.to_hf().save_pretrained(staging)
        if generation is not None:
            generation.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
            _check_tokenizer_reloads(tokenizer, staging, model_type=model.config.architecture)
        shards: list[dict[str, np.ndarray]] = [{}]
        sizes = [0]
        for name, array in layout.hf_tensors(model, params):
            if shards[-1] and sizes[-1] + array.nbytes > max_shard_bytes:
                shards.append({})
                sizes.append(0)
            shards[-1][name] = array
            sizes[-1] += array.nbytes
        metadata = {"format": "pt"}  # what transformers expects of a safetensors file
        if len(shards) == 1:
            save_file(shards[0], staging / WEIGHTS_FILE, metadata=metadata)
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, staging / file, metadata=metadata)
                weight_map.update({name: file for name in shard})
            index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
            (staging / INDEX_FILE).write_text(json.dumps(index, indent=2))


def _generation_config(
    config: ModelConfig,
    *,
    generation_config: transformers.GenerationConfig | Mapping[str, Any] | None = None,
    tokenizer: transformers.PreTrainedTokenizerBase | None = None,
) -> transformers.GenerationConfig:
    """The ``generation_config.json`` that :func:`save_pretrained` writes for ``config``.

    ``generation_config`` (a copy) with its ``None`` token ids filled in: ``bos_token_id``,
    ``eos_token_id`` (``config.eos_token_ids``: an int for one, a list for several) and
    ``pad_token_id`` from ``config``, or from ``tokenizer`` where ``config`` has none.

    Raises:
      TypeError: ``generation_config`` is neither a ``GenerationConfig`` nor a dict.
      ValueError: transformers' strict validation fails (e.g. ``temperature`` without
        ``do_sample=True``), or a token id lies outside ``[0, config.vocab_size)``.
    """
    if generation_config is None:
        generation = transformers.GenerationConfig()
    elif isinstance(generation_config, transformers.GenerationConfig):
        generation = copy.deepcopy(generation_config)
    elif isinstance(generation_config, Mapping):
        generation = transformers.GenerationConfig(**generation_config)
    else:
        raise TypeError(
            f"`generation_config` must be a transformers.GenerationConfig, a dict of its fields or None; "
            f"got {type(generation_config).__name__}."
        )

    def from_tokenizer(name: str) -> int | None:
        return None if tokenizer is None else getattr(tokenizer, name, None)

    eos = list(config.eos_token_ids) or [i for i in [from_tokenizer("eos_token_id")] if i is not None]
    ids = {
        "bos_token_id": config.bos_token_id if config.bos_token_id is not None else from_tokenizer("bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
        "pad_token_id": config.pad_token_id if config.pad_token_id is not None else from_tokenizer("pad_token_id"),
    }
    for name, value in ids.items():
        if getattr(generation, name, None) is None:
            setattr(generation, name, value)
    generation.validate(strict=True)
    for name in ids:
        value = getattr(generation, name)
        for token in [] if value is None else value if isinstance(value, (list, tuple)) else [value]:
            if not (
                isinstance(token, numbers.Integral) and not isinstance(token, bool) and 0 <= token < config.vocab_size
            ):
                raise ValueError(
                    f"The generation config's {name} {value!r} must be token ids in "
                    f"[0, {config.vocab_size}) (the model's vocab_size)."
                )
    return generation


def _check_tokenizer(tokenizer: transformers.PreTrainedTokenizerBase, vocab_size: int) -> None:
    """Raises ``ValueError`` if ``tokenizer`` has ids that a model of ``vocab_size`` cannot embed,
    ``TypeError`` if it is no tokenizer."""
    if not callable(getattr(tokenizer, "save_pretrained", None)) or not callable(getattr(tokenizer, "get_vocab", None)):
        raise TypeError(f"`tokenizer` must be a transformers tokenizer; got {type(tokenizer).__name__}.")
    vocab = tokenizer.get_vocab()  # added and special tokens included
    size = max(vocab.values(), default=-1) + 1
    if size > vocab_size:
        largest = max(vocab, key=vocab.get)
        raise ValueError(
            f"The tokenizer has ids up to {size - 1} ({largest!r}), but the model's vocab_size is {vocab_size}: its "
            f"embedding has no row for them. Pass the model's own tokenizer, or one with at most {vocab_size} tokens."
        )


_PROBE = 'Hello, World! 12 + 345 = 357.\n\n\tÜber café  日本語 x_y-z {"a": [1, 2]}  '


def _check_tokenizer_reloads(
    tokenizer: transformers.PreTrainedTokenizerBase, directory: pathlib.Path, *, model_type: str
) -> None:
    """Raises ``ValueError`` unless ``AutoTokenizer.from_pretrained(directory)`` gives back
    ``tokenizer``: the same vocabulary, special ids, padding side and chat template, and the
    same ids for probe texts (mixed text, the special tokens, a sample of the vocabulary).

    transformers picks the tokenizer class from the checkpoint's model type too, and some
    classes rebuild the pipeline instead of reading ``tokenizer.json`` (transformers 5 loads
    every ``qwen2`` checkpoint's tokenizer as ``Qwen2Tokenizer``, with Qwen's pre-tokenizer).
    """
    reloaded = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    ids = sorted(tokenizer.get_vocab().values())
    vocabulary = tokenizer.decode(ids[:: max(1, len(ids) // 256)], skip_special_tokens=True)
    differences = [
        name
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "padding_side", "chat_template")
        if getattr(reloaded, name, None) != getattr(tokenizer, name, None)
    ]
    if reloaded.get_vocab() != tokenizer.get_vocab():
        differences.append("vocabulary")
    for text in (_PROBE, "".join(tokenizer.all_special_tokens), vocabulary):
        if reloaded(text)["input_ids"] != tokenizer(text)["input_ids"]:
            differences.append(f"the ids of {text[:40]!r}")
    if differences:
        raise ValueError(
            f"transformers would not load this tokenizer back from the checkpoint: for a {model_type!r} model, "
            f"AutoTokenizer builds a {type(reloaded).__name__} (it picks the class from the model type as well as "
            f"tokenizer_config.json), which differs from the {type(tokenizer).__name__} given in "
            f"{', '.join(differences)}. Save without `tokenizer=` and ship the tokenizer on its own, or export a "
            f"tokenizer of that class."
        )


def _replaced_names(target: pathlib.Path) -> set[str]:
    """The previous checkpoint's model files in ``target``, which a save drops: ``config.json``,
    ``model.safetensors``, the index and the shards the index lists."""
    names = {"config.json", WEIGHTS_FILE, INDEX_FILE}
    # No index, or an unreadable one: it lists nothing.
    with contextlib.suppress(OSError, ValueError, LookupError, TypeError, AttributeError):
        names.update(json.loads((target / INDEX_FILE).read_text())["weight_map"].values())
    return names
