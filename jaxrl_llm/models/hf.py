"""Hugging Face checkpoints in both directions, through safetensors.

:func:`from_pretrained` reads ``config.json`` with ``transformers.AutoConfig`` (which also
upgrades transformers-4 files) and the weights tensor by tensor, from one
``*.safetensors`` file or many with an index, straight into a params tree built
abstractly: no random initialisation and no second full copy in host memory.

:func:`save_pretrained` writes a directory that ``transformers.AutoModelForCausalLM``
loads. It writes into a temporary sibling directory and swaps it in at the end, so an
interrupted save never leaves a half-written checkpoint behind.

The layouts differ only by transposes and head reshapes: Hugging Face stores a linear
layer as ``[out, in]``; we store ``[in, out]``, with the head axis split out of q/k/v/o.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl_llm.models.config import ModelConfig, dtype_from_name
from jaxrl_llm.models.functional import Model, Params, abstract

INDEX_FILE = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# Per layout: (our shape -> HF shape, HF array -> ours, ours -> HF array).
Layout = tuple[Callable[[tuple[int, ...]], tuple[int, ...]], Callable[[np.ndarray, tuple[int, ...]], np.ndarray],
               Callable[[np.ndarray], np.ndarray]]
_LAYOUTS: dict[str, Layout] = {
    "same": (lambda s: s, lambda a, s: a, lambda a: a),
    "transpose": (lambda s: s[::-1], lambda a, s: a.T, lambda a: a.T),
    # q/k/v kernels: ours [E, H, D], HF [H * D, E]
    "in_heads": (lambda s: (s[1] * s[2], s[0]), lambda a, s: a.T.reshape(s), lambda a: a.reshape(a.shape[0], -1).T),
    # o kernel: ours [H, D, E], HF [E, H * D]
    "out_heads": (lambda s: (s[2], s[0] * s[1]), lambda a, s: a.T.reshape(s), lambda a: a.reshape(-1, a.shape[-1]).T),
    # q/k/v biases: ours [H, D], HF [H * D]
    "heads_bias": (lambda s: (s[0] * s[1],), lambda a, s: a.reshape(s), lambda a: a.reshape(-1)),
}
_ATTENTION = {"q_proj": ("q_proj.weight", "in_heads"), "k_proj": ("k_proj.weight", "in_heads"),
              "v_proj": ("v_proj.weight", "in_heads"), "o_proj": ("o_proj.weight", "out_heads"),
              "q_bias": ("q_proj.bias", "heads_bias"), "k_bias": ("k_proj.bias", "heads_bias"),
              "v_bias": ("v_proj.bias", "heads_bias"), "o_bias": ("o_proj.bias", "same"),
              "q_norm": ("q_norm.weight", "same"),
              "k_norm": ("k_norm.weight", "same")}


def hf_name(path: tuple[Any, ...]) -> tuple[str, str]:
    """Our parameter path -> (Hugging Face tensor name, layout)."""
    match path:
        case ("embed_tokens",):
            return "model.embed_tokens.weight", "same"
        case ("norm",):
            return "model.norm.weight", "same"
        case ("lm_head",):
            return "lm_head.weight", "transpose"
        case ("layers", layer, "input_layernorm" | "post_attention_layernorm" as norm):
            return f"model.layers.{layer}.{norm}.weight", "same"
        case ("layers", layer, "self_attn", name) if name in _ATTENTION:
            tensor, layout = _ATTENTION[name]
            return f"model.layers.{layer}.self_attn.{tensor}", layout
        case ("layers", layer, "mlp", "gate_proj" | "up_proj" | "down_proj" as proj):
            return f"model.layers.{layer}.mlp.{proj}.weight", "transpose"
    raise KeyError(f"No Hugging Face name for parameter {'/'.join(map(str, path))}.")


def _weight_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """Tensor name -> the safetensors file that holds it."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"No weights in {directory}: expected *.safetensors files (or {INDEX_FILE}).")
    names = {}
    for file in files:
        with safe_open(file, framework="numpy") as f:
            names.update({name: file for name in f.keys()})
    return names


def from_pretrained(
    path: str | os.PathLike,
    dtype: Any = jnp.float32,
    *,
    compute_dtype: Any | None = None,
) -> tuple[Model, Params]:
    """Loads a Hugging Face checkpoint directory (Llama, Mistral, Qwen2, Qwen3).

    Args:
      path: a directory with ``config.json`` and ``*.safetensors`` weights.
      dtype: the parameters' dtype (``jnp.float32``, ``jnp.bfloat16``, or its name).
      compute_dtype: the activations' dtype; defaults to ``dtype``.

    Returns:
      ``(model, params)`` for :func:`jaxrl_llm.models.forward` and friends.

    Raises:
      FileNotFoundError: the directory, its config or its weights are missing.
      ValueError: an unsupported architecture or option, a missing or unexpected
        tensor, or a tensor whose shape does not match the config (names both shapes).
    """
    directory = pathlib.Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"Checkpoint directory {directory} does not exist.")
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"No config.json in {directory}.")
    import transformers

    hf_config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    dtype = dtype_from_name(dtype)
    config = ModelConfig.from_hf(hf_config, param_dtype=dtype, dtype=dtype_from_name(compute_dtype or dtype))
    files = _weight_files(directory)
    model, shapes = abstract(config)

    loaded, used = [], set()
    open_files: dict[pathlib.Path, Any] = {}
    try:
        for path_, variable in nnx.to_flat_state(shapes):
            name, layout = hf_name(path_)
            to_hf_shape, to_ours, _ = _LAYOUTS[layout]
            expected = to_hf_shape(tuple(variable.get_value().shape))
            if name not in files:
                raise ValueError(f"Checkpoint {directory} is missing tensor {name!r} (shape {list(expected)}).")
            file = files[name]
            if file not in open_files:
                open_files[file] = safe_open(file, framework="numpy").__enter__()
            tensor = open_files[file].get_tensor(name)
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"Tensor {name!r} has shape {list(tensor.shape)} in the checkpoint, but the config implies "
                    f"{list(expected)}."
                )
            value = jnp.asarray(to_ours(tensor, tuple(variable.get_value().shape)), dtype=dtype)
            loaded.append((path_, variable.replace(value)))
            used.add(name)
    finally:
        for handle in open_files.values():
            handle.__exit__(None, None, None)

    unexpected = sorted(
        n for n in files if n not in used and not n.endswith(_IGNORED_SUFFIXES)
        and not (config.tie_word_embeddings and n == "lm_head.weight")
    )
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
        raise ValueError(
            f"Checkpoint {directory} has {len(unexpected)} tensor(s) the {config.architecture} config does not "
            f"use: {shown}."
        )
    return model, nnx.from_flat_state(loaded)


def hf_tensors(model: Model, params: Params) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, array)`` pairs in the Hugging Face layout, one parameter at a time."""
    for path_, leaf in nnx.to_flat_state(params):
        name, layout = hf_name(path_)
        # A State entry is a Param, or a bare array where a user assigned one (params["x"] = ...).
        value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        yield name, np.ascontiguousarray(_LAYOUTS[layout][2](np.asarray(jax.device_get(value))))


def save_pretrained(
    path: str | os.PathLike,
    model: Model,
    params: Params,
    *,
    max_shard_bytes: int = 2 * 1024**3,
) -> None:
    """Writes ``config.json`` and safetensors weights that transformers loads.

    Weights beyond ``max_shard_bytes`` are split over several files with an index. The
    directory is written next to ``path`` and swapped in when complete; an existing
    checkpoint at ``path`` is replaced only then, and the other files there (tokenizer,
    generation config, ...) are kept. Token ids (bos, eos, pad) travel in the config.
    """
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.config.to_hf().save_pretrained(staging)
        shards: list[dict[str, np.ndarray]] = [{}]
        sizes = [0]
        for name, array in hf_tensors(model, params):
            if shards[-1] and sizes[-1] + array.nbytes > max_shard_bytes:
                shards.append({})
                sizes.append(0)
            shards[-1][name] = array
            sizes[-1] += array.nbytes
        metadata = {"format": "pt"}  # what transformers expects of a safetensors file
        if len(shards) == 1:
            save_file(shards[0], staging / "model.safetensors", metadata=metadata)
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, staging / file, metadata=metadata)
                weight_map.update({name: file for name in shard})
            index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
            (staging / INDEX_FILE).write_text(json.dumps(index, indent=2))
        _swap_in(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _is_model_file(name: str) -> bool:
    return name == "config.json" or name == INDEX_FILE or name.endswith(".safetensors")


def _swap_in(staging: pathlib.Path, target: pathlib.Path) -> None:
    """Moves the finished ``staging`` directory to ``target``.

    The previous model files at ``target`` (config, weights, index) are replaced as a
    whole; anything else there (a tokenizer, ``generation_config.json``, training state)
    is carried into the new directory first, by hard link where possible.
    """
    if target.exists():
        for entry in target.iterdir():
            if _is_model_file(entry.name) or (staging / entry.name).exists():
                continue
            if entry.is_dir():
                shutil.copytree(entry, staging / entry.name, copy_function=_link_or_copy)
            else:
                _link_or_copy(entry, staging / entry.name)
        retired = target.with_name(f".{target.name}.old")
        shutil.rmtree(retired, ignore_errors=True)
        os.replace(target, retired)
        os.replace(staging, target)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(staging, target)


def _link_or_copy(source: str | os.PathLike, destination: str | os.PathLike) -> None:
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)
