r"""An int8 base: the projections stored a byte per weight, for LoRA over a frozen base (QLoRA's memory).

.. code-block:: python

    model, params = models.from_pretrained(path, jnp.bfloat16, quantization="int8")  # quantized as read
    model, params = quantize.quantize(model, params)  # or: a float model's params, quantized
    state, history = training.train(model, params, ..., lora=models.LoraConfig(rank=16))

Each of the seven projections (``q_proj`` ... ``down_proj``), a kernel :math:`W` of
``[*in, *out]``, becomes an int8 kernel :math:`Q` of the same shape and a float32 scale
:math:`s` of ``[*out]``, one per output channel (symmetric, absolute maximum):

.. math::
    s_j = \max_i |W_{ij}| / 127, \qquad Q_{ij} = \operatorname{round}(W_{ij} / s_j) \in [-127, 127]

(a column of zeros gets :math:`s_j = 1`), so :math:`|W_{ij} - s_j Q_{ij}| \le s_j / 2`. The
layer computes :math:`(x Q)\,s` in the compute dtype: the int8 kernel is converted in the
matmul, the scale applied to its output, and no dequantized copy is stored. The embeddings,
the output layer and the norms keep ``param_dtype``. A quantized model's params are not
trained: only adapters over them (:func:`jaxrl_llm.training.train` with ``lora``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_llm.models.config import LORA_TARGETS, QUANTIZATIONS
from jaxrl_llm.models.decoder import input_axes, is_stacked, quantize_kernel, scale_name
from jaxrl_llm.models.functional import Model, Params, abstract

QUANTIZED = LORA_TARGETS
"""The projections an int8 base stores as int8 (the embeddings and output layer are not)."""


def dequantize_kernel(q: jax.Array, scale: jax.Array, dtype, *, stacked: bool = False) -> jax.Array:
    """:math:`s \\odot Q` in ``dtype``: the float kernel an int8 one stands for (``stacked``:
    ``q`` ``[L, *in, *out]``, ``scale`` ``[L, *out]``)."""
    first = int(stacked)
    inputs = q.ndim - scale.ndim
    shape = scale.shape[:first] + (1,) * inputs + scale.shape[first:]  # [(L,) 1, ..., *out]
    return (q.astype(jnp.float32) * scale.astype(jnp.float32).reshape(shape)).astype(dtype)


def _is_kernel(path: tuple) -> bool:
    return path[-1] in QUANTIZED


def is_scale(path: tuple) -> bool:
    """Whether a parameter path is an int8 kernel's scales (``.../q_proj_scale``)."""
    return any(path[-1] == scale_name(name) for name in QUANTIZED)


def kernel_of(scale_path: tuple) -> tuple:
    """The path of the kernel whose scales are at ``scale_path``."""
    return (*scale_path[:-1], scale_path[-1][: -len(scale_name(""))])


def quantize(model: Model, params: Params, *, quantization: str = "int8") -> tuple[Model, Params]:
    """``model`` with its projections stored as ``quantization`` (``"int8"``), and ``params``
    quantized: each projection kernel as int8 with its scales (:func:`quantize_kernel`), the
    other leaves ``params``' own arrays (no copies). Adapters, if any, are kept as they are.

    Raises:
      ValueError: ``model`` is quantized already, or an unknown ``quantization``.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantize: `quantization` must be one of {', '.join(map(repr, QUANTIZATIONS))}; "
                         f"got {quantization!r}.")  # fmt: skip
    if model.config.quantization is not None:
        raise ValueError(f"quantize: the model is quantized already ({model.config.quantization}).")
    quantized_model, like = abstract(dataclasses.replace(model.config, quantization=quantization))
    given, shapes = dict(nnx.to_flat_state(params)), dict(nnx.to_flat_state(like))
    out = {}
    for path, leaf in shapes.items():
        if _is_kernel(path):
            q, scale = quantize_kernel(given[path][...], inputs=input_axes(path[-1]), stacked=is_stacked(path))
            scale_path = (*path[:-1], scale_name(path[-1]))
            out[path], out[scale_path] = leaf.replace(q), shapes[scale_path].replace(scale)
        elif not is_scale(path):
            if path not in given:
                raise ValueError(f"quantize: `params` lack {'/'.join(map(str, path))}, which the model has.")
            out[path] = given[path]
    return quantized_model, nnx.from_flat_state(out)


def dequantize(model: Model, params: Params) -> tuple[Model, Params]:
    """The float model an int8 one stands for: each kernel :math:`s \\odot Q` in
    ``param_dtype``, the scales dropped, the other leaves ``params``' own arrays; ``(model,
    params)`` as they are if ``model`` is not quantized."""
    if model.config.quantization is None:
        return model, params
    plain_model, _ = abstract(dataclasses.replace(model.config, quantization=None))
    flat = dict(nnx.to_flat_state(params))
    dtype = model.config.param_dtype
    out = {}
    for path, leaf in flat.items():
        if is_scale(path):
            continue
        if _is_kernel(path):
            scale = flat[(*path[:-1], scale_name(path[-1]))][...]
            leaf = leaf.replace(dequantize_kernel(leaf[...], scale, dtype, stacked=is_stacked(path)))
        out[path] = leaf
    return plain_model, nnx.from_flat_state(out)
