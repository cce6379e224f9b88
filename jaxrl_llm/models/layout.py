"""Our parameters in the Hugging Face tensor layout, for every checkpoint format.

The layouts differ only by transposes and head reshapes: Hugging Face stores a linear
layer as ``[out, in]``; we store ``[in, out]``, with the head axis split out of q/k/v/o.
:func:`hf_name` names each parameter by its Hugging Face tensor; :func:`read_weights` reads
a checkpoint's tensors, in that naming and layout, from a :class:`TensorSource` (the
safetensors files of :mod:`~jaxrl_llm.models.hf`, the GGUF file of
:mod:`~jaxrl_llm.models.gguf`) into a params tree; :func:`hf_tensors` gives them back.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_llm import sharding as sharding_lib
from jaxrl_llm.models import quantize
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import input_axes, is_stacked, quantize_kernel, scale_name
from jaxrl_llm.models.functional import Model, Params, abstract

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# Per layout: (our shape -> HF shape, HF array -> ours, ours -> HF array).
Layout = tuple[
    Callable[[tuple[int, ...]], tuple[int, ...]],
    Callable[[np.ndarray, tuple[int, ...]], np.ndarray],
    Callable[[np.ndarray], np.ndarray],
]
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
_ATTENTION = {
    "q_proj": ("q_proj.weight", "in_heads"),
    "k_proj": ("k_proj.weight", "in_heads"),
    "v_proj": ("v_proj.weight", "in_heads"),
    "o_proj": ("o_proj.weight", "out_heads"),
    "q_bias": ("q_proj.bias", "heads_bias"),
    "k_bias": ("k_proj.bias", "heads_bias"),
    "v_bias": ("v_proj.bias", "heads_bias"),
    "o_bias": ("o_proj.bias", "same"),
    "q_norm": ("q_norm.weight", "same"),
    "k_norm": ("k_norm.weight", "same"),
}

_Box = tuple[slice, ...]
"""One shard's index into our layout: a ``slice(start, stop)`` per dimension."""


def _read_box(tensor, layout: str, shape: tuple[int, ...], box: _Box) -> np.ndarray:
    """``to_ours(tensor)[box]`` reading only the Hugging Face rows/columns the box covers.

    ``tensor`` is a lazy safetensors slice (``safe_open(...).get_slice(name)``) in the HF
    layout; ``shape`` is our full shape. Heads are contiguous runs of ``D`` rows (or
    columns) of the fused ``H * D`` axis, so a box over heads reads those runs, and a box
    over ``head_dim`` slices after the reshape.
    """
    sizes = [b.stop - b.start for b in box]
    match layout:
        case "same":
            return tensor[box]
        case "transpose":  # ours [A, B] <- HF [B, A]
            return tensor[box[::-1]].T
        case "in_heads":  # ours [E, H, D] <- HF [H * D, E]
            e, h, d = box
            rows = tensor[h.start * shape[2] : h.stop * shape[2], e]  # [h * D, e]
            return rows.T.reshape(sizes[0], sizes[1], shape[2])[:, :, d]  # [e, h, d]
        case "out_heads":  # ours [H, D, E] <- HF [E, H * D]
            h, d, e = box
            columns = tensor[e, h.start * shape[1] : h.stop * shape[1]]  # [e, h * D]
            return columns.T.reshape(sizes[0], shape[1], sizes[2])[:, d, :]  # [h, d, e]
        case "heads_bias":  # ours [H, D] <- HF [H * D]
            h, d = box
            return tensor[h.start * shape[1] : h.stop * shape[1]].reshape(sizes[0], shape[1])[:, d]  # [h, d]
    raise KeyError(f"Unknown layout {layout!r}.")


def _sharded(
    tensors: list, layout: str, shape: tuple[int, ...], dtype, placement: jax.sharding.Sharding, *, stacked: bool
) -> jax.Array:
    """The parameter of our ``shape`` placed by ``placement``, each device's shard read from
    the file on its own (a box several devices share is read once). ``tensors``: the one
    lazy tensor, or with ``stacked`` the ``L`` per-layer ones of an ``[L, ...]`` leaf."""
    boxes: dict[tuple[tuple[int, int], ...], np.ndarray] = {}

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        box = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))
        key = tuple((b.start, b.stop) for b in box)
        if key not in boxes:
            if stacked:
                layers = range(box[0].start, box[0].stop)
                read = np.stack([_read_box(tensors[layer], layout, shape[1:], box[1:]) for layer in layers])
            else:
                read = _read_box(tensors[0], layout, shape, box)
            boxes[key] = np.ascontiguousarray(read, dtype=dtype)
        return boxes[key]

    return jax.make_array_from_callback(shape, placement, shard, dtype=dtype)


def per_layer_paths(path: tuple, num_layers: int) -> list[tuple]:
    """A stacked leaf's path -> its layers' paths (``("layers", "mlp", "up_proj")`` ->
    ``[("layers", 0, "mlp", "up_proj"), ...]``)."""
    return [(path[0], layer, *path[1:]) for layer in range(num_layers)]


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


class LazyTensor(Protocol):
    """One stored tensor, read only where indexed (``safe_open(...).get_slice(name)``)."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, box: tuple[slice, ...]) -> np.ndarray: ...


class TensorSource(Protocol):
    """A checkpoint's tensors by Hugging Face name, in the Hugging Face layout."""

    description: str
    """What to call the checkpoint in messages (its path)."""

    def names(self) -> Collection[str]:
        """Every tensor the checkpoint holds."""
        ...

    def get_slice(self, name: str) -> LazyTensor:
        """The tensor ``name``, read lazily."""
        ...

    def get_tensor(self, name: str) -> np.ndarray:
        """The tensor ``name``, read whole."""
        ...


def read_weights(
    source: TensorSource,
    config: ModelConfig,
    *,
    extra: tuple[str, ...] = (),
    mesh: jax.sharding.Mesh | None = None,
    rules: sharding_lib.Rules | None = None,
) -> tuple[Model, Params, dict[str, np.ndarray]]:
    """The decoder of ``config`` read from ``source``'s tensors.

    Tensors are read one at a time into an abstract params tree (no random init). The
    ``extra`` tensors (e.g. a sequence-classification head, ``score.weight``) are returned
    as stored, in the Hugging Face layout, instead of counting as unexpected. With
    ``mesh``, each parameter is built shard by shard on it, placed by ``rules`` (default
    ``sharding.RULES["fsdp_tensor"]``; see :func:`jaxrl_llm.models.from_pretrained`). With
    ``config.quantization``, each projection is quantized as it is read.

    Returns:
      ``(model, params, {name: array})`` for the ``extra`` names.

    Raises:
      ValueError: a missing tensor (``extra`` included), a tensor the config does not use,
        or a tensor whose shape does not match the config (names both shapes).
    """
    dtype = config.param_dtype
    available = set(source.names())
    model, shapes = abstract(config)
    if missing := [name for name in extra if name not in available]:
        raise ValueError(f"Checkpoint {source.description} is missing tensor(s) {', '.join(map(repr, missing))}.")

    placements = {}  # parameter path -> its NamedSharding on the mesh
    if mesh is not None:
        rules = sharding_lib.RULES["fsdp_tensor"] if rules is None else rules
        placements = {
            path: where.get_value() if isinstance(where, nnx.Variable) else where
            for path, where in nnx.to_flat_state(sharding_lib.param_shardings(shapes, mesh, rules))
        }

    scales = {}  # int8 kernels' paths -> their scale's abstract leaf, filled with the kernel
    if config.quantization is not None:
        flat_shapes = dict(nnx.to_flat_state(shapes))
        scales = {
            quantize.kernel_of(path): flat_shapes.pop(path) for path in list(flat_shapes) if quantize.is_scale(path)
        }
        shapes = nnx.from_flat_state(flat_shapes)
    loaded, used = [], set(extra)
    for path_, variable in nnx.to_flat_state(shapes):
        stacked = is_stacked(path_)
        shape = tuple(variable.get_value().shape)
        layer_shape = shape[1:] if stacked else shape
        # A stacked leaf [L, ...] is read from its L per-layer tensors.
        names = [hf_name(p) for p in (per_layer_paths(path_, shape[0]) if stacked else [path_])]
        layout = names[0][1]
        to_hf_shape, to_ours, _ = _LAYOUTS[layout]
        expected = to_hf_shape(layer_shape)
        tensors = []
        for name, _ in names:
            if name not in available:
                raise ValueError(
                    f"Checkpoint {source.description} is missing tensor {name!r} (shape {list(expected)})."
                )
            tensor = source.get_slice(name)  # lazy: nothing read yet
            if tuple(tensor.get_shape()) != expected:
                raise ValueError(
                    f"Tensor {name!r} has shape {list(tensor.get_shape())} in the checkpoint, but the config "
                    f"implies {list(expected)}."
                )
            tensors.append(tensor)
            used.add(name)
        scale = scales.get(path_)  # an int8 kernel: read in `dtype` (as unquantized), then quantized
        if mesh is None:
            arrays = [to_ours(source.get_tensor(name), layer_shape) for name, _ in names]
            value = jnp.asarray(np.stack(arrays) if stacked else arrays[0], dtype=dtype)
        else:
            value = _sharded(tensors, layout, shape, dtype, placements[path_], stacked=stacked)
        if scale is not None:
            value, scale_value = quantize_kernel(value, inputs=input_axes(path_[-1]), stacked=stacked)
            scale_path = path_[:-1] + (scale_name(path_[-1]),)
            if mesh is not None:
                value = jax.device_put(value, placements[path_])
                scale_value = jax.device_put(scale_value, placements[scale_path])
            loaded.append((scale_path, scale.replace(scale_value)))
        loaded.append((path_, variable.replace(value)))
    extras = {name: source.get_tensor(name) for name in extra}

    unexpected = sorted(
        n
        for n in available
        if n not in used
        and not n.endswith(_IGNORED_SUFFIXES)
        and not (config.tie_word_embeddings and n == "lm_head.weight")
    )
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
        raise ValueError(
            f"Checkpoint {source.description} has {len(unexpected)} tensor(s) the {config.architecture} config does "
            f"not use: {shown}."
        )
    return model, nnx.from_flat_state(loaded), extras


def hf_tensors(model: Model, params: Params) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, array)`` pairs in the Hugging Face layout, one parameter at a time."""
    for path_, leaf in nnx.to_flat_state(params):
        # A State entry is a Param, or a bare array where a user assigned one (params["x"] = ...).
        value = np.asarray(jax.device_get(leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf))
        stacked = is_stacked(path_)
        for layer, layer_path in enumerate(per_layer_paths(path_, value.shape[0]) if stacked else [path_]):
            name, layout = hf_name(layer_path)
            yield name, np.ascontiguousarray(_LAYOUTS[layout][2](value[layer] if stacked else value))
