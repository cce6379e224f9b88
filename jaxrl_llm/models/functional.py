"""The functional boundary of the model: a static :class:`Model` and a params pytree.

.. code-block:: python

    model, params = models.init(config, jax.random.key(0))
    logits = models.forward(model, params, tokens, attention_mask=mask)     # [B, S, V]
    logits, cache = models.prefill(model, params, prompt, prompt_mask, cache_size=S + N)
    logits, cache = models.decode_step(model, params, next_tokens, cache)  # [B, V]
    logits, cache = models.extend(model, params, tool_tokens, tool_mask, cache)  # [B, E, V]

``Model`` is a static pytree node (it has no array leaves), so it passes straight through
``jax.jit``; ``params`` is an ``nnx.State`` of ``nnx.Param`` leaves, a plain pytree for
optax, orbax and sharding. Policy, old and reference parameters are three such pytrees
sharing one ``Model``. Every function merges ``graphdef`` and ``params`` inside, so each
is pure and jit-able.

**Checked inputs.** Token ids must be in ``[0, V)`` (``V = config.vocab_size``), padding
included, and masks bool or 0/1. Concrete arguments (NumPy, eager ``jax.Array``s) are
checked when the function is called and refused with a ``ValueError``; traced ones (under
``jit``) cannot be read: there the embedding lookup keeps JAX's gather semantics (a
negative id counts from the end, the rest are clamped into range, so a bad id silently
reads another token's embedding) and a numeric mask is taken as ``mask != 0``. Validate
ids on the host before a jitted call. :func:`prefill` also refuses a concrete mask that is
not left-padded.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_llm import _checks, ops
from jaxrl_llm import compilation_cache as compilation_cache_lib
from jaxrl_llm.models.config import EXECUTION_OPTIONS, LORA_TARGETS, ModelConfig
from jaxrl_llm.models.decoder import CausalLM, KVCache, stack_layers, unstack_layers

Params = nnx.State


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Model:
    """The static half of a model: its config and NNX graph definition (hashable)."""

    config: ModelConfig
    graphdef: Any

    def module(self, params: Params) -> CausalLM:
        return nnx.merge(self.graphdef, params)


def init(config: ModelConfig, key: jax.Array, *, compilation_cache: bool = True) -> tuple[Model, Params]:
    """A randomly initialised model: normal(0.02) weights, unit norm scales, zero biases.

    The draws run eagerly, one small XLA program per weight shape; ``compilation_cache``
    turns on JAX's persistent compilation cache first, as :func:`jaxrl_llm.training.train`
    does (:func:`jaxrl_llm.compilation_cache.enable`; ``$JAXRL_LLM_COMPILATION_CACHE=off``
    keeps it off everywhere), so a second process loads those programs instead of
    compiling them."""
    if compilation_cache:
        compilation_cache_lib.enable()
    module = CausalLM(config, rngs=nnx.Rngs(params=key))
    graphdef, params = nnx.split(module, nnx.Param)
    return Model(config=config, graphdef=graphdef), params


def abstract(config: ModelConfig) -> tuple[Model, Params]:
    """The model and a params pytree of ``jax.ShapeDtypeStruct`` leaves: no memory used."""
    module = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(params=0)))
    graphdef, params = nnx.split(module, nnx.Param)
    return Model(config=config, graphdef=graphdef), params


def with_options(model: Model, **options: Any) -> Model:
    """``model`` with execution options changed, for the same params.

    .. code-block:: python

        model, params = models.from_pretrained("path/to/checkpoint")
        fast = models.with_options(model, remat="dots")
        logp = models.completion_logprobs(fast, params, tokens, mask, n)  # same params

    Options are the fields of :data:`jaxrl_llm.models.config.EXECUTION_OPTIONS`
    (``remat``, ``attention``; see :class:`ModelConfig`). They change how the model runs,
    not its parameters: the params pytree of ``model`` fits the returned model unchanged.
    The graph definition is rebuilt from the new config (the modules read their options
    from it). ``scan_layers`` is the params' layout: :func:`with_scan_layers`.

    Raises:
      ValueError: an option that is not an execution option (an architecture field would
        make the params another model's), or a value :class:`ModelConfig` refuses.
    """
    unknown = sorted(set(options) - set(EXECUTION_OPTIONS))
    if unknown:
        layout = (
            " `scan_layers` is the params' layout: models.with_scan_layers(model, params, scan_layers=...) "
            "converts both."
            if "scan_layers" in unknown
            else ""
        )
        raise ValueError(
            f"with_options: {', '.join(map(repr, unknown))} is not an execution option; allowed: "
            f"{', '.join(map(repr, EXECUTION_OPTIONS))}. Other fields describe the architecture, "
            f"which the params belong to: build a new model for another.{layout}"
        )
    config = dataclasses.replace(model.config, **options)
    if config == model.config:
        return model
    return abstract(config)[0]


def with_scan_layers(model: Model, params: Params, scan_layers: bool) -> tuple[Model, Params]:
    """``model`` and ``params`` in the layout ``scan_layers`` (see :class:`ModelConfig`):
    the decoder layers' params stacked ``[L, ...]`` and run by one ``jax.lax.scan``
    (``True``), or one subtree per layer run by a Python loop (``False``). The same
    function, up to float rounding; the non-layer leaves are ``params``' own arrays, the
    layer leaves a stacked (or sliced) copy; abstract params (``jax.ShapeDtypeStruct``
    leaves) give abstract ones. ``(model, params)`` as they are when already in that
    layout. Adapters and int8 scales, if any, move with their kernels.

    .. code-block:: python

        model, params = models.from_pretrained(path)                         # one leaf per layer
        model, params = models.with_scan_layers(model, params, True)         # [L, ...] leaves

    Raises:
      ValueError: ``scan_layers`` is not a bool.
    """
    if not isinstance(scan_layers, bool):
        raise ValueError(f"with_scan_layers: `scan_layers` must be True or False; got {scan_layers!r}.")
    if model.config.scan_layers == scan_layers:
        return model, params
    relayout = stack_layers if scan_layers else unstack_layers
    if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(params)):
        relayout = functools.partial(jax.eval_shape, relayout)  # abstract params: shapes only
    return abstract(dataclasses.replace(model.config, scan_layers=scan_layers))[0], relayout(params)


COMPUTE_DTYPE_PARAMS = (*LORA_TARGETS, "lm_head", "embed_tokens", "q_bias", "k_bias", "v_bias", "o_bias")
"""The params the model reads only cast to ``config.dtype``: the projections' kernels, the
output layer, the embedding (a looked-up row is cast, so casting the table first gives the
same numbers) and the biases. Norm scales are read in float32; int8 kernels keep their
dtype and float32 scales; LoRA adapters are left as they are (small)."""


def in_compute_dtype(model: Model, params: Params) -> Params:
    """``params`` with each leaf of :data:`COMPUTE_DTYPE_PARAMS` cast to ``config.dtype``
    where it is stored wider (float32 weights, bfloat16 compute): the same function to the
    bit, since every use casts it anyway. For a pass that runs the weights many times and
    does not differentiate them, such as decoding, where each step would otherwise read
    the float32 weights and convert them again (XLA does not reliably hoist the casts out
    of the loop): one cast up front, then every step streams half the bytes. Costs a
    ``config.dtype`` copy of those weights while it lives. ``params`` itself when nothing
    is wider (``param_dtype == dtype``); works on abstract params under ``jax.eval_shape``.

    Not for a differentiated pass: the cast's transpose would add the gradients of a
    weight's several uses (a tied embedding's two, a shared prompt's two passes) in
    ``config.dtype`` instead of in the parameter's.
    """
    dtype = jnp.dtype(model.config.dtype)
    flat = nnx.to_flat_state(params)

    def narrower(path: tuple, leaf: Any) -> bool:
        value_dtype = jnp.dtype((leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf).dtype)
        return (
            path[-1] in COMPUTE_DTYPE_PARAMS
            and jnp.issubdtype(value_dtype, jnp.floating)
            and value_dtype.itemsize > dtype.itemsize
        )

    if not any(narrower(path, leaf) for path, leaf in flat):
        return params

    def cast(path: tuple, leaf: Any) -> Any:
        if not narrower(path, leaf):
            return leaf
        if isinstance(leaf, nnx.Variable):
            return leaf.replace(leaf.get_value().astype(dtype))
        return leaf.astype(dtype)

    return nnx.from_flat_state({path: cast(path, leaf) for path, leaf in flat})


def _inputs(fn: str, model: Model, tokens, attention_mask, positions):
    """Validated ``[B, S]`` ids, bool mask (default all ones) and positions (default: each
    row's first real token at 0). Values are checked only when concrete (see the module)."""
    ids = _checks.integer(fn, "tokens", tokens)
    _checks.rank(fn, "tokens", ids, 2, "[B, S]")
    _checks.nonempty(fn, "tokens", ids, "at least one sequence and one token")
    _checks.token_ids(fn, "tokens", tokens, model.config.vocab_size)
    tokens = ids
    length = tokens.shape[1]
    limit = model.config.max_position_embeddings
    if length > limit:
        raise ValueError(f"{fn}: sequence length {length} exceeds the model's max_position_embeddings ({limit}).")
    if attention_mask is None:
        attention_mask = jnp.ones(tokens.shape, bool)
    attention_mask = _checks.mask(fn, attention_mask, "tokens", tokens, name="attention_mask")
    if positions is None:
        # Left padding: the first real token is position 0.
        positions = jnp.maximum(jnp.cumsum(attention_mask, axis=1) - 1, 0)
    positions = _checks.integer(fn, "positions", positions)
    _checks.same_shape(fn, "positions", positions, "tokens", tokens)
    return tokens, attention_mask, positions


def _causal(attention_mask: jax.Array) -> jax.Array:
    """``[B, S]`` key validity -> ``[B, S, S]`` causal mask over slots."""
    length = attention_mask.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    return causal[None] & attention_mask[:, None, :]


def _hidden(fn: str, model: Model, params: Params, tokens, attention_mask, positions) -> tuple[CausalLM, jax.Array]:
    """Validated inputs through the decoder: the merged module and ``[B, S, E]`` hidden states."""
    tokens, mask, positions = _inputs(fn, model, tokens, attention_mask, positions)
    module = model.module(params)
    hidden, _ = module.hidden_states(tokens, positions, _causal(mask))
    return module, hidden


def hidden_states(
    model: Model,
    params: Params,
    tokens: jax.Array,
    *,
    attention_mask: jax.Array | None = None,
    positions: jax.Array | None = None,
) -> jax.Array:
    """Final-norm hidden states ``[B, S, E]`` of ``tokens`` ``[B, S]`` (no logits).

    Args:
      model, params: from :func:`init` or :func:`jaxrl_llm.models.from_pretrained`.
      tokens: ``[B, S]`` token ids in ``[0, V)``, left-padded, ``B, S >= 1``. Concrete
        ids outside raise ``ValueError``; under ``jit`` the embedding lookup clamps them.
      attention_mask: ``[B, S]``, bool or 0/1, true for real tokens; defaults to all ones.
        A concrete mask with other values raises; under ``jit`` it is read as ``!= 0``.
      positions: ``[B, S]`` RoPE positions; defaults to ``cumsum(mask) - 1`` so that each
        row's first real token is at position 0.
    """
    return _hidden("hidden_states", model, params, tokens, attention_mask, positions)[1]


def output_kernel(model: Model, params: Params, *, as_stored: bool = False) -> jax.Array:
    """The ``[E, V]`` output projection (the LM head, or the tied embedding transposed),
    for :func:`jaxrl_llm.ops.chunked_token_logprobs`. With ``as_stored``, the array as the
    params hold it: a tied embedding stays ``[V, E]`` (pass ``transposed_kernel=
    model.config.tie_word_embeddings`` with it), so no transposed copy is made."""
    if model.config.tie_word_embeddings:
        embedding = params["embed_tokens"][...]
        return embedding if as_stored else embedding.T
    return params["lm_head"][...]


def completion_hidden_states(
    model: Model,
    params: Params,
    tokens: jax.Array,
    attention_mask: jax.Array,
    completion_len: int,
    *,
    group_size: int = 1,
    dropout_key: jax.Array | None = None,
) -> jax.Array:
    r"""``[B, N, E]`` hidden states of the states before each of the last ``N`` tokens.

    Position ``j`` of a causal LM predicts token ``j + 1``, so these are the positions
    ``S - 1 ... S + N - 2``: the inputs of the completion's log-probs (and of a critic's
    values :math:`V(s_t)`).

    **Shared prompts.** With ``group_size = G > 1`` the rows come in groups of ``G``
    consecutive sequences with the same prompt (its first ``S`` tokens, where the mask is
    set, and the same mask), the layout of :class:`jaxrl_llm.sampling.Rollout`. Prompt
    positions attend only to the prompt, so their states are the same in every row of a
    group: the prompt then runs once per group (``B / G`` rows), and the completions
    attend to its keys and values, copied to the group's rows
    (:func:`group_completion_hidden_states`): there the completion part of
    ``attention_mask`` is not read, each completion attending to all its tokens before
    it, positions continuing its prompt's. So the numbers are those of ``G = 1`` up to
    float rounding, in both directions (the copies' gradients add up), at every
    completion token before the first masked one (a rollout's: its tokens up to its
    stop), for :math:`(1 - 1/G)\,S / (S + N)` fewer token positions. A row whose prompt
    differs from its group's first row gets NaN states: wrong loudly, never silently.

    Args:
      tokens: ``[B, S + N]`` prompt and completion ids; attention_mask: ``[B, S + N]``
        (checked as in :func:`hidden_states`).
      completion_len: ``N``, at most ``S + N - 1``.
      group_size: ``G``, consecutive rows that share a prompt; must divide ``B``.
      dropout_key: LoRA dropout for a training pass (:func:`group_completion_hidden_states`).
    """
    fn = "completion_hidden_states"
    _checks.positive_int(fn, "completion_len", completion_len)
    _checks.positive_int(fn, "group_size", group_size)
    tokens, mask, positions = _inputs(fn, model, tokens, attention_mask, None)
    batch, length = tokens.shape
    if not completion_len < length:
        raise ValueError(
            f"{fn}: `completion_len` ({completion_len}) must leave at least one prompt token in "
            f"sequences of length {length}."
        )
    if group_size == 1:
        module = model.module(params)
        hidden, _ = module.hidden_states(tokens, positions, _causal(mask), dropout_key=dropout_key)  # [B, S + N, E]
        return hidden[:, -completion_len - 1 : -1]
    if batch % group_size:
        raise ValueError(f"{fn}: `group_size` ({group_size}) must divide the batch ({batch} rows).")
    return _shared_prompt_hidden_states(
        model, params, tokens, mask, positions, completion_len, group_size, dropout_key=dropout_key
    )


def rows_share_group_prompt(
    tokens: jax.Array, attention_mask: jax.Array, completion_len: int, group_size: int
) -> jax.Array:
    """``[B]`` bool: the row's prompt (its first ``S`` tokens where the mask is set, and
    the mask) is that of the first row of its group of ``group_size`` consecutive rows.

    Args:
      tokens: ``[B, S + N]`` ids; attention_mask: ``[B, S + N]``; completion_len: ``N``.
    """
    prompt_len = tokens.shape[1] - completion_len
    tokens, mask = tokens[:, :prompt_len], attention_mask[:, :prompt_len].astype(bool)  # [B, S]
    first = functools.partial(jnp.repeat, repeats=group_size, axis=0)  # each group's first row, G times
    same_tokens = (tokens == first(tokens[::group_size])) | ~mask  # padding slots may hold anything
    return jnp.all((mask == first(mask[::group_size])) & same_tokens, axis=1)


def _shared_prompt_hidden_states(model, params, tokens, mask, positions, completion_len, group_size, *, dropout_key):
    """:func:`completion_hidden_states` with one prompt pass per group of ``G`` rows: each
    group's first prompt (its first row's, by striding) through
    :func:`group_completion_hidden_states`, NaN for rows whose prompt differs from it.

    ``tokens``, ``mask`` (bool): ``[B, S + N]``; returns ``[B, N, E]``."""
    del positions  # left padding: the grouped pass derives the same ones
    prompt_len = tokens.shape[1] - completion_len
    hidden = group_completion_hidden_states(
        model,
        params,
        tokens[::group_size, :prompt_len],
        mask[::group_size, :prompt_len],
        tokens[:, prompt_len:],
        dropout_key=dropout_key,
    )
    same_prompt = rows_share_group_prompt(tokens, mask, completion_len, group_size)  # [B]: the contract, checked
    return jnp.where(same_prompt[:, None, None], hidden, jnp.nan)


def group_completion_hidden_states(
    model: Model,
    params: Params,
    prompt_tokens: jax.Array,
    prompt_mask: jax.Array,
    completion_tokens: jax.Array,
    *,
    share_prompts: bool = True,
    dropout_key: jax.Array | None = None,
) -> jax.Array:
    r"""``[B, N, E]`` hidden states before each completion token, for ``P`` prompts carried
    once and their ``G = B / P`` completions each: row ``b`` continues prompt ``b // G``.

    The layout of a rollout batch (prompts ``[P, S]`` beside completions ``[B, N]``), so
    a batch split over devices keeps every group with its prompt. A completion token
    attends to its prompt's real tokens and to every completion token before it; tokens
    after a completion's stop are never read by a position before it, so they need no
    mask (their own states are meaningless; mask them). Positions continue the prompt's:
    completion token ``j`` of a prompt with ``s`` real tokens is at position ``s + j``.

    With ``share_prompts`` (and ``G > 1``) each prompt runs once into a KV cache of
    ``S + N - 1`` slots, copied to its ``G`` completions, which attend to it: the same
    numbers as running every row whole (``share_prompts=False``) up to float rounding, in
    both directions (the copies' gradients add up), for :math:`(1 - 1/G)\,S / (S + N)`
    fewer token positions.

    Args:
      prompt_tokens: ``[P, S]`` left-padded prompt ids; prompt_mask: ``[P, S]``, true for
        real tokens (each prompt at least one).
      completion_tokens: ``[B, N]`` ids, ``B`` a multiple of ``P``, ``N >= 1``.
      share_prompts: run each prompt once (above) or once per completion.
      dropout_key: LoRA dropout (``config.lora.dropout``) on the adapters' inputs, for a
        training pass (:meth:`~jaxrl_llm.models.decoder.CausalLM.hidden_states`); a shared
        prompt's mask is its group's. ``None``: none.
    """
    fn = "group_completion_hidden_states"
    prompt_tokens, prompt_mask, _ = _inputs(fn, model, prompt_tokens, prompt_mask, None)
    completion_tokens = _checks.integer(fn, "completion_tokens", completion_tokens)
    _checks.rank(fn, "completion_tokens", completion_tokens, 2, "[B, N]")
    _checks.nonempty(fn, "completion_tokens", completion_tokens, "at least one completion and one token")
    _checks.token_ids(fn, "completion_tokens", completion_tokens, model.config.vocab_size)
    (num_prompts, prompt_len), (batch, completion_len) = prompt_tokens.shape, completion_tokens.shape
    if batch % num_prompts:
        raise ValueError(
            f"{fn}: the {batch} completions must be a multiple of the {num_prompts} prompts (G per prompt, adjacent)."
        )
    if prompt_len + completion_len > model.config.max_position_embeddings:
        raise ValueError(
            f"{fn}: prompt and completion ({prompt_len} + {completion_len} tokens) exceed the model's "
            f"max_position_embeddings ({model.config.max_position_embeddings})."
        )
    group = batch // num_prompts
    copies = functools.partial(jnp.repeat, repeats=group, axis=0)  # [P, ...] -> [B, ...]
    if not share_prompts or group == 1:
        tokens = jnp.concatenate([copies(prompt_tokens), completion_tokens], axis=1)  # [B, S + N]
        mask = jnp.concatenate([copies(prompt_mask), jnp.ones(completion_tokens.shape, bool)], axis=1)
        return completion_hidden_states(model, params, tokens, mask, completion_len, dropout_key=dropout_key)
    prompt_key, completion_key = (None, None) if dropout_key is None else jax.random.split(dropout_key)
    inputs = completion_len - 1  # the last token is never an input
    slots = prompt_len + inputs
    module = model.module(params)
    prompt_positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0)  # [P, S]
    # The prompts, once each (P rows), into a cache of S + N - 1 slots. With
    # config.scan_layers both passes scan the layers, the cache (stacked) their xs and ys:
    # a carried cache's gradient would cost a whole-cache array per layer.
    prompt_hidden, cache = _prefill_hidden(
        model,
        module,
        prompt_tokens,
        prompt_mask,
        prompt_positions,
        slots,
        carry_cache=False,
        dropout_key=prompt_key,
    )  # [P, S, E]
    hidden = copies(prompt_hidden[:, -1:])  # [B, 1, E]: the state before the first completion token
    if inputs:
        # The completions (B rows) attend to their prompt's slots and causally to themselves.
        cache = cache.repeat_rows(group)  # the slot index stays S
        keys = jnp.concatenate([copies(prompt_mask), jnp.ones((batch, inputs), bool)], axis=1)  # [B, S + N - 1]
        query_slot = prompt_len + jnp.arange(inputs)[:, None]  # [N - 1, 1]
        attention = keys[:, None, :] & (jnp.arange(slots)[None, :] <= query_slot)[None]  # [B, N - 1, S + N - 1]
        positions = copies(jnp.sum(prompt_mask, axis=1))[:, None] + jnp.arange(inputs)[None, :]  # [B, N - 1]
        completion_hidden, _ = module.hidden_states(
            completion_tokens[:, :inputs],
            positions,
            attention,
            cache,
            carry_cache=False,
            dropout_key=completion_key,
        )
        hidden = jnp.concatenate([hidden, completion_hidden], axis=1)  # [B, N, E]
    return hidden


def completion_logprobs(
    model: Model,
    params: Params,
    tokens: jax.Array,
    attention_mask: jax.Array,
    completion_len: int,
    *,
    chunk_size: int = 256,
    temperature: float = 1.0,
    group_size: int = 1,
) -> jax.Array:
    """``[B, N]`` log softmax(logits / T) of the last ``completion_len`` tokens.

    The trainer's view of :attr:`jaxrl_llm.sampling.Rollout.logprobs`: hidden states,
    then :func:`jaxrl_llm.ops.chunked_token_logprobs`, so ``[B, T, V]`` logits never
    exist. Values at masked positions are meaningless; mask them.

    Args:
      tokens: ``[B, S + N]`` prompt and completion ids; attention_mask: ``[B, S + N]``
        (checked as in :func:`hidden_states`, by :func:`completion_hidden_states`, which
        names itself in the errors).
      completion_len: ``N``.
      group_size: ``G`` consecutive rows share a prompt, which then runs once (see
        :func:`completion_hidden_states`).
    """
    hidden = completion_hidden_states(
        model, params, tokens, attention_mask, completion_len, group_size=group_size
    )  # [B, N, E]
    return ops.chunked_token_logprobs(
        hidden,
        output_kernel(model, params, as_stored=True),
        tokens[:, -completion_len:],
        chunk_size=chunk_size,
        temperature=temperature,
        transposed_kernel=model.config.tie_word_embeddings,
    )


def logits_from_hidden(model: Model, params: Params, hidden: jax.Array) -> jax.Array:
    """``[..., E] -> [..., V]``: the output projection alone (for chunked log-probs)."""
    return model.module(params).logits(hidden)


def forward(
    model: Model,
    params: Params,
    tokens: jax.Array,
    *,
    attention_mask: jax.Array | None = None,
    positions: jax.Array | None = None,
) -> jax.Array:
    """Next-token logits ``[B, S, V]`` (float32) of ``tokens`` ``[B, S]``.

    Arguments as in :func:`hidden_states`. Padding positions get finite, meaningless
    logits: mask them downstream.
    """
    module, hidden = _hidden("forward", model, params, tokens, attention_mask, positions)
    return module.logits(hidden)


def init_cache(model: Model, batch: int, cache_size: int) -> KVCache:
    """An empty cache with ``cache_size`` slots per sequence: keys and values one
    ``[B, KVH, K, D]`` array per layer, or, with ``config.scan_layers``, one stacked
    ``[L, B, KVH, K, D]`` array each, which the layer scan updates in place."""
    c = model.config
    if cache_size > c.max_position_embeddings:
        raise ValueError(
            f"init_cache: cache_size {cache_size} exceeds the model's max_position_embeddings "
            f"({c.max_position_embeddings})."
        )
    shape = (batch, c.num_kv_heads, cache_size, c.head_dim)

    def empty():
        if c.scan_layers:
            return jnp.zeros((c.num_layers, *shape), c.dtype)  # [L, B, KVH, K, D]
        return tuple(jnp.zeros(shape, c.dtype) for _ in range(c.num_layers))

    return KVCache(
        keys=empty(),
        values=empty(),
        valid=jnp.zeros((batch, cache_size), bool),
        next_position=jnp.zeros((batch,), jnp.int32),
        index=jnp.zeros((), jnp.int32),
    )


def prefill(
    model: Model,
    params: Params,
    tokens: jax.Array,
    attention_mask: jax.Array | None = None,
    *,
    cache_size: int,
    last_logits_only: bool = False,
) -> tuple[jax.Array, KVCache]:
    """Runs the prompt and returns its logits ``[B, S, V]`` and a cache holding it, in
    :func:`init_cache`'s layout (stacked ``[L, ...]`` with ``config.scan_layers``).

    Args:
      tokens: ``[B, S]`` left-padded prompt ids, checked as in :func:`hidden_states`.
      attention_mask: ``[B, S]``, true for real tokens. Each row must be left-padded
        (padding, then the prompt): decoding continues after the last slot, so a
        right-padded prompt would be continued after its padding. A concrete mask with a
        real token after a pad raises ``ValueError``; under ``jit`` it is not checked.
      cache_size: slots to allocate: the prompt length plus the tokens to decode.
      last_logits_only: return only the last position's logits ``[B, V]``, the
        next-token distribution a sampler needs (``[B, S, V]`` logits of a long prompt
        and a large vocabulary take gigabytes).
    """
    fn = "prefill"
    tokens, mask, positions = _inputs(fn, model, tokens, attention_mask, None)
    if attention_mask is not None:
        _checks.left_padded(fn, "attention_mask", attention_mask)
    length = tokens.shape[1]
    if cache_size < length:
        raise ValueError(f"{fn}: `cache_size` ({cache_size}) must be >= the prompt length ({length}).")
    module = model.module(params)
    hidden, cache = _prefill_hidden(model, module, tokens, mask, positions, cache_size)
    return module.logits(hidden[:, -1] if last_logits_only else hidden), cache


def _prefill_hidden(
    model: Model,
    module: CausalLM,
    tokens,
    mask,
    positions,
    cache_size: int,
    *,
    carry_cache: bool = True,
    dropout_key=None,
):
    """Validated ``[B, S]`` prompt inputs through the decoder into a fresh cache of
    ``cache_size`` slots (:func:`init_cache`'s layout): ``[B, S, E]`` hidden states and the
    cache, its next slot ``S``. ``carry_cache``: see :meth:`CausalLM.hidden_states`."""
    batch, length = tokens.shape
    cache = init_cache(model, batch, cache_size)
    cache = cache._replace(valid=cache.valid.at[:, :length].set(mask))
    full_mask = jnp.zeros((batch, length, cache_size), bool).at[:, :, :length].set(_causal(mask))  # [B, S, K]
    hidden, cache = module.hidden_states(
        tokens,
        positions,
        full_mask,
        cache,
        carry_cache=carry_cache,
        dropout_key=dropout_key,
    )
    return hidden, cache._replace(
        next_position=jnp.sum(mask, axis=1).astype(jnp.int32), index=jnp.asarray(length, jnp.int32)
    )


def extend(
    model: Model,
    params: Params,
    tokens: jax.Array,
    mask: jax.Array,
    cache: KVCache,
    *,
    last_logits_only: bool = False,
) -> tuple[jax.Array, KVCache]:
    """Feeds ``E`` more tokens per sequence into ``cache`` and returns their logits and the cache.

    The multi-token :func:`decode_step`: a tool's result, a chat template's tokens between
    turns, or an episode's own opening appended to a conversation in the cache, computing
    only the new tokens, never the conversation again. The tokens go into slots
    ``cache.index ... cache.index + E - 1`` of every row; ``mask`` says which of them are
    real for each row (rows feed different numbers, some none), and only those become
    valid slots, each at its row's next RoPE position. So the cache afterwards holds, per
    row, exactly the tokens a from-scratch pass over the row's whole conversation would
    see, with gaps where other rows' tokens went: the next-token logits are that pass's,
    up to float rounding.

    Args:
      tokens: ``[B, E]`` ids in ``[0, V)`` (ids under ``mask = 0`` are not read by any real
        token; any id will do).
      mask: ``[B, E]``, bool or 0/1: the real tokens, in any pattern (typically each row's
        first ``n_b``).
      cache: from :func:`prefill`, :func:`decode_step` or a previous call, with ``E`` free
        slots. A call that overruns it returns NaN logits under ``jit`` (as
        :func:`decode_step`); concrete inputs are refused.
      last_logits_only: return ``[B, V]``, the logits at each row's last real token (the
        next-token distribution; arbitrary for a row with none), instead of ``[B, E, V]``.

    Sliding-window layers (``config.sliding_windows``) measure their window in cache slots,
    which equals the distance in positions only where a row's slots have no gaps: with
    gaps, keep the window at least the cache size.
    """
    fn = "extend"
    ids = _checks.integer(fn, "tokens", tokens)
    _checks.rank(fn, "tokens", ids, 2, "[B, E]")
    _checks.nonempty(fn, "tokens", ids, "at least one sequence and one token")
    _checks.token_ids(fn, "tokens", tokens, model.config.vocab_size)
    mask = _checks.mask(fn, mask, "tokens", ids, name="mask")
    tokens, width, slots = ids, ids.shape[1], cache.valid.shape[1]
    index = _checks.host_values(cache.index)
    if index is not None and int(index) + width > slots:
        raise ValueError(
            f"{fn}: {width} tokens do not fit the cache: {slots - int(index)} of its {slots} slots are free."
        )
    return _feed(model, params, tokens, mask, cache, last_logits_only=last_logits_only)


def _feed(model: Model, params: Params, tokens, mask, cache: KVCache, *, last_logits_only: bool):
    """:func:`extend` and :func:`decode_step` on checked inputs: ``[B, E]`` tokens into slots
    ``cache.index ...``, the real ones (``mask``) valid at their rows' next positions; NaN
    logits when they overrun the cache."""
    width, slots = tokens.shape[1], cache.valid.shape[1]
    valid = jax.lax.dynamic_update_slice(cache.valid, mask, (0, cache.index))  # [B, K]
    query_slot = cache.index + jnp.arange(width)  # [E]
    attention = valid[:, None, :] & (jnp.arange(slots)[None, None, :] <= query_slot[None, :, None])  # [B, E, K]
    positions = cache.next_position[:, None] + jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)  # [B, E]
    module = model.module(params)
    hidden, cache = module.hidden_states(tokens, positions, attention, cache._replace(valid=valid))
    overrun = cache.index + width > slots
    count = jnp.sum(mask, axis=1).astype(jnp.int32)  # [B]
    cache = cache._replace(next_position=cache.next_position + count, index=cache.index + width)
    if last_logits_only and width == 1:
        hidden = hidden[:, 0]
    elif last_logits_only:
        last = jnp.maximum(width - 1 - jnp.argmax(mask[:, ::-1], axis=1), 0)  # [B]: the last real token
        hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]  # [B, H]
    return jnp.where(overrun, jnp.nan, module.logits(hidden)), cache


def decode_step(model: Model, params: Params, tokens: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Feeds one token per sequence and returns next-token logits ``[B, V]`` and the cache.

    Args:
      tokens: ``[B]`` token ids in ``[0, V)``, written to slot ``cache.index`` at each row's
        next position. Concrete ids outside raise ``ValueError``; under ``jit`` the
        embedding lookup clamps them.
      cache: from :func:`prefill` or a previous step, with a free slot left; returned in
        its layout, updated in place when donated (or carried by a loop). Either layout
        runs with either ``config.scan_layers``; a per-layer one through scanned layers
        costs a copy. A step on a full cache cannot raise under ``jit``; it returns NaN
        logits instead (loudly wrong, never silently: a clamped write would overwrite the
        last slot).
    """
    ids = _checks.integer("decode_step", "tokens", tokens)
    _checks.rank("decode_step", "tokens", ids, 1, "[B]")
    _checks.token_ids("decode_step", "tokens", tokens, model.config.vocab_size)
    return _feed(model, params, ids[:, None], jnp.ones((ids.shape[0], 1), bool), cache, last_logits_only=True)
