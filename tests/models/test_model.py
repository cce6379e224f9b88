"""The decoder from a config: parameters, logical axes, dtypes, validation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm import models

SMALL = models.ModelConfig(
    architecture="qwen3",
    vocab_size=50,
    hidden_size=16,
    intermediate_size=24,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    qk_norm=True,
    max_position_embeddings=16,
)
AXIS_NAMES = {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "norm"}


def test_every_parameter_has_logical_axis_names_of_its_rank():
    model, params = models.init(SMALL, jax.random.key(0))
    specs = models.logical_axes(params)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    for (path, value), spec in zip(nnx.to_flat_state(params), spec_leaves, strict=True):
        assert len(spec) == value.get_value().ndim, path
        assert set(spec) <= AXIS_NAMES, (path, spec)


def test_parameter_count_matches_the_architecture():
    c = SMALL
    _, params = models.init(c, jax.random.key(0))
    attention = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads) + 2 * c.head_dim
    mlp = 3 * c.hidden_size * c.intermediate_size
    expected = c.vocab_size * c.hidden_size * 2 + c.num_layers * (attention + mlp + 2 * c.hidden_size) + c.hidden_size
    assert sum(x.size for x in jax.tree.leaves(params)) == expected


def test_abstract_params_use_no_memory_and_match_init():
    _, shapes = models.abstract(SMALL)
    _, params = models.init(SMALL, jax.random.key(0))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(shapes))
    assert jax.tree.map(lambda s: (s.shape, s.dtype), shapes) == jax.tree.map(lambda p: (p.shape, p.dtype), params)


def test_param_and_compute_dtypes_are_independent():
    config = dataclasses.replace(SMALL, param_dtype=jnp.bfloat16, dtype=jnp.float32)
    model, params = models.init(config, jax.random.key(0))
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    logits = models.forward(model, params, jnp.zeros((2, 3), jnp.int32))
    assert logits.dtype == jnp.float32 and logits.shape == (2, 3, 50)


def test_forward_is_pure_and_traces_once_per_shape():
    model, params = models.init(SMALL, jax.random.key(0))
    forward = jax.jit(lambda p, t: models.forward(model, p, t))
    tokens = jnp.ones((2, 5), jnp.int32)
    first = forward(params, tokens)
    np.testing.assert_array_equal(forward(params, tokens), first)
    forward(params, tokens + 1)
    assert forward._cache_size() == 1


def test_config_round_trips_through_transformers():
    for config in (
        SMALL,
        dataclasses.replace(
            SMALL,
            architecture="llama",
            qk_norm=False,
            tie_word_embeddings=True,
            rope=models.RopeConfig(theta=5e5, rope_type="llama3", factor=8.0, original_max_position_embeddings=8),
        ),
        dataclasses.replace(SMALL, architecture="qwen2", qk_norm=False, attention_bias=True),
        dataclasses.replace(SMALL, architecture="mistral", qk_norm=False, sliding_windows=(4, 4)),
    ):
        assert models.ModelConfig.from_hf(config.to_hf()) == config


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(num_heads=3), r"`num_heads` \(3\) must be a multiple of `num_kv_heads` \(2\)"),
        (dict(head_dim=5), "`head_dim` must be even"),
        (dict(architecture="gpt2"), "`architecture` must be one of 'llama', 'mistral', 'qwen2', 'qwen3'"),
        (dict(sliding_windows=(4,)), r"`sliding_windows` needs one entry per layer \(2\)"),
        (dict(dtype=jnp.int32), "`dtype` must be one of float32, bfloat16, float16"),
        (dict(architecture="qwen2", qk_norm=False), "qwen2 has biases on q/k/v"),
        (dict(qk_norm=False), "`qk_norm` .* is Qwen3's and only Qwen3's"),
    ],
)
def test_bad_configs_say_what_is_wrong(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(SMALL, **changes)


def test_unsupported_rope_type_lists_supported_ones():
    with pytest.raises(ValueError, match="`rope_type` must be one of 'default', 'llama3'; got 'yarn'"):
        models.RopeConfig(rope_type="yarn")


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(architecture="llama", qk_norm=False, sliding_windows=(4, 4)), "llama has no sliding-window"),
        (dict(architecture="mistral", qk_norm=False, sliding_windows=(4, None)), "mistral uses one window"),
        (dict(sliding_windows=(4, 8)), "qwen3 uses a single window size"),
        (dict(sliding_windows=(0, None)), "entries must be integers >= 1 or None"),
    ],
)
def test_windows_that_hugging_face_cannot_represent_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(SMALL, **changes)


def test_dtype_spellings_give_one_config():
    by_name = dataclasses.replace(SMALL, dtype="float32", param_dtype=np.dtype("float32"))
    assert by_name == SMALL and hash(by_name) == hash(SMALL)


def test_logits_are_float32_with_bfloat16_compute():
    model, params = models.init(
        dataclasses.replace(SMALL, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16), jax.random.key(0)
    )
    assert models.forward(model, params, jnp.zeros((1, 3), jnp.int32)).dtype == jnp.float32


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_logprobs_from_hidden_states_equal_the_forward_pass(tied):
    from jaxrl_llm import ops

    config = dataclasses.replace(SMALL, tie_word_embeddings=tied)
    model, params = models.init(config, jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 9), 0, config.vocab_size)
    hidden = models.hidden_states(model, params, tokens)
    chunked = ops.chunked_token_logprobs(hidden, models.output_kernel(model, params), tokens, chunk_size=4)
    full = ops.token_logprobs(models.forward(model, params, tokens), tokens)
    np.testing.assert_allclose(chunked, full, rtol=1e-5, atol=1e-6)


def test_dense_has_the_value_and_gradient_of_a_plain_matmul():
    from jaxrl_llm.models.decoder import dense

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 3, 5)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(5, 4)), jnp.float32)
    weights = jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)

    def loss(matmul):
        return lambda x, w: jnp.sum(weights * jnp.tanh(matmul(x, w)))

    np.testing.assert_allclose(dense(x, kernel), x @ kernel, rtol=1e-6)
    got = jax.grad(loss(dense), argnums=(0, 1))(x, kernel)
    expected = jax.grad(loss(jnp.matmul), argnums=(0, 1))(x, kernel)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    bf16 = jax.grad(loss(dense), argnums=(0, 1))(x.astype(jnp.bfloat16), kernel.astype(jnp.bfloat16))
    assert [g.dtype for g in bf16] == [jnp.bfloat16, jnp.bfloat16]


def test_swiglu_has_the_value_and_gradient_of_autodiffed_silu_times_up():
    from jaxrl_llm.models.decoder import swiglu

    rng = np.random.default_rng(2)
    gate, up = (jnp.asarray(rng.normal(scale=3.0, size=(3, 7)), jnp.float32) for _ in range(2))
    weights = jnp.asarray(rng.normal(size=(3, 7)), jnp.float32)
    plain = lambda g, u: jax.nn.silu(g) * u  # noqa: E731

    np.testing.assert_allclose(swiglu(gate, up), plain(gate, up), rtol=1e-6)
    loss = lambda f: lambda g, u: jnp.sum(weights * f(g, u))  # noqa: E731
    got = jax.grad(loss(swiglu), argnums=(0, 1))(gate, up)
    expected = jax.grad(loss(plain), argnums=(0, 1))(gate, up)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    # and by central differences in float64 (an independent check of the formula)
    g64, u64, w64 = (np.asarray(a, np.float64) for a in (gate, up, weights))
    f64 = lambda g, u: np.sum(w64 * g / (1 + np.exp(-g)) * u)  # noqa: E731
    eps = 1e-6
    numeric_gate = np.zeros_like(g64)
    for index in np.ndindex(g64.shape):
        step = np.zeros_like(g64)
        step[index] = eps
        numeric_gate[index] = (f64(g64 + step, u64) - f64(g64 - step, u64)) / (2 * eps)
    np.testing.assert_allclose(got[0], numeric_gate, rtol=1e-4, atol=1e-5)
    bf16 = jax.grad(loss(swiglu), argnums=(0, 1))(gate.astype(jnp.bfloat16), up.astype(jnp.bfloat16))
    assert [g.dtype for g in bf16] == [jnp.bfloat16, jnp.bfloat16]
    # forward over reverse, as TRPO's Fisher-vector products take it
    hessian_vector = lambda f: jax.jvp(jax.grad(loss(f)), (gate, up), (up, gate))[1]  # noqa: E731
    np.testing.assert_allclose(hessian_vector(swiglu), hessian_vector(plain), rtol=1e-5, atol=1e-5)


def test_attend_has_the_value_and_gradient_of_autodiffed_softmax_attention():
    from jaxrl_llm.models.decoder import attend

    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(2, 2, 3, 5, 8)), jnp.float32)  # [B, KVH, G, S, D]
    k, v = (jnp.asarray(rng.normal(size=(2, 2, 6, 8)), jnp.float32) for _ in range(2))  # [B, KVH, K, D]
    mask = jnp.asarray(rng.random((2, 5, 6)) < 0.7).at[0, 1].set(False)  # a query with no valid key
    weights = jnp.asarray(rng.normal(size=(2, 5, 2, 3, 8)), jnp.float32)

    def plain(q, k, v, mask):
        scores = jnp.einsum("bkgsd,bktd->bkgst", q, k) / np.sqrt(8).astype(np.float32)
        scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
        return jnp.einsum("bkgst,bktd->bskgd", jax.nn.softmax(scores, axis=-1), v)

    np.testing.assert_allclose(attend(q, k, v, mask), plain(q, k, v, mask), rtol=1e-5, atol=1e-6)
    loss = lambda f: lambda q, k, v: jnp.sum(weights * f(q, k, v, mask))  # noqa: E731
    got = jax.grad(loss(attend), argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(loss(plain), argnums=(0, 1, 2))(q, k, v)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)
    assert np.isfinite(np.asarray(got[0])).all()


def _model_calls(model, params):
    """Every public entry point that takes ``[B, S]`` token ids, by the name its errors give
    (``completion_logprobs`` checks through ``completion_hidden_states``)."""
    return {
        "forward": lambda t, m: models.forward(model, params, t, attention_mask=m),
        "hidden_states": lambda t, m: models.hidden_states(model, params, t, attention_mask=m),
        "prefill": lambda t, m: models.prefill(model, params, t, m, cache_size=t.shape[1] + 1),
        "completion_hidden_states": lambda t, m: models.completion_hidden_states(model, params, t, m, 1),
        "completion_hidden_states, logprobs": lambda t, m: models.completion_logprobs(model, params, t, m, 1),
        "completion_hidden_states, logprobs with shared prompts": lambda t, m: models.completion_logprobs(
            model, params, t, m, 1, group_size=2
        ),
    }


@pytest.mark.parametrize("name", list(_model_calls(None, None)))
@pytest.mark.parametrize("bad, listed", [(-1, r"\[-1\]"), (50, r"\[50\]"), (10**6, r"\[1000000\]")])
def test_out_of_range_ids_are_refused_when_concrete(name, bad, listed):
    model, params = models.init(SMALL, jax.random.key(0))
    tokens = np.ones((2, 4), np.int32)
    tokens[1, 1] = bad
    fn = name.split(",")[0]
    for given in (tokens, jnp.asarray(tokens)):
        with pytest.raises(
            ValueError,
            match=fn + r": `tokens` must hold token ids in \[0, 50\) \(the vocabulary\); "
            r"got " + listed,
        ):
            _model_calls(model, params)[name](given, np.ones((2, 4), bool))


def test_under_jit_out_of_range_ids_keep_the_gathers_clamping():
    """Traced ids cannot be checked: the embedding lookup clamps (as documented), so
    validate ids on the host before a jitted call."""
    model, params = models.init(SMALL, jax.random.key(0))
    forward = jax.jit(lambda p, t: models.forward(model, p, t))
    tokens = jnp.array([[3, 7, 50, 1000]])
    np.testing.assert_array_equal(forward(params, tokens), forward(params, jnp.array([[3, 7, 49, 49]])))


@pytest.mark.parametrize("name", list(_model_calls(None, None)))
@pytest.mark.parametrize("shape", [(0, 4), (2, 0)])
def test_empty_batches_are_refused(name, shape):
    model, params = models.init(SMALL, jax.random.key(0))
    with pytest.raises(
        ValueError,
        match=rf"{name.split(',')[0]}: `tokens` is empty, shape \[{shape[0]}, {shape[1]}\]"
        r": need at least one sequence and one token",
    ):
        _model_calls(model, params)[name](np.zeros(shape, np.int32), np.ones(shape, bool))


@pytest.mark.parametrize("name", list(_model_calls(None, None)))
@pytest.mark.parametrize("dtype, bad", [(np.float32, 2.0), (np.uint8, 255), (np.float32, -1.0)])
def test_attention_masks_other_than_0_1_are_refused(name, dtype, bad):
    model, params = models.init(SMALL, jax.random.key(0))
    mask = np.ones((2, 4), dtype)
    mask[0, 3] = bad
    with pytest.raises(ValueError, match=r"`attention_mask` must be boolean or 0/1; got values"):
        _model_calls(model, params)[name](np.ones((2, 4), np.int32), mask)


def test_completion_len_must_leave_a_prompt_token():
    model, params = models.init(SMALL, jax.random.key(0))
    with pytest.raises(ValueError, match=r"`completion_len` \(4\) must leave at least one prompt token"):
        models.completion_hidden_states(model, params, jnp.ones((2, 4), jnp.int32), jnp.ones((2, 4), bool), 4)
