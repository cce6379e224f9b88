r"""A Llama-family decoder in Flax NNX: RMSNorm, GQA with RoPE, SwiGLU.

The modules hold parameters only: no caches, no RNG state, nothing that mutates in a
forward pass. A KV cache is an explicit :class:`KVCache` pytree passed in and returned
(one array per layer, or one stacked ``[L, ...]`` array that scanned layers update in place).
Every parameter carries logical axis names (``out_sharding`` metadata, not applied
eagerly), so that a rules table can map them to a device mesh:

============ ==========================================
name         axis
============ ==========================================
``vocab``    vocabulary
``embed``    model width (``hidden_size``)
``heads``    query heads
``kv_heads`` key/value heads
``head_dim`` width of a head
``mlp``      MLP width (``intermediate_size``)
``norm``     the scale of a norm over ``embed``
``layers``   the decoder layers of a stacked layout (never split)
============ ==========================================

Two layouts of the decoder layers' params (``config.scan_layers``): one subtree per layer,
``layers/<l>/...`` (run by a Python loop), or one stacked ``[L, ...]`` leaf per weight kind,
``layers/...``, with the leading logical axis ``layers`` (run by one ``jax.lax.scan``).
:func:`stack_layers` and :func:`unstack_layers` convert between them; a model's
initialisation draws the same numbers in both.

Numerics follow Hugging Face's implementations so that logits match: norms, RoPE and
the attention softmax in float32, matmuls in ``config.dtype``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_llm.models.config import LORA_TARGETS, ModelConfig, RopeConfig

INIT_STD = 0.02  # Hugging Face's initializer_range for these families


def _param(rngs: nnx.Rngs | None, shape: tuple[int, ...], axes: tuple[str, ...], dtype, *, ones: bool = False):
    """A parameter with logical axis names; normal(0.02) or ones."""
    if ones:
        value = jnp.ones(shape, dtype)
    elif rngs is None:
        value = jnp.zeros(shape, dtype)
    else:
        value = (INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


INPUT_AXES = {"o_proj": 2}
"""How many leading axes of a projection's kernel are its inputs (``o_proj``: heads and
head_dim); the others have one (``[embed, ...]``, ``[mlp, ...]``)."""


def input_axes(name: str) -> int:
    """The number of leading input axes of projection ``name``'s kernel (:data:`INPUT_AXES`)."""
    return INPUT_AXES.get(name, 1)


def scale_name(name: str) -> str:
    """The parameter holding the int8 scales of projection ``name`` (``q_proj`` -> ``q_proj_scale``)."""
    return f"{name}_scale"


@functools.partial(jax.jit, static_argnames=("inputs", "stacked"))
def quantize_kernel(kernel: jax.Array, *, inputs: int = 1, stacked: bool = False) -> tuple[jax.Array, jax.Array]:
    r"""``(Q, s)``: ``kernel`` ``[*in, *out]`` (``inputs`` leading axes) as int8 and its
    float32 scales ``[*out]``, one per output channel, symmetric:
    :math:`s_j = \max_i |W_{ij}| / 127` (1 for a column of zeros),
    :math:`Q_{ij} = \operatorname{round}(W_{ij} / s_j)` (:mod:`jaxrl_llm.models.quantize`).
    ``stacked``: ``kernel`` is ``[L, *in, *out]``, each layer's quantized on its own
    (scales ``[L, *out]``)."""
    w = kernel.astype(jnp.float32)
    first = int(stacked)
    peak = jnp.max(jnp.abs(w), axis=tuple(range(first, first + inputs)), keepdims=True)  # [(L,) 1, ..., *out]
    # A product by the constant 1/127, which every backend rounds alike (XLA may turn a
    # division by a constant into one anyway, so the scales do not depend on where they run).
    scale = jnp.where(peak > 0, peak * np.float32(1 / 127), 1.0)
    q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    return q, scale.reshape(w.shape[:first] + w.shape[first + inputs :])


def _projection(
    module: nnx.Module,
    name: str,
    rngs: nnx.Rngs | None,
    config: ModelConfig,
    shape: tuple[int, ...],
    axes: tuple[str, ...],
) -> None:
    """Gives ``module`` the kernel of projection ``name`` ``[*in, *out]`` (:func:`input_axes`
    leading axes): in ``param_dtype``, or with ``config.quantization`` as int8 with its float32
    scales ``{name}_scale`` ``[*out]`` (:func:`quantize_kernel` of the same initialisation)."""
    inputs = input_axes(name)
    if config.quantization is None:
        setattr(module, name, _param(rngs, shape, axes, config.param_dtype))
        return
    q, scale = quantize_kernel(_param(rngs, shape, axes, jnp.float32)[...], inputs=inputs)
    setattr(module, name, nnx.Param(q, out_sharding=axes, eager_sharding=False))
    setattr(module, scale_name(name), nnx.Param(scale, out_sharding=axes[inputs:], eager_sharding=False))


def _linear(
    module: nnx.Module, name: str, x: jax.Array, config: ModelConfig, *, dropout_key: jax.Array | None = None
) -> jax.Array:
    r"""``x`` ``[..., in]`` (flat features) through projection ``name`` and its adapter:
    :math:`x W + s_{lora}\,(x A) B`, ``[..., out]`` flat, in ``config.dtype``. An int8 kernel
    :math:`Q` with scales :math:`s` computes :math:`(x Q) \odot s` (:mod:`jaxrl_llm.models.quantize`)."""
    w = getattr(module, name)[...]
    kernel = w.astype(config.dtype).reshape(math.prod(w.shape[: input_axes(name)]), -1)  # [in, out]
    out = dense(x, kernel)
    scale = getattr(module, scale_name(name), None)
    if scale is not None:  # applied in float32: a bfloat16 scale would add its own rounding
        scale = scale[...].reshape((1,) * (out.ndim - 1) + (-1,))  # [1, ..., out] float32
        out = (out.astype(jnp.float32) * scale).astype(config.dtype)
    return _with_lora(module, name, x, out, config, dropout_key=dropout_key)


class LoraParam(nnx.LoRAParam):
    """A LoRA adapter's weight (:mod:`jaxrl_llm.models.lora`): a parameter the filters
    ``nnx.split(module, LoraParam, ...)`` and :func:`jaxrl_llm.models.lora.split` tell apart
    from the base's. A flax ``nnx.LoRAParam`` (itself an ``nnx.Param``), so filters written
    for flax's LoRA, as Tunix's and qwix's are, select the adapters too."""


def lora_a_init(key: jax.Array | None, shape: tuple[int, ...], dtype) -> jax.Array:
    r"""A LoRA ``A`` ``[*in, r]`` as PEFT initialises it: uniform in :math:`\pm 1/\sqrt{in}`
    (Kaiming-uniform with :math:`a = \sqrt 5`); zeros without a ``key`` (to be loaded)."""
    if key is None:
        return jnp.zeros(shape, dtype)
    bound = 1.0 / np.sqrt(np.prod(shape[:-1]))
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


def _lora_pair(
    module: nnx.Module, rngs: nnx.Rngs | None, config: ModelConfig, target: str, shape: tuple[int, ...], axes
) -> None:
    """Gives ``module`` the adapter of projection ``target`` (kernel ``shape`` ``[*in, *out]``
    with logical ``axes``, split at :func:`input_axes`) if ``config.lora`` targets it:
    ``{target}_lora_a`` ``[*in, r]`` (:func:`lora_a_init`) and ``{target}_lora_b``
    ``[r, *out]`` (zeros)."""
    lora = config.lora
    if lora is None or target not in lora.targets:
        return
    inputs = input_axes(target)
    a = lora_a_init(None if rngs is None else rngs.params(), (*shape[:inputs], lora.rank), lora.dtype)
    b = jnp.zeros((lora.rank, *shape[inputs:]), lora.dtype)
    setattr(module, f"{target}_lora_a", LoraParam(a, out_sharding=(*axes[:inputs], "lora"), eager_sharding=False))
    setattr(module, f"{target}_lora_b", LoraParam(b, out_sharding=("lora", *axes[inputs:]), eager_sharding=False))


def _projections(module: nnx.Module, rngs: nnx.Rngs | None, config: ModelConfig, specs) -> None:
    """Gives ``module`` each projection of ``specs`` (``name -> (shape, axes)``,
    :func:`_projection`), then each one's adapter (:func:`_lora_pair`): the kernels draw
    from ``rngs`` before the adapters."""
    for name, (shape, axes) in specs.items():
        _projection(module, name, rngs, config, shape, axes)
    for name, (shape, axes) in specs.items():
        _lora_pair(module, rngs, config, name, shape, axes)


def _with_lora(
    module: nnx.Module, target: str, x: jax.Array, out: jax.Array, config: ModelConfig, *, dropout_key=None
) -> jax.Array:
    r"""``out`` ``[..., out]`` (:math:`x W`, ``x`` ``[..., in]`` with flat features) plus
    :math:`s\,(x A) B` in ``config.dtype`` when ``target`` has an adapter. With a
    ``dropout_key`` and ``config.lora.dropout`` :math:`p > 0`, the adapter reads
    :math:`x \odot m / (1 - p)`, :math:`m_i \sim \text{Bernoulli}(1 - p)` (PEFT's
    ``lora_dropout``; the base's :math:`x W` reads :math:`x` as it is)."""
    a = getattr(module, f"{target}_lora_a", None)
    if a is None:
        return out
    rate = config.lora.dropout
    if dropout_key is not None and rate > 0:
        keep = jax.random.bernoulli(jax.random.fold_in(dropout_key, LORA_TARGETS.index(target)), 1 - rate, x.shape)
        x = jnp.where(keep, x / (1 - rate), 0).astype(x.dtype)
    b = getattr(module, f"{target}_lora_b")[...]
    a = a[...].reshape(-1, b.shape[0]).astype(config.dtype)  # [in, r]
    b = b.reshape(b.shape[0], -1).astype(config.dtype)  # [r, out]
    return out + (config.lora.scale * dense(dense(x, a), b)).astype(config.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    r""":math:`x / \sqrt{\overline{x^2} + \epsilon} \cdot g`, in float32, back to ``x``'s dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    scale = scale.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + scale.shape)  # [1, ..., 1, E]
    return (scale * normed.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)


@jax.custom_vjp
def dense(x: jax.Array, kernel: jax.Array) -> jax.Array:
    r"""``[..., E] @ [E, F] -> [..., F]``, with a backward pass that suits XLA's CPU backend.

    The same numbers as ``x @ kernel`` in both directions. The backward pass first
    materialises the cotangent (an optimization barrier), then computes
    :math:`\partial x = g W^\top` and :math:`\partial W = x^\top g` over the flattened
    leading axes. Left to itself, XLA fuses the cotangent's elementwise producers (SwiGLU's
    derivative, say) into transposing copies feeding the weight-gradient matmul, and a
    training step's backward pass runs about 2x slower on CPU.
    """
    return x @ kernel


def _dense_forward(x, kernel):
    return x @ kernel, (x, kernel)


def _dense_backward(residuals, cotangent):
    x, kernel = residuals
    cotangent = jax.lax.optimization_barrier(cotangent)  # [..., F]
    dx = cotangent @ kernel.T  # [..., E]
    flat_x = x.reshape(-1, x.shape[-1])  # [N, E]
    flat_cotangent = cotangent.reshape(-1, cotangent.shape[-1])  # [N, F]
    dkernel = jax.lax.dot_general(flat_x, flat_cotangent, (((0,), (0,)), ((), ())))  # [E, F]
    return dx.astype(x.dtype), dkernel.astype(kernel.dtype)


dense.defvjp(_dense_forward, _dense_backward)


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    r""":math:`\operatorname{silu}(g) \odot u = g\,\sigma(g)\,u`, elementwise, with a backward pass
    that keeps only ``gate`` and ``up``.

    .. math::
        \partial g = \partial h \, u \, \sigma(g)\big(1 + g(1 - \sigma(g))\big), \qquad
        \partial u = \partial h \, g \, \sigma(g)

    Differentiated by XLA, the forward pass also writes :math:`\sigma(g)` and
    :math:`\operatorname{silu}(g)` out for the backward pass: two more passes over
    ``[tokens, intermediate_size]`` tensors, the widest activations of the model. Here
    the forward pass is one pass, and the backward pass one more that recomputes
    :math:`\sigma(g)`.
    """
    return jax.nn.silu(gate) * up


def _swiglu_forward(gate, up):
    # Not `swiglu(...)`: TRPO's Fisher-vector products differentiate this rule in forward
    # mode, and a custom_vjp function cannot be.
    return jax.nn.silu(gate) * up, (gate, up)


def _swiglu_backward(residuals, d_out):
    gate, up = residuals
    g32, u32, d32 = gate.astype(jnp.float32), up.astype(jnp.float32), d_out.astype(jnp.float32)
    sigmoid = jax.nn.sigmoid(g32)
    d_gate = d32 * u32 * sigmoid * (1 + g32 * (1 - sigmoid))
    d_up = d32 * g32 * sigmoid
    return d_gate.astype(gate.dtype), d_up.astype(up.dtype)


swiglu.defvjp(_swiglu_forward, _swiglu_backward)


@functools.cache
def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """``[head_dim / 2]`` float32 RoPE inverse frequencies, with Llama 3 scaling if set."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    # theta ** e in float64, rounded once: what torch's float32 pow returns (a float32 pow
    # in NumPy is 1 ulp off on some entries, which shows in logits at positions ~1e5).
    powers = (np.float64(rope.theta) ** exponents.astype(np.float64)).astype(np.float32)
    inv_freq = np.float32(1.0) / powers
    if rope.rope_type == "llama3":
        low_freq_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_freq_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def rope_angles(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)``, each ``[B, S, 1, D]``, of the rotary angles of ``positions`` ``[B, S]``.

    Computed once per forward pass and shared by every layer.
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]  # [B, S, D/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    return (
        jnp.concatenate([cos, cos], axis=-1)[:, :, None, :],  # [B, S, 1, D]
        jnp.concatenate([sin, sin], axis=-1)[:, :, None, :],
    )


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    r"""Rotates ``x`` ``[B, S, H, D]`` by the angles of :func:`rope_angles` (half-split layout):
    :math:`x \cos\theta + \operatorname{rotate\_half}(x) \sin\theta`,
    :math:`\operatorname{rotate\_half}([x_1, x_2]) = [-x_2, x_1]`."""
    cos, sin = rope
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)  # [B, S, H, D/2] each
    rotated_half = jnp.concatenate([-second, first], axis=-1)  # [B, S, H, D]
    return (x32 * cos + rotated_half * sin).astype(x.dtype)


@jax.custom_vjp
def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    r"""Softmax attention of grouped queries, with a hand-written backward pass.

    .. math::
        P = \operatorname{softmax}\big(\operatorname{mask}(q k^\top / \sqrt{D})\big), \qquad o = P v

    Masked scores are the most negative float32 (not :math:`-\infty`): a query with no
    valid key gets a uniform, finite row instead of NaN. The backward pass is the
    textbook one, :math:`dS = P \odot (dP - \operatorname{rowsum}(dP \odot P))`, with
    the cotangents materialised before each matmul: left to itself, XLA's CPU backend
    fuses the softmax derivative into transposing copies and the backward pass slows.

    Args:
      q: ``[B, KVH, G, S, D]`` queries, ``G`` per key-value head.
      k, v: ``[B, KVH, K, D]`` keys and values.
      mask: ``[B, S, K]`` bool, query ``s`` may attend key slot ``k``.

    Returns:
      ``[B, S, KVH, G, D]`` in ``q``'s dtype.
    """
    return _attend_forward(q, k, v, mask)[0]


def _attend_forward(q, k, v, mask):
    root_d = np.sqrt(q.shape[-1]).astype(np.float32)
    scores = jnp.einsum("bkgsd,bktd->bkgst", q, k, preferred_element_type=jnp.float32) / root_d  # [B, KVH, G, S, K]
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    # A plain batched [S, K] @ [K, D] per (b, kv head), then the transpose: asked for
    # "bskgd" directly, XLA's CPU backend runs the product as a slower transposed dot.
    out = jnp.einsum("bkgst,bktd->bkgsd", probs, v.astype(q.dtype)).transpose(0, 3, 1, 2, 4)  # [B, S, KVH, G, D]
    return out, (q, k, v, mask, probs)


def _attend_backward(residuals, d_out):
    q, k, v, mask, probs = residuals
    root_d = np.sqrt(q.shape[-1]).astype(np.float32)
    d_out = d_out.astype(q.dtype).transpose(0, 2, 3, 1, 4)  # [B, KVH, G, S, D], as the forward's product
    d_out = jax.lax.optimization_barrier(d_out)
    d_probs = jnp.einsum("bkgsd,bktd->bkgst", d_out, v.astype(q.dtype), preferred_element_type=jnp.float32)
    d_v = jnp.einsum("bkgst,bkgsd->bktd", probs, d_out)  # [B, KVH, K, D]
    p32 = probs.astype(jnp.float32)
    d_scores = p32 * (d_probs - jnp.sum(d_probs * p32, axis=-1, keepdims=True))  # [B, KVH, G, S, K]
    d_scores = jnp.where(mask[:, None, None], d_scores / root_d, 0.0)
    d_scores = jax.lax.optimization_barrier(d_scores.astype(q.dtype))
    d_q = jnp.einsum("bkgst,bktd->bkgsd", d_scores, k.astype(q.dtype))
    d_k = jnp.einsum("bkgst,bkgsd->bktd", d_scores, q)
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None


attend.defvjp(_attend_forward, _attend_backward)


def attention_implementation(config: ModelConfig) -> str:
    """``config.attention`` with ``auto`` resolved: ``xla`` (:func:`attend`) when JAX's
    default backend is the CPU, else ``dot_product_attention``. Read at trace time."""
    if config.attention != "auto":
        return config.attention
    return "xla" if jax.default_backend() == "cpu" else "dot_product_attention"


def _attention(implementation: str, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention of ``q`` ``[B, S, H, D]`` to ``k``, ``v`` ``[B, KVH, K, D]``
    under ``mask`` ``[B, S, K]`` (bool) -> ``[B, S, H, D]``; query head ``h`` reads key-value
    head ``h // (H / KVH)``.

    ``xla``: :func:`attend`. Otherwise ``jax.nn.dot_product_attention``, with its default
    (``dot_product_attention``) or cuDNN (``cudnn``) implementation: float32 scores and
    softmax, and a finite score (``-0.7`` times the dtype's largest) at masked slots, so a
    query with no valid key (a padding position) gets a uniform, finite row as in
    :func:`attend`.
    """
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if implementation == "xla":
        q = q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)  # [B, S, KVH, G, D]
        q = q.transpose(0, 2, 3, 1, 4)  # [B, KVH, G, S, D]
        return attend(q, k, v, mask).reshape(batch, length, heads, head_dim)
    return jax.nn.dot_product_attention(
        q,
        k.transpose(0, 2, 1, 3),
        v.transpose(0, 2, 1, 3),  # [B, K, KVH, D]: jax's layout
        mask=mask[:, None],  # [B, 1, S, K], shared by the heads
        implementation="cudnn" if implementation == "cudnn" else None,
    )


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE, optional q/k/v biases and q/k norms."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs | None):
        c, pd = config, config.param_dtype
        self.config = config
        kv = ((c.hidden_size, c.num_kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"))
        _projections(
            self,
            rngs,
            c,
            {
                "q_proj": ((c.hidden_size, c.num_heads, c.head_dim), ("embed", "heads", "head_dim")),
                "k_proj": kv,
                "v_proj": kv,
                "o_proj": ((c.num_heads, c.head_dim, c.hidden_size), ("heads", "head_dim", "embed")),
            },
        )
        if c.attention_bias:
            self.q_bias = _param(None, (c.num_heads, c.head_dim), ("heads", "head_dim"), pd)
            self.k_bias = _param(None, (c.num_kv_heads, c.head_dim), ("kv_heads", "head_dim"), pd)
            self.v_bias = _param(None, (c.num_kv_heads, c.head_dim), ("kv_heads", "head_dim"), pd)
        if c.output_bias:
            self.o_bias = _param(None, (c.hidden_size,), ("embed",), pd)
        if c.qk_norm:
            self.q_norm = _param(None, (c.head_dim,), ("head_dim",), pd, ones=True)
            self.k_norm = _param(None, (c.head_dim,), ("head_dim",), pd, ones=True)

    def __call__(
        self,
        x: jax.Array,  # [B, S, E]
        rope: tuple[jax.Array, jax.Array],  # (cos, sin) [B, S, 1, D]: rope_angles of the positions
        mask: jax.Array,  # [B, S, K] bool: query s may attend key slot k
        cache: tuple[jax.Array, jax.Array] | None = None,  # ([B, KVH, K, D], [B, KVH, K, D]), or [L, ...] each
        cache_index: jax.Array | int = 0,
        layer: jax.Array | int | None = None,  # with a stacked [L, ...] cache: this layer's index in it
        dropout_key: jax.Array | None = None,  # LoRA dropout on the adapters' inputs (_with_lora)
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        c, dtype = self.config, self.config.dtype
        x = x.astype(dtype)

        def project(kernel: nnx.Param, bias_name: str, target: str) -> jax.Array:
            out = _linear(self, target, x, c, dropout_key=dropout_key)  # [B, S, heads * D]
            out = out.reshape(*x.shape[:2], *kernel[...].shape[1:])  # [B, S, heads, D]
            if c.attention_bias:
                out = out + getattr(self, bias_name)[...].astype(dtype)[None, None]
            return out

        q = project(self.q_proj, "q_bias", "q_proj")  # [B, S, H, D]
        k = project(self.k_proj, "k_bias", "k_proj")  # [B, S, KVH, D]
        v = project(self.v_proj, "v_bias", "v_proj")
        if c.qk_norm:
            q = rms_norm(q, self.q_norm[...], c.rms_norm_eps)
            k = rms_norm(k, self.k_norm[...], c.rms_norm_eps)
        q = apply_rope(q, rope)
        k = apply_rope(k, rope)
        # Keys and values heads-major, [B, KVH, K, D]: both attention dots then read them
        # (and the cache) in place, batched over (B, KVH), with no per-step transpose.
        k = k.transpose(0, 2, 1, 3)
        v = v.transpose(0, 2, 1, 3)
        if cache is not None and layer is None:  # write this call's keys/values at cache_index, attend to all slots
            start = (0, 0, cache_index, 0)
            k = jax.lax.dynamic_update_slice(cache[0], k.astype(cache[0].dtype), start)
            v = jax.lax.dynamic_update_slice(cache[1], v.astype(cache[1].dtype), start)
            cache = (k, v)
        elif cache is not None:  # the same in layer `layer` of the stacked cache, in place; then read that layer
            start = (layer, 0, 0, cache_index, 0)
            cache = tuple(
                jax.lax.dynamic_update_slice(stacked, new[None].astype(stacked.dtype), start)
                for stacked, new in zip(cache, (k, v))
            )  # [L, B, KVH, K, D] each
            k, v = (jax.lax.dynamic_index_in_dim(stacked, layer, keepdims=False) for stacked in cache)

        batch, length, heads, head_dim = q.shape
        out = _attention(attention_implementation(c), q, k.astype(dtype), v.astype(dtype), mask)  # [B, S, H, D]
        out = out.reshape(batch, length, heads * head_dim)
        out = _linear(self, "o_proj", out, c, dropout_key=dropout_key)  # [B, S, E]
        if c.output_bias:
            out = out + self.o_bias[...].astype(dtype)[None, None]
        return out, cache


class MLP(nnx.Module):
    r"""SwiGLU: :math:`W_{down}(\operatorname{silu}(x W_{gate}) \odot x W_{up})`."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs | None):
        c = config
        self.dtype = c.dtype
        up = ((c.hidden_size, c.intermediate_size), ("embed", "mlp"))
        _projections(
            self,
            rngs,
            c,
            {
                "gate_proj": up,
                "up_proj": up,
                "down_proj": ((c.intermediate_size, c.hidden_size), ("mlp", "embed")),
            },
        )
        self.config = c

    def __call__(self, x: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:  # [B, S, E] -> [B, S, E]
        c, dropout = self.config, dict(dropout_key=dropout_key)  # LoRA dropout (_with_lora)
        x = x.astype(self.dtype)
        gate = _linear(self, "gate_proj", x, c, **dropout)  # [B, S, F]
        up = _linear(self, "up_proj", x, c, **dropout)
        return _linear(self, "down_proj", swiglu(gate, up), c, **dropout)


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs | None):
        self.eps = config.rms_norm_eps
        self.input_layernorm = _param(None, (config.hidden_size,), ("norm",), config.param_dtype, ones=True)
        self.self_attn = Attention(config, rngs=rngs)
        self.post_attention_layernorm = _param(None, (config.hidden_size,), ("norm",), config.param_dtype, ones=True)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(
        self,
        x: jax.Array,  # [B, S, E]
        rope: tuple[jax.Array, jax.Array],  # (cos, sin) [B, S, 1, D]
        mask: jax.Array,  # [B, S, K] bool
        window: int | jax.Array | None = None,  # attend to at most this many most recent slots (None: all)
        cache: tuple[jax.Array, jax.Array] | None = None,  # ([B, KVH, K, D], [B, KVH, K, D]), or [L, ...] each
        cache_index: jax.Array | int = 0,
        layer: jax.Array | int | None = None,  # with a stacked cache: this layer's index in it
        dropout_key: jax.Array | None = None,  # this layer's LoRA dropout key (_with_lora)
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        mask = _window(mask, window, cache_index)
        attention_key, mlp_key = (None, None) if dropout_key is None else jax.random.split(dropout_key)
        attended, cache = self.self_attn(
            rms_norm(x, self.input_layernorm[...], self.eps), rope, mask, cache, cache_index, layer, attention_key
        )
        x = x + attended.astype(x.dtype)
        x = x + self.mlp(rms_norm(x, self.post_attention_layernorm[...], self.eps), mlp_key).astype(x.dtype)
        return x, cache


class KVCache(NamedTuple):
    """Keys and values of every layer for ``K`` slots, as an explicit pytree.

    Slot ``j`` holds the token written at step ``j`` (prompt tokens from the prefill,
    then one per decode step), left padding included; ``valid`` marks real tokens.

    Two layouts of ``keys`` and ``values``, each updated in place by a decode step
    (:func:`jaxrl_llm.models.init_cache` picks the model's): one array per layer, for
    unrolled layers, or one stacked ``[L, B, KVH, K, D]`` array for scanned ones
    (``config.scan_layers``), which the layer scan carries, writing each layer's new slot
    at ``(layer, ..., index)``. Either layout runs through either setting, at the cost of
    a stacking copy per call when a per-layer cache meets scanned layers.
    """

    keys: tuple[jax.Array, ...] | jax.Array  # L x [B, KVH, K, D], or stacked [L, B, KVH, K, D]
    values: tuple[jax.Array, ...] | jax.Array  # as keys
    valid: jax.Array  # [B, K] bool
    next_position: jax.Array  # [B] int32: RoPE position of the next token per row
    index: jax.Array  # [] int32: the next slot to write

    @property
    def stacked(self) -> bool:
        """Keys and values stacked ``[L, B, KVH, K, D]`` (else one array per layer)."""
        return not isinstance(self.keys, tuple)

    def take_rows(self, rows: jax.Array) -> KVCache:
        """The cache of rows ``rows`` (``[b]`` int, repeats allowed: ``rows = arange(B) // G``
        copies each prompt's cache to its ``G`` completions); the slot index is shared."""
        return self._map_rows(functools.partial(jnp.take, indices=rows))

    def repeat_rows(self, repeats: int) -> KVCache:
        """Each row ``repeats`` times, adjacent: :meth:`take_rows` of ``arange(B * repeats) //
        repeats``, as a repeat (whose transpose is a sum, not a scatter-add)."""
        return self._map_rows(functools.partial(jnp.repeat, repeats=repeats))

    def _map_rows(self, fn) -> KVCache:
        """``fn(leaf, axis=...)`` applied along the rows of every per-row leaf."""

        def kv(leaves):
            if isinstance(leaves, tuple):
                return tuple(fn(leaf, axis=0) for leaf in leaves)
            return fn(leaves, axis=1)  # [L, B, ...]: rows are axis 1

        return self._replace(
            keys=kv(self.keys),
            values=kv(self.values),
            valid=fn(self.valid, axis=0),
            next_position=fn(self.next_position, axis=0),
        )


class CausalLM(nnx.Module):
    """Embedding, decoder layers, final norm and output projection (or tied embedding)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs | None):
        c = config
        self.config = config
        self.embed_tokens = _param(rngs, (c.vocab_size, c.hidden_size), ("vocab", "embed"), c.param_dtype)
        # Drawn layer by layer in both layouts, so the weights do not depend on the layout.
        layers = [DecoderLayer(c, rngs=rngs) for _ in range(c.num_layers)]
        self.layers = _stacked_layer(layers) if c.scan_layers else nnx.List(layers)
        self.norm = _param(None, (c.hidden_size,), ("norm",), c.param_dtype, ones=True)
        if not c.tie_word_embeddings:
            self.lm_head = _param(rngs, (c.hidden_size, c.vocab_size), ("embed", "vocab"), c.param_dtype)

    def hidden_states(
        self,
        tokens: jax.Array,  # [B, S] int
        positions: jax.Array,  # [B, S] int
        mask: jax.Array,  # [B, S, K] bool
        cache: KVCache | None = None,
        *,
        carry_cache: bool = True,
        dropout_key: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Final-norm hidden states ``[B, S, E]`` (and the updated cache, in its layout).

        Stacked layers (``config.scan_layers``) run in one ``jax.lax.scan``
        (:meth:`scanned_layers`), per-layer ones in a Python loop.
        ``carry_cache``: how a scan takes the cache (see :meth:`scanned_layers`): carried
        and updated in place (prefill and decoding), or as the scan's input and output, a
        copy per call whose gradient stays per layer (a differentiated pass).
        ``dropout_key``: LoRA dropout (``config.lora.dropout``) on the adapters' inputs, layer
        ``l`` drawing from ``fold_in(dropout_key, l)``; ``None``: none (decoding, scoring).

        ``tokens`` are not checked here (they may be traced): the embedding lookup is a
        JAX gather, so an id outside ``[0, V)`` reads another row (a negative id counts
        from the end, the rest are clamped). The public functions of
        :mod:`jaxrl_llm.models.functional` refuse such ids when they are concrete.
        """
        c = self.config
        x = self.embed_tokens[...][tokens].astype(c.dtype)  # [B, S, E]
        rope = rope_angles(positions, inverse_frequencies(c.rope, c.head_dim))  # shared by layers
        cache_index = 0 if cache is None else cache.index
        kv = None if cache is None else (cache.keys, cache.values)
        layer_keys = _layer_keys(dropout_key, c.num_layers)
        if c.scan_layers:
            x, kv = self.scanned_layers(x, rope, mask, kv, cache_index, carry_cache=carry_cache, layer_keys=layer_keys)
        elif cache is not None and cache.stacked:  # each layer updates its slice of the stacked cache in place
            for i, layer in enumerate(self.layers):
                call = _remat(layer, c.remat, layer_index=i)
                x, kv = call(x, rope, mask, c.window(i), kv, cache_index, _key_of(layer_keys, i))
        else:
            new_keys, new_values = [], []
            for i, layer in enumerate(self.layers):
                layer_cache = None if kv is None else (kv[0][i], kv[1][i])
                call = _remat(layer, c.remat)
                x, layer_cache = call(x, rope, mask, c.window(i), layer_cache, cache_index, _key_of(layer_keys, i))
                if kv is not None:
                    new_keys.append(layer_cache[0])
                    new_values.append(layer_cache[1])
            kv = None if kv is None else (tuple(new_keys), tuple(new_values))
        if cache is not None:
            cache = cache._replace(keys=kv[0], values=kv[1])
        return rms_norm(x, self.norm[...], c.rms_norm_eps), cache

    def scanned_layers(
        self,
        x: jax.Array,  # [B, S, E]
        rope: tuple[jax.Array, jax.Array],  # (cos, sin) [B, S, 1, D]
        mask: jax.Array,  # [B, S, K] bool, before the layers' windows
        kv: tuple[jax.Array, jax.Array] | tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]] | None = None,
        cache_index: jax.Array | int = 0,
        *,
        carry_cache: bool = True,
        layer_keys: jax.Array | None = None,  # [L] LoRA dropout keys, one per layer (_layer_keys)
    ) -> tuple[jax.Array, tuple | None]:
        r"""The decoder layers as one ``jax.lax.scan`` over their stacked weights (``config.scan_layers``).

        .. math::
            x_{l+1} = f(x_l;\ \theta_l, w_l), \qquad l = 0 \dots L - 1

        with :math:`\theta_l` layer ``l``'s weights and :math:`w_l` its attention window.
        The same numbers as the unrolled loop up to float rounding, in both directions; the
        program holds the layer once instead of ``L`` times. ``config.remat`` applies to the
        scan's body.

        The scan reads layer ``l``'s weights out of the stored ``[L, ...]`` leaves and
        writes their gradients into ``[L, ...]`` ones: no stacked copy of the weights, no
        per-layer slicing of the gradient. Windows: a static one when every layer has the
        same, else a per-layer ``[L]`` int32 operand (``None``, full attention, as the
        largest int32).

        ``kv``: the cache's keys and values, stacked ``[L, B, KVH, K, D]`` each (or one array
        per layer: stacked here, and returned unstacked). ``carry_cache``: the scan carries
        the stacked cache, each layer writing its new slots in place and reading its own
        ``[B, KVH, K, D]`` slice (prefill, decoding: no copy of the cache per call). Else the
        cache is the scan's ``xs``, each layer's updated slice its ``ys``: one copy per call,
        but differentiable at the cost of one cache's worth of cotangent, where a carried
        cache's gradient would add a whole-cache array per layer.
        """
        c = self.config
        graphdef, stacked = nnx.split(self.layers)
        frozen = None
        if c.lora is not None and c.remat != "none":  # the base under adapters: read by index (_frozen_layer)
            stacked, frozen = nnx.split_state(stacked, LoraParam, ...)
        windows = {c.window(i) for i in range(c.num_layers)}
        if len(windows) == 1:  # one static window (or none) for every layer
            window, layer_windows = windows.pop(), None
        else:
            window = None
            full = np.iinfo(np.int32).max
            layer_windows = jnp.asarray(
                [full if w is None else w for w in map(c.window, range(c.num_layers))], jnp.int32
            )  # [L]
        per_layer = kv is not None and isinstance(kv[0], tuple)
        if per_layer:
            kv = (jnp.stack(kv[0]), jnp.stack(kv[1]))  # [L, B, KVH, K, D] each

        def apply(state, x, layer_window, layer_kv, layer, layer_key, index):
            if frozen is not None:
                state = nnx.merge_state(state, _frozen_layer(frozen, index))
            module = nnx.merge(graphdef, state)
            layer_window = window if layer_window is None else layer_window
            return module(x, rope, mask, layer_window, layer_kv, cache_index, layer, layer_key)

        apply = _checkpoint(apply, c.remat, prevent_cse=False)  # no CSE to guard against inside a scan
        index = jnp.arange(c.num_layers, dtype=jnp.int32)
        xs = dict(state=stacked, layer_window=layer_windows, layer_key=layer_keys, index=index)
        if kv is not None and carry_cache:

            def step(carry, per_layer):
                x, kv = apply(x=carry[0], layer_kv=carry[1], layer=per_layer["index"], **per_layer)
                return (x, kv), None

            (x, kv), _ = jax.lax.scan(step, (x, kv), xs)
        else:

            def step(x, per_layer):
                return apply(x=x, layer=None, **per_layer)

            x, kv = jax.lax.scan(step, x, dict(xs, layer_kv=kv))
        if per_layer:
            kv = (tuple(kv[0]), tuple(kv[1]))
        return x, kv

    def logits(self, hidden: jax.Array) -> jax.Array:
        """``[..., E] -> [..., V]`` float32 logits through the output projection (or tied embedding)."""
        dtype = self.config.dtype
        kernel = self.embed_tokens[...].T if self.config.tie_word_embeddings else self.lm_head[...]
        # float32 logits whatever the compute dtype: log-softmax and importance ratios need
        # them, and a bfloat16 logit near 20 is only resolved to 0.125.
        return jnp.matmul(hidden.astype(dtype), kernel.astype(dtype), preferred_element_type=jnp.float32)


LAYERS = "layers"
"""The logical axis of a stacked layout's leading ``[L]`` dimension, and the params' key of
the decoder layers in both layouts."""


def is_stacked(path: tuple) -> bool:
    """Whether a parameter path is a stacked layer leaf (``("layers", "mlp", "up_proj")``;
    a per-layer one is ``("layers", 3, "mlp", "up_proj")``)."""
    return len(path) > 1 and path[0] == LAYERS and not isinstance(path[1], int)


def _stack_leaves(leaves: list) -> Any:
    """Layer leaves (``nnx.Variable`` or arrays) -> one ``[L, ...]`` leaf, the ``layers``
    axis put first in a variable's logical axes."""
    first = leaves[0]
    if not isinstance(first, nnx.Variable):
        return jnp.stack(leaves)
    axes = first.get_metadata().get("out_sharding")
    value = jnp.stack([leaf[...] for leaf in leaves])
    return first.replace(value, out_sharding=None if axes is None else (LAYERS, *axes))


def _layer_leaf(leaf: Any, layer: int) -> Any:
    """Layer ``layer``'s slice of a stacked leaf, the ``layers`` axis dropped from its logical axes."""
    if not isinstance(leaf, nnx.Variable):
        return leaf[layer]
    axes = leaf.get_metadata().get("out_sharding")
    return leaf.replace(leaf[...][layer], out_sharding=None if axes is None else tuple(axes[1:]))


def stack_layers(params: nnx.State) -> nnx.State:
    """Per-layer params (``layers/<l>/...``) -> the stacked layout (``layers/...`` of
    ``[L, ...]``); the other leaves as they are (not copied). Stacked params come back with
    the same arrays. Works on any ``nnx.State`` with the params' paths (adapters, a gradient)."""
    flat = dict(nnx.to_flat_state(params))
    out, groups = {}, {}
    for path, leaf in flat.items():
        if path[0] == LAYERS and isinstance(path[1], int):
            groups.setdefault(path[2:], {})[path[1]] = leaf
        else:
            out[path] = leaf
    for rest, layers in groups.items():
        out[(LAYERS, *rest)] = _stack_leaves([layers[layer] for layer in range(len(layers))])
    return nnx.from_flat_state(out)


def unstack_layers(params: nnx.State) -> nnx.State:
    """Stacked params -> the per-layer layout: :func:`stack_layers`' inverse (a copy of each
    layer's slice). Per-layer params come back with the same arrays."""
    out = {}
    for path, leaf in nnx.to_flat_state(params):
        if is_stacked(path):
            for layer in range(leaf.shape[0]):
                out[(LAYERS, layer, *path[1:])] = _layer_leaf(leaf, layer)
        else:
            out[path] = leaf
    return nnx.from_flat_state(out)


def _stacked_layer(layers: list[DecoderLayer]) -> DecoderLayer:
    """One :class:`DecoderLayer` whose params are ``layers``' stacked ``[L, ...]``."""
    graphdef = nnx.graphdef(layers[0])
    flats = [dict(nnx.to_flat_state(nnx.state(layer))) for layer in layers]
    stacked = {path: _stack_leaves([flat[path] for flat in flats]) for path in flats[0]}
    return nnx.merge(graphdef, nnx.from_flat_state(stacked))


def _window(mask: jax.Array, window: int | jax.Array | None, start: jax.Array | int) -> jax.Array:
    """Restricts a ``[B, S, K]`` attention mask to the last ``window`` slots per query, the
    queries in slots ``start ... start + S - 1``."""
    if window is None:
        return mask
    length, slots = mask.shape[1], mask.shape[2]
    query_slot = start + jnp.arange(length)[:, None]  # [S, 1]
    key_slot = jnp.arange(slots)[None, :]  # [1, K]
    return mask & (query_slot - key_slot < window)[None]


REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
"""``ModelConfig.remat`` -> the ``jax.checkpoint`` policy of each decoder layer (``none``:
no checkpoint)."""


def _checkpoint(fn, remat: str, *, prevent_cse: bool = True):
    """``fn`` under ``jax.checkpoint`` with ``remat``'s policy; ``fn`` itself for ``none``."""
    if remat == "none":
        return fn
    return jax.checkpoint(fn, policy=REMAT_POLICIES[remat], prevent_cse=prevent_cse)


def _frozen_layer(frozen: nnx.State, index: jax.Array) -> nnx.State:
    """Layer ``index`` of the stacked ``[L, ...]`` leaves of a frozen base (a LoRA model's
    non-adapter params), read inside the scan's rematerialised body.

    The optimization barrier ties the stacks to the loop's index, so XLA cannot move work
    on the whole stack out of the loop: its CPU backend would otherwise convert every
    bfloat16 layer weight to float32 before the loop (a float32 copy of the base, twice its
    size). Read this way only where nothing differentiates the leaves and remat recomputes
    the layer: a differentiated leaf would add a stack-sized cotangent per layer, and without
    remat each layer's weights would be saved for the backward pass."""
    index, frozen = jax.lax.optimization_barrier((index, frozen))
    return jax.tree.map(lambda leaf: jax.lax.dynamic_index_in_dim(leaf, index, keepdims=False), frozen)


def _remat(layer: DecoderLayer, remat: str, *, layer_index: int | None = None):
    """``layer``'s call under :func:`_checkpoint`, as a function of its weights (which
    ``jax.checkpoint`` must see as inputs) with the window kept static; the call itself
    for ``none``. ``layer_index``: the layer's index in a stacked cache (static)."""
    if remat == "none":
        return lambda x, rope, mask, window, cache, cache_index, key: layer(
            x, rope, mask, window, cache, cache_index, layer_index, key
        )
    graphdef, state = nnx.split(layer)

    def call(x, rope, mask, window, cache, cache_index, key):
        def apply(state, x, rope, mask, cache, cache_index, key):
            return nnx.merge(graphdef, state)(x, rope, mask, window, cache, cache_index, layer_index, key)

        return _checkpoint(apply, remat)(state, x, rope, mask, cache, cache_index, key)

    return call


def _layer_keys(key: jax.Array | None, num_layers: int) -> jax.Array | None:
    """``[L]`` keys, ``fold_in(key, l)`` for layer ``l`` (``None`` without ``key``)."""
    return None if key is None else jax.vmap(lambda layer: jax.random.fold_in(key, layer))(jnp.arange(num_layers))


def _key_of(keys: jax.Array | None, layer: int) -> jax.Array | None:
    return None if keys is None else keys[layer]
