"""jaxrl_llm.ops against NumPy references: log-probs, entropy, aggregation, whitening."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm import kl, ops
from tests import reference

MODES = ops.AGGREGATION_MODES


def _random_mask(rng, batch, length, *, empty_rows=()):
    """Right-padded completions of random lengths, some rows possibly empty."""
    lengths = rng.integers(1, length + 1, size=batch)
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.float32)
    mask[list(empty_rows)] = 0.0
    return mask


def test_token_logprobs_matches_numpy_log_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 11)).astype(np.float32) * 4
    tokens = rng.integers(0, 11, size=(3, 5))
    expected = np.take_along_axis(reference.log_softmax(logits), tokens[..., None], -1)[..., 0]
    got = jax.jit(ops.token_logprobs)(logits, tokens)
    assert got.dtype == jnp.float32 and got.shape == (3, 5)
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_token_logprobs_upcasts_bfloat16_logits():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(2, 3, 7)), jnp.bfloat16)
    tokens = jnp.asarray(rng.integers(0, 7, size=(2, 3)))
    got = ops.token_logprobs(logits, tokens)
    expected = np.take_along_axis(
        reference.log_softmax(np.asarray(logits, np.float64)), np.asarray(tokens)[..., None], -1
    )[..., 0]
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_token_logprobs_gradient_is_onehot_minus_softmax():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(2, 3, 5)).astype(np.float32)
    tokens = rng.integers(0, 5, size=(2, 3))
    grad = jax.grad(lambda z: jnp.sum(ops.token_logprobs(z, tokens)))(logits)
    expected = np.eye(5)[tokens] - np.exp(reference.log_softmax(logits))
    np.testing.assert_allclose(grad, expected, atol=1e-6)


def test_entropy_matches_numpy_and_handles_masked_vocabulary():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(2, 4, 9)).astype(np.float32) * 3
    logits[0, 0, :5] = -np.inf  # a top-k style masked vocabulary
    logp = reference.log_softmax(np.where(np.isinf(logits), -1e30, logits))
    expected = -np.sum(np.where(np.isinf(logits), 0.0, np.exp(logp) * logp), axis=-1)
    got = jax.jit(ops.entropy)(logits)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    grad = jax.grad(lambda z: jnp.sum(ops.entropy(z)))(jnp.asarray(logits))
    assert np.all(np.isfinite(grad))
    uniform = ops.entropy(jnp.zeros((1, 1, 9)))
    np.testing.assert_allclose(uniform, np.log(9.0), rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_matches_python_loop(mode):
    rng = np.random.default_rng(4)
    values = rng.normal(size=(6, 7)).astype(np.float32)
    mask = _random_mask(rng, 6, 7, empty_rows=[2])
    for max_len in (None, 12):
        got = jax.jit(lambda v, m, max_len=max_len: ops.aggregate(v, m, mode=mode, max_len=max_len))(values, mask)
        np.testing.assert_allclose(got, reference.aggregate(values, mask, mode, max_len), rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_accepts_boolean_masks(mode):
    rng = np.random.default_rng(5)
    values = rng.normal(size=(3, 4)).astype(np.float32)
    mask = _random_mask(rng, 3, 4)
    np.testing.assert_allclose(
        ops.aggregate(values, mask.astype(bool), mode=mode), ops.aggregate(values, mask, mode=mode), rtol=1e-6
    )


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_of_empty_mask_is_zero_with_zero_gradient(mode):
    values = jnp.ones((3, 4))
    loss, grad = jax.value_and_grad(lambda v: ops.aggregate(v, jnp.zeros((3, 4)), mode=mode))(values)
    assert float(loss) == 0.0
    np.testing.assert_array_equal(grad, np.zeros((3, 4)))


@settings(max_examples=20)  # each example's shapes compile afresh
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 5),
    length=st.integers(1, 6),
    padding_rows=st.integers(1, 3),
    mode=st.sampled_from(MODES),
)
def test_padding_rows_never_change_the_aggregate(seed, batch, length, padding_rows, mode):
    """A fully masked row is padding: adding one changes neither loss nor other rows' gradients."""
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(batch, length)).astype(np.float32)
    mask = _random_mask(rng, batch, length)
    padded_values = np.concatenate([values, rng.normal(size=(padding_rows, length)).astype(np.float32) * 1e3])
    padded_mask = np.concatenate([mask, np.zeros((padding_rows, length), np.float32)])
    f = lambda v, m: ops.aggregate(v, m, mode=mode, max_len=length)  # noqa: E731
    loss, grad = jax.value_and_grad(f)(values, mask)
    padded_loss, padded_grad = jax.value_and_grad(f)(padded_values, padded_mask)
    np.testing.assert_allclose(padded_loss, loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(padded_grad[:batch], grad, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(padded_grad[batch:], 0.0)


def test_masked_min_max_mean():
    values = jnp.array([[1.0, -2.0, 5.0], [7.0, 0.5, 9.0]])
    mask = jnp.array([[1, 1, 0], [0, 1, 0]])
    assert float(ops.masked_min(values, mask)) == -2.0
    assert float(ops.masked_max(values, mask)) == 1.0
    np.testing.assert_allclose(ops.masked_mean(values, mask), (1.0 - 2.0 + 0.5) / 3)
    assert float(ops.masked_max(values, jnp.zeros((2, 3)))) == 0.0


def test_whiten_gives_zero_mean_unit_variance_on_valid_entries():
    rng = np.random.default_rng(6)
    values = rng.normal(3.0, 2.0, size=(4, 6)).astype(np.float32)
    mask = _random_mask(rng, 4, 6)
    out = np.asarray(ops.whiten(values, mask))
    valid = out[mask > 0]
    np.testing.assert_allclose(valid.mean(), 0.0, atol=1e-5)
    np.testing.assert_allclose(valid.std(), 1.0, atol=1e-4)
    assert np.all(out[mask == 0] == 0)
    np.testing.assert_allclose(ops.whiten(jnp.full((5,), 2.0)), np.zeros(5))


def test_shape_and_dtype_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"`tokens` must have shape \[B, T\] = \[2, 3\].*got \[2, 4\]"):
        ops.token_logprobs(jnp.zeros((2, 3, 5)), jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(TypeError, match="`tokens` must be an integer array"):
        ops.token_logprobs(jnp.zeros((2, 3, 5)), jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"`logits` must have shape \[B, T, V\]"):
        ops.entropy(jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"`mask` must have the shape of `values`, \[2, 3\]; got \[3, 2\]"):
        ops.aggregate(jnp.zeros((2, 3)), jnp.ones((3, 2)), mode="token-mean")
    with pytest.raises(ValueError, match="`mode` must be one of 'token-mean', 'seq-mean-token-mean'"):
        ops.aggregate(jnp.zeros((2, 3)), jnp.ones((2, 3)), mode="mean")
    with pytest.raises(ValueError, match="`max_len` must be an integer >= 1"):
        ops.aggregate(jnp.zeros((2, 3)), jnp.ones((2, 3)), mode="seq-mean-token-sum-norm", max_len=0)


@pytest.mark.parametrize(
    "ddof, eps_placement, eps",
    [
        (0, "std", 1e-8),
        (1, "std", 1e-4),
        (1, "variance", 1e-8),
        (0, "variance", 0.5),
        (0, "variance_floor", 1e-8),
        (0, "variance_floor", 50.0),
    ],
)
def test_whiten_conventions_match_a_loop_over_the_valid_entries(ddof, eps_placement, eps):
    """Population or sample variance; eps on the std, on the variance (verl) or a floor
    under it (OpenRLHF: 50 is above this batch's variance, so the floor binds)."""
    rng = np.random.default_rng(16)
    values = rng.normal(3.0, 2.0, size=(4, 6)).astype(np.float32)
    mask = _random_mask(rng, 4, 6)
    out = jax.jit(lambda v, m: ops.whiten(v, m, eps=eps, ddof=ddof, eps_placement=eps_placement))(values, mask)
    expected = reference.whiten(values, mask, eps=eps, ddof=ddof, eps_placement=eps_placement)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    # No more valid entries than ddof: the variance is 0, and the one entry whitens to 0.
    single = np.zeros((4, 6))
    single[1, 2] = 1
    np.testing.assert_array_equal(ops.whiten(values, single, ddof=1), 0.0)
    with pytest.raises(ValueError, match=r"whiten: `ddof` must be an integer >= 0"):
        ops.whiten(values, mask, ddof=-1)
    with pytest.raises(ValueError, match=r"whiten: `eps_placement` must be one of 'std', 'variance', 'variance_floor'"):
        ops.whiten(values, mask, eps_placement="sqrt")


@given(st.floats(-1e3, 1e3, width=32), st.integers(1, 9))
def test_whiten_maps_equal_values_to_exact_zero(value, size):
    np.testing.assert_array_equal(ops.whiten(jnp.full((size,), value)), np.zeros(size))


def test_whiten_ignores_nan_padding_and_eps_zero_constant_input():
    values = jnp.array([[1.0, 3.0, jnp.nan], [5.0, jnp.inf, -jnp.inf]])
    mask = jnp.array([[1, 1, 0], [1, 0, 0]])
    out = np.asarray(ops.whiten(values, mask))
    expected = (np.array([1.0, 3.0, 5.0]) - 3.0) / np.std([1.0, 3.0, 5.0])
    np.testing.assert_allclose(out[mask > 0], expected, rtol=1e-5)
    np.testing.assert_array_equal(out[mask == 0], 0.0)
    np.testing.assert_array_equal(ops.whiten(jnp.full((4,), 3.0), eps=0.0), 0.0)


# 3 rows: chunks of 1, 5 (T = 13 padded to 15) and all 13 positions.
@pytest.mark.parametrize(
    "chunk_size, temperature, transposed", [(4, 1.0, False), (15, 0.7, False), (64, 1.3, False), (15, 0.7, True)]
)
def test_chunked_logprobs_equal_full_logits_in_value_and_gradient(chunk_size, temperature, transposed):
    """Also with the kernel given as ``[V, E]`` (a tied embedding as stored)."""
    rng = np.random.default_rng(8)
    hidden = rng.normal(size=(3, 13, 8)).astype(np.float32)
    kernel = rng.normal(size=(8, 17)).astype(np.float32)
    tokens = rng.integers(0, 17, size=(3, 13))
    weights = rng.normal(size=(3, 13)).astype(np.float32)

    def full(h, w):
        logits = (h @ w) / temperature
        return ops.token_logprobs(logits, tokens), ops.entropy(logits)

    def chunked(h, w):
        return ops.chunked_token_logprobs(
            h,
            w.T if transposed else w,
            tokens,
            chunk_size=chunk_size,
            temperature=temperature,
            with_entropy=True,
            transposed_kernel=transposed,
        )

    for got, expected in zip(jax.jit(chunked)(hidden, kernel), full(hidden, kernel), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)

    def loss(f):
        return lambda h, w: jnp.sum(weights * f(h, w)[0]) + jnp.sum(f(h, w)[1])

    got = jax.grad(loss(chunked), argnums=(0, 1))(hidden, kernel)
    expected = jax.grad(loss(full), argnums=(0, 1))(hidden, kernel)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)


def test_chunked_logprobs_never_hold_full_float32_logits_in_the_backward_pass():
    batch, length, width, vocab = 2, 512, 32, 4096
    hidden = jnp.ones((batch, length, width), jnp.bfloat16)
    kernel = jnp.ones((width, vocab), jnp.bfloat16)
    tokens = jnp.zeros((batch, length), jnp.int32)
    full_logits_bytes = batch * length * vocab * 4

    def temp_bytes(loss):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(hidden, kernel).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    chunked = temp_bytes(lambda h, w: jnp.sum(ops.chunked_token_logprobs(h, w, tokens, chunk_size=64)))
    unchunked = temp_bytes(lambda h, w: jnp.sum(ops.token_logprobs(h @ w, tokens)))
    chunk_logits_bytes = 64 * vocab * 4  # 64 tokens over both rows
    assert unchunked >= full_logits_bytes  # the reference does materialise them
    # A few chunk-sized buffers (logits, softmax, their cotangents), whatever T is.
    assert chunked <= 4 * chunk_logits_bytes < full_logits_bytes


@pytest.mark.parametrize("transposed", [False, True])
def test_chunked_logprobs_backward_in_bfloat16_matches_the_rounded_cotangent_and_copies_no_kernel(transposed):
    """In bfloat16 the logits' float32 cotangent ``g`` is rounded to bfloat16 and meets the
    kernel there: ``dh = g W^T`` and ``dW = h^T g``, against a float64 NumPy reference of
    that convention. A frozen kernel's backward makes no float32 copy of it."""
    rng = np.random.default_rng(3)
    batch, length, width, vocab, temperature = 2, 6, 16, 40, 0.8
    hidden = jnp.asarray(rng.normal(size=(batch, length, width)), jnp.bfloat16)
    kernel = jnp.asarray(rng.normal(size=(width, vocab)) / 4, jnp.bfloat16)
    tokens = rng.integers(0, vocab, size=(batch, length))
    weights = rng.normal(size=(batch, length)).astype(np.float32)

    def loss(h, w):
        logp = ops.chunked_token_logprobs(
            h, w.T if transposed else w, tokens, chunk_size=4, temperature=temperature, transposed_kernel=transposed
        )
        return jnp.sum(weights * logp)

    d_hidden, d_kernel = jax.grad(loss, argnums=(0, 1))(hidden, kernel)

    h, w = np.asarray(hidden, np.float64), np.asarray(kernel, np.float64)
    logits = h @ w / temperature  # [B, T, V]
    softmax = np.exp(logits - logits.max(-1, keepdims=True))
    softmax /= softmax.sum(-1, keepdims=True)
    onehot = np.eye(vocab)[tokens]
    g = weights[..., None] * (onehot - softmax) / temperature  # d loss / d (h @ w)
    g = np.asarray(jnp.asarray(g, jnp.bfloat16), np.float64)  # rounded, as the backward pass does
    assert d_hidden.dtype == d_kernel.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(d_hidden, np.float64), g @ w.T, rtol=1e-2, atol=1e-3)
    np.testing.assert_allclose(np.asarray(d_kernel, np.float64), np.einsum("bte,btv->ev", h, g), rtol=1e-2, atol=1e-3)

    width, vocab = 256, 32768  # a float32 copy of this kernel: 33.6 MB; a chunk's logits: 2.1 MB
    hidden, kernel = jnp.ones((2, 64, width), jnp.bfloat16), jnp.ones((width, vocab), jnp.bfloat16)
    frozen = jax.grad(lambda h, w: jnp.sum(ops.chunked_token_logprobs(h, w, jnp.zeros((2, 64), jnp.int32),
                                                                      chunk_size=16)))  # fmt: skip
    compiled = jax.jit(frozen).lower(hidden, kernel).compile()
    assert f"f32[{width},{vocab}]" not in compiled.as_text()
    assert compiled.memory_analysis().temp_size_in_bytes < width * vocab * 4


def test_chunked_logprobs_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"`output_kernel` must have shape \[E, V\] with E = 8"):
        ops.chunked_token_logprobs(jnp.zeros((1, 2, 8)), jnp.zeros((4, 5)), jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match=r"`output_kernel` must have shape \[V, E\] with E = 8"):
        ops.chunked_token_logprobs(
            jnp.zeros((1, 2, 8)), jnp.zeros((8, 5)), jnp.zeros((1, 2), jnp.int32), transposed_kernel=True
        )
    with pytest.raises(ValueError, match=r"`tokens` must hold token ids in \[0, 5\)"):
        ops.chunked_token_logprobs(
            jnp.zeros((1, 2, 8)), jnp.zeros((5, 8)), jnp.full((1, 2), 6, jnp.int32), transposed_kernel=True
        )
    with pytest.raises(ValueError, match=r"`chunk_size` must be an integer >= 1"):
        ops.chunked_token_logprobs(jnp.zeros((1, 2, 8)), jnp.zeros((8, 5)), jnp.zeros((1, 2), jnp.int32), chunk_size=0)


@pytest.mark.parametrize("chunk_size, temperature", [(4, 1.0), (64, 0.7)])
def test_chunked_categorical_kl_equals_the_float64_sum_over_the_vocabulary(chunk_size, temperature):
    rng = np.random.default_rng(9)
    hidden_p, hidden_q = rng.normal(size=(3, 11, 8)), rng.normal(size=(3, 11, 6))
    kernel_p, kernel_q = rng.normal(size=(8, 13)), rng.normal(size=(6, 13))
    log_p = reference.log_softmax(hidden_p @ kernel_p / temperature)
    log_q = reference.log_softmax(hidden_q @ kernel_q / temperature)
    expected = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)  # [B, T], float64
    f32 = [jnp.asarray(x, jnp.float32) for x in (hidden_p, kernel_p, hidden_q, kernel_q)]
    got = jax.jit(lambda *a: ops.chunked_categorical_kl(*a, chunk_size=chunk_size, temperature=temperature))(*f32)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ops.chunked_categorical_kl(f32[0], f32[1], f32[0], f32[1]), 0.0, atol=1e-5)


def test_chunked_categorical_kl_gradient_equals_the_unchunked_one():
    rng = np.random.default_rng(10)
    hidden_p, hidden_q = (jnp.asarray(rng.normal(size=(2, 9, 8)), jnp.float32) for _ in range(2))
    kernel_p, kernel_q = (jnp.asarray(rng.normal(size=(8, 7)), jnp.float32) for _ in range(2))
    weights = jnp.asarray(rng.normal(size=(2, 9)), jnp.float32)

    def chunked(hq, wq):
        return jnp.sum(weights * ops.chunked_categorical_kl(hidden_p, kernel_p, hq, wq, chunk_size=4))

    def chunked_transposed(hq, wq):  # both kernels given [V, E]
        return jnp.sum(
            weights * ops.chunked_categorical_kl(hidden_p, kernel_p.T, hq, wq.T, chunk_size=4, transposed_kernels=True)
        )

    def full(hq, wq):
        return jnp.sum(weights * kl.categorical(hidden_p @ kernel_p, hq @ wq))

    expected = jax.grad(full, (0, 1))(hidden_q, kernel_q)
    for loss in (chunked, chunked_transposed):
        for g, e in zip(jax.grad(loss, (0, 1))(hidden_q, kernel_q), expected, strict=True):
            np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)


def test_chunked_categorical_kl_refuses_mismatched_models():
    with pytest.raises(ValueError, match=r"same \[B, T\] and vocabulary"):
        ops.chunked_categorical_kl(jnp.zeros((1, 2, 4)), jnp.zeros((4, 5)), jnp.zeros((1, 2, 4)), jnp.zeros((4, 6)))
    with pytest.raises(ValueError, match=r"`output_kernel_q` must have shape \[E, V\] with E = 3"):
        ops.chunked_categorical_kl(jnp.zeros((1, 2, 4)), jnp.zeros((4, 5)), jnp.zeros((1, 2, 3)), jnp.zeros((4, 5)))


# Masks select tokens, they never weight them: bool, or numbers that are all 0 or 1.
BAD_MASK_VALUES = [
    (np.float32, 2.0, r"\[2.0\]"),
    (np.float32, 0.5, r"\[0.5\]"),
    (np.float32, -1.0, r"\[-1.0\]"),
    (np.uint8, 255, r"\[255\]"),
    (np.int32, -1, r"\[-1\]"),
    (np.float32, np.nan, r"\[nan\]"),
]
MASKED_OPS = {
    **{mode: lambda v, m, mode=mode: ops.aggregate(v, m, mode=mode) for mode in MODES},
    "masked_mean": ops.masked_mean,
    "masked_min": ops.masked_min,
    "masked_max": ops.masked_max,
    "whiten": ops.whiten,
}


@pytest.mark.parametrize("name", sorted(MASKED_OPS))
@pytest.mark.parametrize("dtype, bad, listed", BAD_MASK_VALUES)
def test_masks_other_than_0_1_are_refused_when_concrete(name, dtype, bad, listed):
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    mask = np.array([[1, 0, 1], [1, 1, 0]], dtype)
    mask[1, 1] = bad
    for concrete in (mask, jnp.asarray(mask)):  # NumPy, or an eager jax.Array
        with pytest.raises(ValueError, match=r"`mask` must be boolean or 0/1; got values " + listed):
            MASKED_OPS[name](values, concrete)
    with pytest.raises(ValueError, match=r"got values \[-1.0, 2.0\]"):
        MASKED_OPS[name](values, np.array([[2.0, -1.0, 1.0], [2.0, 0.0, 1.0]], np.float32))


@pytest.mark.parametrize("name", sorted(MASKED_OPS))
@pytest.mark.parametrize("dtype, one", [(np.float32, 2.0), (np.uint8, 255), (np.int32, 7), (np.float32, -1.0)])
def test_a_traced_numeric_mask_selects_like_the_bool_mask(name, dtype, one):
    """Under jit the values cannot be checked: nonzero is valid, and a 2, a 255 or a -1
    weighs what a 1 weighs."""
    rng = np.random.default_rng(11)
    values = rng.normal(size=(4, 5)).astype(np.float32)
    valid = _random_mask(rng, 4, 5).astype(bool)
    numeric = np.where(valid & (rng.random((4, 5)) < 0.5), one, valid).astype(dtype)  # mixes 1 and `one`
    assert (numeric == one).any()
    jitted = jax.jit(MASKED_OPS[name])
    np.testing.assert_allclose(jitted(values, numeric), jitted(values, valid), rtol=1e-6)
    np.testing.assert_allclose(jitted(values, numeric), MASKED_OPS[name](values, valid), rtol=1e-6)


def test_a_negative_mask_entry_cannot_put_the_mean_above_the_max():
    values = jnp.array([[1.0, 2.0, 3.0]])
    mask = jnp.array([[1.0, -1.0, 1.0]])
    with pytest.raises(ValueError, match=r"got values \[-1.0\]"):
        ops.masked_mean(values, mask)
    mean, largest = jax.jit(lambda v, m: (ops.masked_mean(v, m), ops.masked_max(v, m)))(values, mask)
    assert float(mean) == 2.0 and float(largest) == 3.0  # -1 is read as valid, not as a weight of -1


EMPTY_OPS = {
    **{f"aggregate {mode}": lambda v, m, mode=mode: ops.aggregate(v, m, mode=mode) for mode in MODES},
    "masked_mean": ops.masked_mean,
    "masked_min": ops.masked_min,
    "masked_max": ops.masked_max,
    "whiten": ops.whiten,
    "whiten without mask": lambda v, m: ops.whiten(v),
}


@pytest.mark.parametrize("name", sorted(EMPTY_OPS))
@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
def test_empty_values_are_refused_with_a_clear_error(name, shape):
    need = "at least one value" if name.startswith("whiten") else "at least one sequence and one token"
    message = rf"`values` is empty, shape \[{shape[0]}, {shape[1]}\]: need {need}"
    with pytest.raises(ValueError, match=message):
        EMPTY_OPS[name](jnp.zeros(shape), jnp.ones(shape, bool))


@pytest.mark.parametrize("shape", [(0, 5), (3, 0)])
def test_chunked_ops_refuse_empty_batches(shape):
    hidden, kernel, tokens = jnp.zeros((*shape, 4)), jnp.zeros((4, 7)), jnp.zeros(shape, jnp.int32)
    empty = rf"is empty, shape \[{shape[0]}, {shape[1]}, 4\]: need at least one sequence and one token"
    with pytest.raises(ValueError, match="chunked_token_logprobs: `hidden` " + empty):
        ops.chunked_token_logprobs(hidden, kernel, tokens)
    with pytest.raises(ValueError, match="chunked_categorical_kl: `hidden_p` " + empty):
        ops.chunked_categorical_kl(hidden, kernel, hidden, kernel)


def test_an_empty_vocabulary_is_refused():
    need = "need a vocabulary of at least one token"
    with pytest.raises(ValueError, match=r"token_logprobs: `logits` is empty, shape \[2, 3, 0\]: " + need):
        ops.token_logprobs(jnp.zeros((2, 3, 0)), jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match=r"entropy: `logits` is empty, shape \[2, 3, 0\]: " + need):
        ops.entropy(jnp.zeros((2, 3, 0)))
    with pytest.raises(ValueError, match=r"`output_kernel` is empty, shape \[4, 0\]: " + need):
        ops.chunked_token_logprobs(jnp.zeros((2, 3, 4)), jnp.zeros((4, 0)), jnp.zeros((2, 3), jnp.int32))


@pytest.mark.parametrize("bad, listed", [(-1, r"\[-1\]"), (11, r"\[11\]"), (300, r"\[300\]")])
def test_out_of_range_token_ids_are_refused_when_concrete(bad, listed):
    rng = np.random.default_rng(12)
    logits = rng.normal(size=(2, 3, 11)).astype(np.float32)
    tokens = rng.integers(0, 11, size=(2, 3))
    tokens[1, 2] = bad
    message = r"`tokens` must hold token ids in \[0, 11\) \(the vocabulary\); got " + listed
    for concrete in (tokens, jnp.asarray(tokens)):
        with pytest.raises(ValueError, match="token_logprobs: " + message):
            ops.token_logprobs(logits, concrete)
        with pytest.raises(ValueError, match="chunked_token_logprobs: " + message):
            ops.chunked_token_logprobs(np.zeros((2, 3, 4), np.float32), np.ones((4, 11), np.float32), concrete)


@pytest.mark.parametrize("bad", [-1, 11, 300])
def test_a_traced_out_of_range_id_has_a_nan_logprob_that_masking_removes(bad):
    """Under jit, no plausible number: -1 no longer wraps to V - 1 (nor 11 to anything),
    and the masked NaN reaches neither the aggregate nor its gradient."""
    rng = np.random.default_rng(13)
    logits = jnp.asarray(rng.normal(size=(2, 3, 11)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 11, size=(2, 3))).at[1, 2].set(bad)
    mask = jnp.ones((2, 3), bool).at[1, 2].set(False)
    logp = jax.jit(ops.token_logprobs)(logits, tokens)
    assert np.isnan(logp[1, 2]) and np.isfinite(np.asarray(logp)[mask]).all()
    in_range = ops.token_logprobs(logits, jnp.where(mask, tokens, 0))
    np.testing.assert_allclose(np.asarray(logp)[mask], np.asarray(in_range)[mask])
    hidden = jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(4, 11)), jnp.float32)
    chunked = jax.jit(lambda h, w, t: ops.chunked_token_logprobs(h, w, t, chunk_size=2))(hidden, kernel, tokens)
    assert np.isnan(chunked[1, 2]) and np.isfinite(np.asarray(chunked)[mask]).all()

    def loss(z, t):  # ids passed in, so traced (closed-over concrete ids are checked at trace time)
        return ops.aggregate(ops.token_logprobs(z, t), mask, mode="token-mean")

    value, grad = jax.jit(jax.value_and_grad(loss))(logits, tokens)
    assert np.isfinite(value) and np.isfinite(grad).all()
    np.testing.assert_array_equal(grad[1, 2], 0.0)
