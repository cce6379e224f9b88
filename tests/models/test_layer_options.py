"""The layers' layout and the decoder's execution options against the reference: the
per-layer params run by a Python loop, with the CPU-tuned ``attend`` and no remat. The
stacked layout (``scan_layers``: one ``[L, ...]`` leaf per weight kind, one
``jax.lax.scan``) is compared on the same weights, converted by ``with_scan_layers``; its
gradients are stacked and compared layer by layer (``decoder.unstack_layers``).

Tolerances (float32): hidden states and log-probs within 2e-5 absolute (they are O(1));
each gradient leaf within 2e-5 of its own largest entry, the same bound as the
shared-prompt tests. Both sides compute the same function; only the order of float
operations differs.
"""

import dataclasses
import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm import models
from jaxrl_llm.models import decoder

ATOL, GRAD_RTOL = 2e-5, 2e-5
BATCH, PROMPT_LEN, COMPLETION_LEN, GROUP = 4, 6, 5, 2

_SMALL = dict(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=32,
)
CONFIGS = {
    "llama": models.ModelConfig(**_SMALL),
    "qwen2-biases": models.ModelConfig(**_SMALL, architecture="qwen2", attention_bias=True),
    "qwen3-qk-norm-tied": models.ModelConfig(
        **{**_SMALL, "num_kv_heads": 1}, architecture="qwen3", qk_norm=True, tie_word_embeddings=True
    ),
    "mistral-window-3": models.ModelConfig(**_SMALL, architecture="mistral", sliding_windows=(3, 3, 3)),
    # Qwen2's layout: full attention in the first layers, windows after; and one with the two interleaved.
    "qwen2-full-then-window": models.ModelConfig(
        **_SMALL, architecture="qwen2", attention_bias=True, sliding_windows=(None, 3, 3)
    ),
    "qwen2-window-full-window": models.ModelConfig(
        **_SMALL, architecture="qwen2", attention_bias=True, sliding_windows=(2, None, 2)
    ),
}


def perturbed_init(config: models.ModelConfig, seed: int = 0):
    """``models.init`` with noise on every parameter, so that biases (zero at init) and
    norm scales (one at init) take part in the comparisons."""
    model, params = models.init(config, jax.random.key(seed))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    noisy = [leaf + 0.05 * jax.random.normal(key, leaf.shape, leaf.dtype) for leaf, key in zip(leaves, keys)]
    return model, jax.tree.unflatten(treedef, noisy)


def rollout_batch(vocab: int, *, group_size: int = 1, seed: int = 0):
    """``[B, S + N]`` ids and mask, prompts left-padded by 0, 2, 3, 1 tokens; with
    ``group_size`` > 1 consecutive rows share a prompt. And ``[B, N]`` loss weights."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, vocab, size=(BATCH, PROMPT_LEN))
    prompt_mask = np.arange(PROMPT_LEN)[None, :] >= np.array([0, 2, 3, 1])[:, None]  # [B, S]
    if group_size > 1:
        prompts = np.repeat(prompts[::group_size], group_size, axis=0)
        prompt_mask = np.repeat(prompt_mask[::group_size], group_size, axis=0)
    prompts[~prompt_mask] = 0
    tokens = np.concatenate([prompts, rng.integers(0, vocab, size=(BATCH, COMPLETION_LEN))], axis=1)
    mask = np.concatenate([prompt_mask, np.ones((BATCH, COMPLETION_LEN), bool)], axis=1)
    weights = rng.normal(size=(BATCH, COMPLETION_LEN)).astype(np.float32)
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(mask), jnp.asarray(weights)


@functools.partial(jax.jit, static_argnames=("model",))
def hidden(model, params, tokens, mask):
    return models.hidden_states(model, params, tokens, attention_mask=mask)


def objective(model, params, tokens, mask, weights, *, group_size):
    """A scalar of every completion log-prob: ``sum(w * log pi)``."""
    logp = models.completion_logprobs(model, params, tokens, mask, COMPLETION_LEN, group_size=group_size)
    return jnp.sum(weights * logp)


@functools.partial(jax.jit, static_argnames=("model", "group_size"))
def value_and_grad(model, params, tokens, mask, weights, *, group_size=1):
    return jax.value_and_grad(functools.partial(objective, model, group_size=group_size))(params, tokens, mask, weights)


def scanned_of(model, params):
    """The same model and params in the stacked layout."""
    scanned, scanned_params = models.with_scan_layers(model, params, True)
    assert scanned.config.scan_layers and all(decoder.is_stacked(path) for path in layer_paths(scanned_params))
    return scanned, scanned_params


def layer_paths(params) -> list[tuple]:
    return [path for path, _ in nnx.to_flat_state(params) if path[0] == decoder.LAYERS]


def assert_gradients_close(actual, expected):
    """Every leaf within ``GRAD_RTOL`` of the largest entry of the expected leaf."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected)):
        scale = float(jnp.max(jnp.abs(b)))
        assert scale > 0, jax.tree_util.keystr(path)  # every parameter takes part
        np.testing.assert_allclose(a, b, rtol=0, atol=GRAD_RTOL * scale, err_msg=jax.tree_util.keystr(path))


# --- Layer scan ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_scanned_layers_give_the_hidden_states_of_the_unrolled_layers(name):
    model, params = perturbed_init(CONFIGS[name])
    scanned, scanned_params = scanned_of(model, params)
    tokens, mask, _ = rollout_batch(CONFIGS[name].vocab_size)
    expected = hidden(model, params, tokens, mask)  # [B, S + N, E]
    actual = hidden(scanned, scanned_params, tokens, mask)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=ATOL)  # padding too
    np.testing.assert_allclose(
        models.forward(scanned, scanned_params, tokens, attention_mask=mask),
        models.forward(model, params, tokens, attention_mask=mask),
        rtol=0,
        atol=1e-4,
    )


SHARED_PROMPT_CONFIGS = ("qwen3-qk-norm-tied", "qwen2-full-then-window", "qwen2-window-full-window")


@pytest.mark.parametrize(
    "name, group_size",
    [(name, 1) for name in CONFIGS if name not in SHARED_PROMPT_CONFIGS]
    + [(name, GROUP) for name in SHARED_PROMPT_CONFIGS],
)
def test_scanned_layers_give_the_gradients_of_the_unrolled_layers(name, group_size):
    model, params = perturbed_init(CONFIGS[name])
    tokens, mask, weights = rollout_batch(CONFIGS[name].vocab_size, group_size=group_size)
    value, grads = value_and_grad(model, params, tokens, mask, weights, group_size=group_size)
    scanned_value, scanned_grads = value_and_grad(
        *scanned_of(model, params), tokens, mask, weights, group_size=group_size
    )
    np.testing.assert_allclose(scanned_value, value, rtol=1e-5)
    # The gradient comes in the params' stacked layout: one [L, ...] leaf per weight kind.
    assert jax.tree.structure(scanned_grads) == jax.tree.structure(decoder.stack_layers(grads))
    assert_gradients_close(decoder.unstack_layers(scanned_grads), grads)


def test_the_scan_holds_one_layer_in_every_pass_decoding_included():
    config = CONFIGS["qwen2-full-then-window"]
    model, params = perturbed_init(config)
    scanned, scanned_params = scanned_of(model, params)
    tokens, mask, weights = rollout_batch(config.vocab_size)

    def loss(model, group_size=1):
        return functools.partial(objective, model, tokens=tokens, mask=mask, weights=weights, group_size=group_size)

    # A scan of length L runs the layers (the only other scan, over vocabulary chunks, has length 1 here).
    layer_scan = re.compile(rf"length={config.num_layers}\b")
    assert not layer_scan.search(str(jax.make_jaxpr(loss(model))(params)))
    for group_size in (1, GROUP):  # both passes of the shared prompt too
        assert len(layer_scan.findall(str(jax.make_jaxpr(loss(scanned, group_size))(scanned_params)))) == group_size
    for m, p, scans in ((model, params, 0), (scanned, scanned_params, 1)):
        prefill = jax.make_jaxpr(lambda p, m=m: models.prefill(m, p, tokens[:, :PROMPT_LEN], cache_size=PROMPT_LEN + 1))
        cache = models.init_cache(m, BATCH, PROMPT_LEN + 1)
        decode = jax.make_jaxpr(lambda p, c, m=m: models.decode_step(m, p, tokens[:, 0], c))
        assert len(layer_scan.findall(str(prefill(p)))) == scans
        assert len(layer_scan.findall(str(decode(p, cache)))) == scans


def equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in it (scans, jits, remat)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(inner, jax.extend.core.ClosedJaxpr):
                    yield from equations(inner.jaxpr)
                elif isinstance(inner, jax.extend.core.Jaxpr):
                    yield from equations(inner)


def test_the_scan_reads_the_stored_stacks_and_builds_no_stacked_copy_of_the_weights():
    """Every array of a stacked weight's shape in a pass is the scan's output (the stacked
    gradient) or a sum of two passes' gradients: nothing stacks or concatenates the layers'
    weights, and decoding makes no such array at all."""
    config = CONFIGS["qwen2-full-then-window"]
    scanned, params = scanned_of(*perturbed_init(config))
    tokens, mask, weights = rollout_batch(config.vocab_size)
    stacked_shapes = {leaf.shape for leaf in jax.tree.leaves(params["layers"])}

    def makers(fn, *args):  # the primitives that make an array of a stacked weight's shape
        jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
        return {e.primitive.name for e in equations(jaxpr) for v in e.outvars if v.aval.shape in stacked_shapes}

    for group_size in (1, GROUP):
        grad = jax.grad(functools.partial(objective, scanned, group_size=group_size))
        assert makers(grad, params, tokens, mask, weights) <= {"scan", "add_any"}
        assert "scan" in makers(grad, params, tokens, mask, weights)  # the check sees the stacked gradient
    cache = models.init_cache(scanned, BATCH, PROMPT_LEN + 1)
    assert not makers(lambda p, c: models.decode_step(scanned, p, tokens[:, 0], c), params, cache)


# --- Scanned decoding ------------------------------------------------------------------------------


def decode(model, params, tokens, mask, *, steps, cache=None):
    """Prefill of the ``[B, S]`` prompts, then ``steps`` greedy decode steps: the logits of
    each (``[B, V]``), the greedy tokens ``[B, steps]`` and the final cache."""
    if cache is None:
        logits, cache = jax.jit(
            functools.partial(models.prefill, cache_size=tokens.shape[1] + steps, last_logits_only=True),
            static_argnums=0,
        )(model, params, tokens, mask)
    else:  # the first greedy token from zero logits: token 0
        logits = jnp.zeros((tokens.shape[0], model.config.vocab_size))
    step = jax.jit(functools.partial(models.decode_step, model))
    all_logits, greedy = [logits], []
    for _ in range(steps):
        greedy.append(jnp.argmax(all_logits[-1], axis=-1).astype(jnp.int32))
        logits, cache = step(params, greedy[-1], cache)
        all_logits.append(logits)
    return all_logits, jnp.stack(greedy, axis=1), cache


def unstacked(cache):
    """A cache's keys and values one array per layer, whatever its layout."""
    return tuple(tuple(kv) for kv in (cache.keys, cache.values))


@pytest.mark.parametrize("name", ["llama", "qwen3-qk-norm-tied", "mistral-window-3", "qwen2-window-full-window"])
def test_scanned_prefill_and_decoding_give_the_unrolled_logits_tokens_and_cache(name):
    model, params = perturbed_init(CONFIGS[name])
    scanned, scanned_params = scanned_of(model, params)
    tokens, mask, _ = rollout_batch(CONFIGS[name].vocab_size)
    prompt, prompt_mask = tokens[:, :PROMPT_LEN], mask[:, :PROMPT_LEN]
    expected_logits, expected_tokens, expected_cache = decode(model, params, prompt, prompt_mask, steps=4)
    logits, greedy, cache = decode(scanned, scanned_params, prompt, prompt_mask, steps=4)
    assert not expected_cache.stacked and cache.stacked
    assert cache.keys.shape == (3, BATCH, CONFIGS[name].num_kv_heads, PROMPT_LEN + 4, 8)  # [L, B, KVH, K, D]
    np.testing.assert_array_equal(greedy, expected_tokens)
    for step, (actual, expected) in enumerate(zip(logits, expected_logits, strict=True)):
        np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-4, err_msg=f"step {step}")
    for actual, expected in zip(jax.tree.leaves(unstacked(cache)), jax.tree.leaves(unstacked(expected_cache))):
        np.testing.assert_allclose(actual, expected, rtol=0, atol=ATOL)
    for field in ("valid", "next_position", "index"):
        np.testing.assert_array_equal(getattr(cache, field), getattr(expected_cache, field))


def test_either_cache_layout_decodes_through_either_layer_setting():
    model, params = perturbed_init(CONFIGS["qwen2-full-then-window"])
    scanned, scanned_params = scanned_of(model, params)
    tokens, mask, _ = rollout_batch(CONFIGS["qwen2-full-then-window"].vocab_size)
    prompt, prompt_mask = tokens[:, :PROMPT_LEN], mask[:, :PROMPT_LEN]
    _, per_layer = models.prefill(model, params, prompt, prompt_mask, cache_size=PROMPT_LEN + 3)
    _, stacked = models.prefill(scanned, scanned_params, prompt, prompt_mask, cache_size=PROMPT_LEN + 3)
    expected_logits, expected_tokens, expected_cache = decode(
        model, params, prompt, prompt_mask, steps=3, cache=per_layer
    )
    for m, p, cache in ((scanned, scanned_params, per_layer), (model, params, stacked)):  # the other's cache layout
        logits, greedy, final = decode(m, p, prompt, prompt_mask, steps=3, cache=cache)
        assert final.stacked == cache.stacked  # returned in the layout it came in
        np.testing.assert_array_equal(greedy, expected_tokens)
        for actual, expected in zip(logits[1:], expected_logits[1:], strict=True):
            np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-4)
        for actual, expected in zip(jax.tree.leaves(unstacked(final)), jax.tree.leaves(unstacked(expected_cache))):
            np.testing.assert_allclose(actual, expected, rtol=0, atol=ATOL)


def test_take_rows_and_repeat_rows_copy_rows_in_both_layouts():
    model, params = perturbed_init(CONFIGS["llama"])
    tokens, mask, _ = rollout_batch(CONFIGS["llama"].vocab_size)
    rows = jnp.asarray([2, 0, 0, 3, 1])
    taken = []
    for m, p in ((model, params), scanned_of(model, params)):
        _, cache = models.prefill(m, p, tokens[:, :PROMPT_LEN], mask[:, :PROMPT_LEN], cache_size=PROMPT_LEN + 2)
        taken.append(cache.take_rows(rows))
        assert taken[-1].valid.shape == (5, PROMPT_LEN + 2) and taken[-1].index == cache.index
        for copy, source in zip(jax.tree.leaves(unstacked(taken[-1])), jax.tree.leaves(unstacked(cache))):
            np.testing.assert_array_equal(copy, source[rows])
        repeated = cache.repeat_rows(2)
        for a, b in zip(jax.tree.leaves(repeated), jax.tree.leaves(cache.take_rows(jnp.arange(2 * BATCH) // 2))):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(unstacked(taken[0])), jax.tree.leaves(unstacked(taken[1]))):
        np.testing.assert_allclose(a, b, rtol=0, atol=ATOL)


def test_scanned_decoding_updates_the_stacked_cache_in_place():
    """A decode step's temporaries hold no copy of the stacked cache (at most one layer's
    slice of it, beside one layer's weights read out of the stored stacks), and the
    donated cache comes back in the same buffers."""
    config = dataclasses.replace(CONFIGS["llama"], max_position_embeddings=512)
    scanned, params = scanned_of(*perturbed_init(config))
    cache = models.init_cache(scanned, BATCH, 512)
    step = jax.jit(functools.partial(models.decode_step, scanned), donate_argnums=2)
    memory = step.lower(params, jnp.zeros((BATCH,), jnp.int32), cache).compile().memory_analysis()
    cache_bytes = cache.keys.nbytes + cache.values.nbytes
    assert memory.alias_size_in_bytes >= cache_bytes
    one_layer = sum(leaf.nbytes for leaf in jax.tree.leaves(params["layers"])) / config.num_layers
    bound = 2 * cache_bytes / config.num_layers + one_layer + 2**16
    assert bound < cache_bytes  # the bound excludes a copy
    assert memory.temp_size_in_bytes < bound


def test_a_scanned_greedy_rollout_gives_the_unrolled_rollout():
    from jaxrl_llm import sampling

    config = CONFIGS["qwen2-window-full-window"]
    model, params = perturbed_init(config)
    tokens, mask, _ = rollout_batch(config.vocab_size, group_size=GROUP)
    prompts, prompt_mask = tokens[::GROUP, :PROMPT_LEN], mask[::GROUP, :PROMPT_LEN]
    rollouts = [
        sampling.sample(
            m,
            p,
            prompts,
            prompt_mask,
            jax.random.key(0),
            num_samples=GROUP,
            max_new_tokens=6,
            eos_ids=(0,),
            pad_id=0,
            temperature=0.0,
        )
        for m, p in ((model, params), scanned_of(model, params))
    ]
    np.testing.assert_array_equal(rollouts[1].tokens, rollouts[0].tokens)
    np.testing.assert_array_equal(rollouts[1].completion_mask, rollouts[0].completion_mask)
    np.testing.assert_allclose(rollouts[1].logprobs, rollouts[0].logprobs, rtol=0, atol=1e-4)


def test_decoding_with_every_option_set_gives_the_reference_logits():
    config = CONFIGS["qwen2-full-then-window"]
    model, params = perturbed_init(config)
    scanned, scanned_params = scanned_of(model, params)
    optioned = models.with_options(scanned, remat="full", attention="dot_product_attention")
    tokens, mask, _ = rollout_batch(config.vocab_size)
    results = []
    for m, p in ((model, params), (optioned, scanned_params)):
        logits, cache = models.prefill(m, p, tokens[:, :PROMPT_LEN], mask[:, :PROMPT_LEN], cache_size=PROMPT_LEN + 2)
        results.append([logits])
        for t in range(2):
            step_logits, cache = models.decode_step(m, p, tokens[:, PROMPT_LEN + t], cache)
            results[-1].append(step_logits)
    for expected, actual in zip(*results, strict=True):
        np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-4)


# --- Rematerialisation -----------------------------------------------------------------------------


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("remat, policy", [("full", "nothing_saveable"), ("dots", "dots_with_no_batch_dims_saveable")])
def test_remat_gives_the_loss_and_gradients_of_none_and_is_applied(remat, policy, scan_layers):
    policy = getattr(jax.checkpoint_policies, policy)
    assert decoder.REMAT_POLICIES[remat] is policy
    config = CONFIGS["qwen2-full-then-window"]
    base, params = models.with_scan_layers(*perturbed_init(config), scan_layers)
    tokens, mask, weights = rollout_batch(config.vocab_size, group_size=GROUP)
    rematted = models.with_options(base, remat=remat)
    for group_size in (1, GROUP):
        value, grads = value_and_grad(base, params, tokens, mask, weights, group_size=group_size)
        remat_value, remat_grads = value_and_grad(rematted, params, tokens, mask, weights, group_size=group_size)
        np.testing.assert_allclose(remat_value, value, rtol=1e-5)
        assert_gradients_close(remat_grads, grads)

    def jaxpr(model):
        return str(jax.make_jaxpr(functools.partial(objective, model, group_size=1))(params, tokens, mask, weights))

    printed = f"policy=<function {policy.__name__} " if hasattr(policy, "__name__") else f"policy={policy!r}"

    def checkpoints(model):  # jax.checkpoint with the policy (the log-probs' chunk scan has its own)
        return jaxpr(model).count(printed)

    # One per layer (unrolled) or one around the scan's body.
    assert checkpoints(rematted) - checkpoints(base) == (1 if scan_layers else config.num_layers)


def test_remat_and_scan_keep_forward_over_reverse_products():
    """TRPO's Fisher-vector products linearize the gradient (forward mode over reverse)."""
    config = CONFIGS["qwen2-full-then-window"]
    model, params = perturbed_init(config)
    tokens, mask, weights = rollout_batch(config.vocab_size)

    @functools.partial(jax.jit, static_argnames="model")
    def hessian_vector_product(model, params):
        grad = jax.grad(functools.partial(objective, model, tokens=tokens, mask=mask, weights=weights, group_size=1))
        tangent = jax.tree.map(lambda p: jnp.full_like(p, 0.01), params)
        return jax.jvp(grad, (params,), (tangent,))[1]

    expected = hessian_vector_product(model, params)
    scanned, scanned_params = scanned_of(model, params)
    actual = hessian_vector_product(models.with_options(scanned, remat="dots"), scanned_params)
    assert_gradients_close(decoder.unstack_layers(actual), expected)


# --- Attention implementation ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "qwen3-qk-norm-tied", "mistral-window-3", "qwen2-window-full-window"])
def test_dot_product_attention_gives_the_outputs_and_gradients_of_xla(name):
    model, params = perturbed_init(CONFIGS[name])
    xla = models.with_options(model, attention="xla")
    fused = models.with_options(model, attention="dot_product_attention")
    tokens, mask, weights = rollout_batch(CONFIGS[name].vocab_size)
    np.testing.assert_allclose(
        hidden(fused, params, tokens, mask), hidden(xla, params, tokens, mask), rtol=0, atol=ATOL
    )  # left-padding positions included: finite, the same uniform rows
    value, grads = value_and_grad(xla, params, tokens, mask, weights)
    fused_value, fused_grads = value_and_grad(fused, params, tokens, mask, weights)
    np.testing.assert_allclose(fused_value, value, rtol=1e-5)
    assert_gradients_close(fused_grads, grads)


def test_a_query_with_no_valid_key_gets_the_same_finite_row_from_both_kernels():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 5, 4, 8)), jnp.float32)  # [B, S, H, D]
    k, v = (jnp.asarray(rng.normal(size=(2, 2, 5, 8)), jnp.float32) for _ in range(2))  # [B, KVH, K, D]
    valid = jnp.arange(5)[None, :] >= jnp.array([[0], [3]])  # [B, K]: row 1 left-padded by 3
    mask = jnp.tril(jnp.ones((5, 5), bool))[None] & valid[:, None, :]
    mask = mask.at[1, :3].set(False)  # [B, S, K]: row 1's first 3 queries are padding, with no valid key
    cotangent = jnp.asarray(rng.normal(size=(2, 5, 4, 8)), jnp.float32)

    def run(implementation):
        out, vjp = jax.vjp(lambda q, k, v: decoder._attention(implementation, q, k, v, mask), q, k, v)
        return out, vjp(cotangent)

    (out, grads), (expected, expected_grads) = run("dot_product_attention"), run("xla")
    assert np.isfinite(out).all() and all(np.isfinite(g).all() for g in grads)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-6)
    uniform = jnp.repeat(jnp.mean(v[1], axis=1), 2, axis=0)  # [H, D]: each head's values averaged over all K
    np.testing.assert_allclose(out[1, :3], jnp.broadcast_to(uniform, (3, 4, 8)), rtol=0, atol=1e-6)
    for g, e in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-5)


def test_auto_attention_is_xla_on_cpu_and_dot_product_attention_elsewhere(monkeypatch):
    config = CONFIGS["llama"]
    assert decoder.attention_implementation(config) == "xla"  # the tests run on CPU
    for explicit in ("xla", "dot_product_attention"):
        assert decoder.attention_implementation(dataclasses.replace(config, attention=explicit)) == explicit
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert decoder.attention_implementation(config) == "dot_product_attention"
    assert decoder.attention_implementation(dataclasses.replace(config, attention="xla")) == "xla"


# --- Configuration ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            dict(remat="checkpoint_dots"),
            "ModelConfig: `remat` must be one of 'none', 'full', 'dots'; got 'checkpoint_dots'",
        ),
        (dict(remat=None), "`remat` must be one of 'none', 'full', 'dots'; got None"),
        (
            dict(attention="flash"),
            "`attention` must be one of 'auto', 'xla', 'dot_product_attention', 'cudnn'; got 'flash'",
        ),
        (dict(scan_layers="yes"), "`scan_layers` must be True or False; got 'yes'"),
        (dict(scan_layers=1), "`scan_layers` must be True or False; got 1"),
        (dict(attention="cudnn"), "attention='cudnn' .* computes in bfloat16 or float16; got dtype float32"),
    ],
)
def test_bad_options_name_the_allowed_values(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(CONFIGS["llama"], **changes)


def test_cudnn_is_accepted_with_a_half_precision_dtype():
    config = dataclasses.replace(CONFIGS["llama"], dtype=jnp.bfloat16, attention="cudnn")
    assert config.attention == "cudnn"


def test_options_and_the_layout_are_not_architecture_hugging_face_never_sees_them():
    config = CONFIGS["qwen2-full-then-window"]
    optioned = dataclasses.replace(config, scan_layers=True, remat="dots", attention="dot_product_attention")
    assert optioned.to_hf().to_dict() == config.to_hf().to_dict()
    assert models.ModelConfig.from_hf(optioned.to_hf()) == config  # options and layout back at their defaults
    assert set(models.config.EXECUTION_OPTIONS) == {"remat", "attention"}  # the layout is not an execution option
    # Configs are static jit arguments: equal options, equal hashes; other options, another config.
    again = dataclasses.replace(config, scan_layers=True, remat="dots", attention="dot_product_attention")
    assert again == optioned and hash(again) == hash(optioned)
    assert optioned != config


@pytest.mark.parametrize("scan_layers", [False, True])
def test_with_options_keeps_the_params_as_they_are(scan_layers):
    from jaxrl_llm import training

    model, params = models.with_scan_layers(*perturbed_init(CONFIGS["qwen2-full-then-window"]), scan_layers)
    optioned = models.with_options(model, remat="full", attention="dot_product_attention")
    assert (optioned.config.scan_layers, optioned.config.remat, optioned.config.attention) == (
        scan_layers,
        "full",
        "dot_product_attention",
    )
    assert (model.config.remat, model.config.attention) == ("none", "auto")  # the original is untouched
    module = optioned.module(params)  # the modules read the options from the graph definition
    layer = module.layers if scan_layers else module.layers[0]
    assert module.config == optioned.config and layer.self_attn.config == optioned.config
    assert jax.tree.structure(models.abstract(optioned.config)[1]) == jax.tree.structure(params)
    training.state.check_params(optioned, params)
    assert models.with_options(model) is model
    # Equal options, an equal (static, hashable) Model: jitted functions do not retrace.
    again = models.with_options(model, remat="full", attention="dot_product_attention")
    assert again == optioned and hash(again) == hash(optioned)


def test_with_options_refuses_architecture_fields_the_layout_and_bad_values():
    model, _ = models.abstract(CONFIGS["llama"])
    with pytest.raises(
        ValueError,
        match=r"with_options: 'num_layers' is not an execution option; allowed: 'remat', 'attention'\. ",
    ):
        models.with_options(model, num_layers=2)
    with pytest.raises(ValueError, match="`remat` must be one of 'none', 'full', 'dots'"):
        models.with_options(model, remat="everything")
    # The layout changes the params' tree: with_options points to the function that converts both.
    with pytest.raises(
        ValueError, match=r"'scan_layers' is not an execution option.*models\.with_scan_layers\(model, params"
    ):
        models.with_options(model, scan_layers=True, remat="dots")


# --- The stacked layout ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen2-biases", "qwen3-qk-norm-tied"])
def test_a_scanned_init_is_the_stacked_unrolled_init_and_unstacking_gives_it_back_bitwise(name):
    config = CONFIGS[name]
    _, params = models.init(config, jax.random.key(4))
    scanned, stacked = models.init(dataclasses.replace(config, scan_layers=True), jax.random.key(4))
    assert scanned.config.scan_layers
    expected = decoder.stack_layers(params)
    assert jax.tree.structure(stacked) == jax.tree.structure(expected)  # paths and logical axes too
    chex.assert_trees_all_equal(stacked, expected)
    flat, per_layer = dict(nnx.to_flat_state(stacked)), dict(nnx.to_flat_state(params))
    # One [L, ...] leaf per weight kind, its leading logical axis "layers", then the layer's own axes.
    kinds = {path[2:] for path in per_layer if path[0] == "layers"}
    assert {path[1:] for path in layer_paths(stacked)} == kinds and len(kinds) >= 9
    for rest in kinds:
        leaf, first = flat[("layers", *rest)], per_layer[("layers", 0, *rest)]
        assert leaf.shape == (config.num_layers, *first.shape)
        assert leaf.get_metadata()["out_sharding"] == ("layers", *first.get_metadata()["out_sharding"])
        for layer in range(config.num_layers):
            np.testing.assert_array_equal(leaf[...][layer], per_layer[("layers", layer, *rest)][...])
    # The round trips, bit for bit; a layout already there keeps its arrays.
    unstacked_params = decoder.unstack_layers(stacked)
    assert jax.tree.structure(unstacked_params) == jax.tree.structure(params)
    chex.assert_trees_all_equal(unstacked_params, params)
    chex.assert_trees_all_equal(decoder.stack_layers(decoder.unstack_layers(stacked)), stacked)
    for same, tree in ((decoder.unstack_layers(params), params), (decoder.stack_layers(stacked), stacked)):
        assert jax.tree.structure(same) == jax.tree.structure(tree)
        assert all(x is y for x, y in zip(jax.tree.leaves(same), jax.tree.leaves(tree), strict=True))
    assert decoder.is_stacked(("layers", "mlp", "up_proj")) and not decoder.is_stacked(("layers", 0, "mlp", "up_proj"))
    assert not decoder.is_stacked(("embed_tokens",)) and decoder.LAYERS == "layers"


def test_with_scan_layers_converts_the_model_and_its_params_both_ways():
    model, params = perturbed_init(CONFIGS["qwen2-window-full-window"])
    scanned, stacked = models.with_scan_layers(model, params, True)
    assert scanned.config == dataclasses.replace(model.config, scan_layers=True)
    assert scanned == models.abstract(scanned.config)[0]  # a plain Model of that config: hashable, static
    assert jax.tree.structure(models.abstract(scanned.config)[1]) == jax.tree.structure(stacked)
    chex.assert_trees_all_equal(stacked, decoder.stack_layers(params))
    for name in ("embed_tokens", "norm", "lm_head"):  # the other leaves are the params' own arrays
        assert stacked[name][...] is params[name][...]
    back, unstacked_params = models.with_scan_layers(scanned, stacked, False)
    assert back == model and back.config == model.config
    assert jax.tree.structure(unstacked_params) == jax.tree.structure(params)
    chex.assert_trees_all_equal(unstacked_params, params)
    # Already in the layout asked for: as they are.
    for m, p, scan_layers in ((model, params, False), (scanned, stacked, True)):
        same = models.with_scan_layers(m, p, scan_layers)
        assert same[0] is m and same[1] is p
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match=rf"`scan_layers` must be True or False; got {bad!r}"):
            models.with_scan_layers(model, params, bad)


def test_scanned_layers_on_a_sharded_mesh_give_the_single_device_gradients():
    """FSDP x tensor-parallel stacked params through the scan: each [L, ...] leaf split as
    its layers are by the rules, its "layers" axis whole; the gradient keeps that layout."""
    from jaxrl_llm import sharding

    config = CONFIGS["qwen2-full-then-window"]
    model, params = perturbed_init(config)
    tokens, mask, weights = rollout_batch(config.vocab_size, group_size=GROUP)
    expected_value, expected = value_and_grad(model, params, tokens, mask, weights, group_size=GROUP)
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    scanned, stacked = scanned_of(model, params)
    rules = sharding.RULES["fsdp_tensor"]
    placements = sharding.param_shardings(stacked, mesh, rules)
    per_layer = sharding.param_shardings(params, mesh, rules)
    for kind in (("self_attn", "q_proj"), ("self_attn", "o_proj"), ("mlp", "down_proj")):
        layer_spec = tuple(per_layer["layers"][0][kind[0]][kind[1]].spec)
        assert any(layer_spec) and tuple(placements["layers"][kind[0]][kind[1]].spec) == (None, *layer_spec)
    sharded = jax.device_put(stacked, placements)
    rows = sharding.rows(mesh)
    value, grads = value_and_grad(
        models.with_options(scanned, remat="dots"),
        sharded,
        *(jax.device_put(x, rows) for x in (tokens, mask, weights)),
        group_size=GROUP,
    )
    np.testing.assert_allclose(value, expected_value, rtol=1e-5)
    assert_gradients_close(decoder.unstack_layers(grads), expected)
