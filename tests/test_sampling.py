"""The KV-cache sampler against full forward passes, distributions, EOS and stop-string rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxrl_llm import models, sampling, sharding, tasks

VOCAB, EOS, PAD = 24, 2, 0
CONFIG = models.ModelConfig(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)


def peaked_model(scale=30.0, seed=0, eos_bias=0.0):
    """A random model whose next-token distributions are far from uniform."""
    model, params = models.init(CONFIG, jax.random.key(seed))
    params["lm_head"] = params["lm_head"] * scale
    params["lm_head"] = params["lm_head"].at[:, EOS].add(eos_bias)
    return model, params


PROMPTS = jnp.array([[0, 0, 5, 6], [1, 7, 3, 4], [0, 9, 9, 8]])
PROMPT_MASK = jnp.array([[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]])


def kwargs(**overrides):
    return {"num_samples": 2, "max_new_tokens": 9, "eos_ids": (EOS,), "pad_id": PAD, **overrides}


def reference_filter(logits, *, top_k=None, top_p=None, min_p=None):
    """The kept set ``[..., V]`` bool of top-k, then top-p of the top-k distribution, then
    min-p, in float64 with one loop per definition (transformers' order)."""
    z = np.atleast_2d(np.asarray(logits, np.float64))  # [B, V]
    keep = np.ones(z.shape, bool)
    if top_k is not None:
        keep &= z >= np.sort(z, axis=-1)[:, -min(top_k, z.shape[1])][:, None]
    if top_p is not None:
        p = np.where(keep, np.exp(z - z.max(axis=-1, keepdims=True)), 0.0)
        p /= p.sum(axis=-1, keepdims=True)
        for b, v in np.argwhere(keep):
            keep[b, v] = p[b, z[b] > z[b, v]].sum() < top_p  # mass of strictly more likely tokens
    if min_p is not None:
        p = np.where(keep, np.exp(z - z.max(axis=-1, keepdims=True)), 0.0)  # unnormalised: the ratio is what counts
        keep &= p >= min_p * p.max(axis=-1, keepdims=True)
    return keep.reshape(np.shape(logits))


@pytest.mark.parametrize("new_tokens", [9, 1])  # 1: the only token comes from the prefill's logits
def test_greedy_equals_stepwise_argmax_of_full_forward_passes(new_tokens):
    model, params = peaked_model()
    rollout = sampling.sample(
        model, params, PROMPTS, PROMPT_MASK, jax.random.key(0), **kwargs(temperature=0.0, max_new_tokens=new_tokens)
    )
    # Reference: no cache, re-run the whole sequence for every new token.
    tokens = np.repeat(np.asarray(PROMPTS), 2, axis=0)
    mask = np.repeat(np.asarray(PROMPT_MASK), 2, axis=0).astype(bool)
    done = np.zeros(len(tokens), bool)
    forward = jax.jit(lambda params, tokens, mask: models.forward(model, params, tokens, attention_mask=mask))
    for _ in range(new_tokens):
        logits = forward(params, jnp.asarray(tokens), jnp.asarray(mask))
        nxt = np.where(done, PAD, np.asarray(jnp.argmax(logits[:, -1], axis=-1)))
        tokens = np.concatenate([tokens, nxt[:, None]], axis=1)
        mask = np.concatenate([mask, ~done[:, None]], axis=1)
        done |= nxt == EOS
    np.testing.assert_array_equal(rollout.tokens, tokens)


@pytest.mark.parametrize(
    "settings",
    [dict(), dict(temperature=0.7), dict(temperature=1.3, top_k=5, top_p=0.8), dict(temperature=1.3, min_p=0.05)],
)
def test_logprobs_equal_a_full_forward_recomputation(settings):
    model, params = peaked_model(scale=5.0)
    rollout = sampling.sample(model, params, PROMPTS, PROMPT_MASK, jax.random.key(1), **kwargs(**settings))
    recomputed = sampling.recompute_logprobs(model, params, rollout, temperature=settings.get("temperature", 1.0))
    assert np.abs(np.asarray(recomputed - rollout.logprobs)).max() <= 1e-5
    if not settings.get("top_k") and not settings.get("top_p") and not settings.get("min_p"):
        np.testing.assert_array_equal(rollout.sampling_logprobs, rollout.logprobs)
    else:  # truncation renormalises: the sampled token was at least as likely as under pi_T
        assert np.all(np.asarray(rollout.sampling_logprobs) >= np.asarray(rollout.logprobs) - 1e-6)


def test_top_k_one_and_vanishing_temperature_are_greedy():
    model, params = peaked_model()
    greedy = sampling.sample(model, params, PROMPTS, PROMPT_MASK, jax.random.key(2), **kwargs(temperature=0.0))
    top1 = sampling.sample(model, params, PROMPTS, PROMPT_MASK, jax.random.key(3), **kwargs(top_k=1))
    # T must be far below the smallest top-2 logit gap: this model has a 5e-6 near-tie, where
    # T = 1e-4 would (correctly) split ~51/49.
    cold = sampling.sample(model, params, PROMPTS, PROMPT_MASK, jax.random.key(4), **kwargs(temperature=1e-8))
    # min_p = 1 keeps only the tokens as likely as the top one: the argmax, barring exact ties.
    min_p1 = sampling.sample(model, params, PROMPTS, PROMPT_MASK, jax.random.key(5), **kwargs(min_p=1.0))
    np.testing.assert_array_equal(top1.tokens, greedy.tokens)
    np.testing.assert_array_equal(cold.tokens, greedy.tokens)
    np.testing.assert_array_equal(min_p1.tokens, greedy.tokens)
    np.testing.assert_array_equal(np.asarray(min_p1.sampling_logprobs)[np.asarray(min_p1.completion_mask)], 0.0)


@pytest.mark.parametrize(
    "top_k, top_p, min_p", [(4, None, None), (None, 0.6, None), (6, 0.9, None), (None, None, 0.2), (6, 0.9, 0.1)]
)
def test_truncated_sampling_only_draws_from_the_allowed_set(top_k, top_p, min_p):
    model, params = peaked_model(scale=5.0)
    rollout = sampling.sample(
        model,
        params,
        PROMPTS,
        PROMPT_MASK,
        jax.random.key(5),
        **kwargs(num_samples=8, top_k=top_k, top_p=top_p, min_p=min_p),
    )
    logits = models.forward(model, params, rollout.tokens, attention_mask=rollout.attention_mask)
    n = rollout.completion_mask.shape[1]
    predicting = logits[:, -n - 1 : -1].reshape(-1, VOCAB).astype(jnp.float32)
    allowed = np.isfinite(np.asarray(sampling.filter_logits(predicting, top_k=top_k, top_p=top_p, min_p=min_p)))
    chosen = np.asarray(rollout.completion_tokens).reshape(-1)
    valid = np.asarray(rollout.completion_mask).reshape(-1)
    assert allowed[np.arange(len(chosen)), chosen][valid].all()


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [
        (1.0, None, None, None),
        (0.8, 5, None, None),
        (1.0, None, 0.7, None),
        (1.0, None, None, 0.55),
        (0.8, 20, 0.95, 0.5),
    ],
)
def test_empirical_first_token_distribution_matches_the_target(temperature, top_k, top_p, min_p):
    """Chi-square goodness of fit of 6000 first tokens of one prompt, fixed seed."""
    model, params = peaked_model(scale=3.0)
    prompt, mask = PROMPTS[1:2], PROMPT_MASK[1:2]
    rollout = sampling.sample(
        model,
        params,
        prompt,
        mask,
        jax.random.key(6),
        num_samples=6000,
        max_new_tokens=1,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        eos_ids=(EOS,),
        pad_id=PAD,
    )
    logits = models.forward(model, params, prompt, attention_mask=mask)[:, -1].astype(jnp.float32)
    target = np.asarray(
        jax.nn.softmax(sampling.filter_logits(logits / temperature, top_k=top_k, top_p=top_p, min_p=min_p))
    )[0]
    if min_p is not None:  # the NumPy reference of the kept set: the filter does cut, and keeps several
        np.testing.assert_array_equal(
            target > 0, reference_filter(np.asarray(logits[0]) / temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        )
        assert 3 <= (target > 0).sum() < VOCAB - 5
    counts = np.bincount(np.asarray(rollout.tokens[:, -1]), minlength=VOCAB)
    support = target > 0
    assert counts[~support].sum() == 0
    expected = target[support] * counts.sum()
    assert stats.chisquare(counts[support], expected / expected.sum() * counts.sum()).pvalue > 0.01


def test_eos_masking_lengths_and_truncation_with_uneven_finishes():
    model, params = peaked_model(scale=3.0, eos_bias=1.5)
    rollout = sampling.sample(
        model, params, PROMPTS, PROMPT_MASK, jax.random.key(7), **kwargs(num_samples=6, eos_ids=(EOS, 5))
    )
    completion = np.asarray(rollout.completion_tokens)
    mask = np.asarray(rollout.completion_mask)
    lengths = np.asarray(rollout.lengths)
    is_eos = np.isin(completion, [EOS, 5])
    assert len(set(lengths)) > 2  # sequences finish at different steps
    finished = ~np.asarray(rollout.truncated)
    assert set(completion[finished, lengths[finished] - 1]) == {EOS, 5}  # each stop id ends some rows
    for row in range(len(completion)):
        hits = np.flatnonzero(is_eos[row])
        ends_with_eos = hits.size > 0
        assert lengths[row] == (hits[0] + 1 if ends_with_eos else 9)
        assert bool(rollout.truncated[row]) == (not ends_with_eos)
        np.testing.assert_array_equal(mask[row], np.arange(9) < lengths[row])
        assert np.all(completion[row, lengths[row] :] == PAD)
        assert np.all(np.asarray(rollout.logprobs)[row, lengths[row] :] == 0)
    np.testing.assert_array_equal(rollout.attention_mask[:, -9:], mask)


def test_groups_are_adjacent_and_keys_control_randomness():
    model, params = peaked_model(scale=2.0)
    args = (model, params, PROMPTS, PROMPT_MASK)
    a = sampling.sample(*args, jax.random.key(8), **kwargs(num_samples=4))
    b = sampling.sample(*args, jax.random.key(8), **kwargs(num_samples=4))
    c = sampling.sample(*args, jax.random.key(9), **kwargs(num_samples=4))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)
    np.testing.assert_array_equal(a.tokens[:, :4], np.repeat(np.asarray(PROMPTS), 4, axis=0))
    assert len({tuple(row) for row in np.asarray(a.completion_tokens[:4])}) > 1  # G samples differ


def test_prompts_are_prefilled_once_and_their_copies_sample_like_repeated_prompts(monkeypatch):
    model, params = peaked_model(scale=2.0)
    key = jax.random.key(4)
    repeated = np.repeat(np.asarray(PROMPTS), 3, axis=0), np.repeat(np.asarray(PROMPT_MASK), 3, axis=0)
    expected = sampling.sample(model, params, *repeated, key, **kwargs(num_samples=1))
    prefill_rows = []
    prefill = models.prefill

    def spy(model, params, tokens, *args, **kw):
        prefill_rows.append(tokens.shape[0])
        return prefill(model, params, tokens, *args, **kw)

    monkeypatch.setattr(models, "prefill", spy)
    sampling._generate.clear_cache()  # trace again, through the spy
    got = sampling.sample(model, params, PROMPTS, PROMPT_MASK, key, **kwargs(num_samples=3))
    assert prefill_rows == [len(PROMPTS)]  # P rows, not P * G
    np.testing.assert_array_equal(got.tokens, expected.tokens)
    np.testing.assert_array_equal(got.attention_mask, expected.attention_mask)
    np.testing.assert_allclose(got.logprobs, expected.logprobs, atol=1e-5)


@pytest.mark.parametrize(
    "devices, settings", [(2, {}), (8, {}), (2, dict(top_k=5, top_p=0.9, min_p=0.05)), (4, dict(temperature=0.0))]
)
def test_a_rollout_split_over_a_mesh_draws_the_single_device_samples(devices, settings):
    """Eight prompts over a ``data`` mesh of the test's CPU devices: each device decodes
    its rows, the rollout stays split over them, and it is the single-device rollout."""
    model, params = peaked_model(scale=2.0)
    rng = np.random.default_rng(3)
    prompts = jnp.asarray(rng.integers(3, VOCAB, size=(8, 4)))
    prompt_mask = jnp.asarray(np.arange(4)[None] >= rng.integers(0, 3, size=(8, 1)))  # left padding, 0-2 slots
    key = jax.random.key(5)
    expected = sampling.sample(model, params, prompts, prompt_mask, key, **kwargs(num_samples=3, **settings))
    mesh = sharding.make_mesh(devices)
    got = sampling.Sampler(
        model=model, eos_ids=(EOS,), pad_id=PAD, mesh=mesh, sampling=sampling.SamplingConfig(**settings)
    )(params, prompts, prompt_mask, key, num_samples=3, max_new_tokens=9)
    assert got.tokens.sharding.is_equivalent_to(sharding.rows(mesh), got.tokens.ndim)
    assert len(got.tokens.addressable_shards) == devices
    for name in ("tokens", "attention_mask", "completion_mask", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(got, name), getattr(expected, name), err_msg=name)
    np.testing.assert_allclose(got.logprobs, expected.logprobs, atol=1e-5)
    np.testing.assert_allclose(got.sampling_logprobs, expected.sampling_logprobs, atol=1e-5)


@pytest.mark.parametrize(
    "mesh_shape", [(8, 1, 1), (1, 8, 1), (2, 4, 1), (2, 2, 2), (1, 4, 2)], ids=lambda shape: "x".join(map(str, shape))
)
def test_the_sampler_on_data_fsdp_tensor_meshes_draws_the_single_device_samples(mesh_shape):
    """On the train step's meshes: rows over ``data x fsdp``; with a ``tensor`` axis the
    params stay split by heads, MLP columns and vocabulary (tensor-parallel decoding).
    Greedy and sampled completions are the single-device ones."""
    model, params = peaked_model(scale=2.0)
    rng = np.random.default_rng(4)
    prompts = jnp.asarray(rng.integers(3, VOCAB, size=(8, 4)))
    prompt_mask = jnp.asarray(np.arange(4)[None] >= rng.integers(0, 3, size=(8, 1)))
    mesh = sharding.make_mesh(data=mesh_shape[0], fsdp=mesh_shape[1], tensor=mesh_shape[2])
    placed = jax.device_put(params, sharding.param_shardings(params, mesh, sharding.RULES["fsdp_tensor"]))
    for settings in ({}, dict(temperature=0.0)):
        expected = sampling.sample(
            model, params, prompts, prompt_mask, jax.random.key(6), **kwargs(num_samples=2, **settings)
        )
        got = sampling.Sampler(
            model=model, eos_ids=(EOS,), pad_id=PAD, mesh=mesh, sampling=sampling.SamplingConfig(**settings)
        )(placed, prompts, prompt_mask, jax.random.key(6), num_samples=2, max_new_tokens=9)
        for name in ("tokens", "completion_mask", "lengths", "truncated"):
            np.testing.assert_array_equal(getattr(got, name), getattr(expected, name), err_msg=f"{settings} {name}")
        np.testing.assert_allclose(got.logprobs, expected.logprobs, atol=1e-5)
        # Each device decoded rows of its own (with a tensor axis: its tensor group's).
        assert got.tokens.sharding.is_equivalent_to(ROWS_OVER_DATA_AND_FSDP(mesh), 2)


def test_scanned_layers_decode_over_a_tensor_parallel_mesh_like_one_device():
    """``scan_layers``: the stacked ``[L, ...]`` params and cache through tensor-parallel
    decoding (each layer split by heads, MLP columns and vocabulary, the layers' axis
    whole) give the unrolled single-device samples."""
    model, params = peaked_model(scale=2.0)
    scanned, stacked = models.with_scan_layers(model, params, True)
    rng = np.random.default_rng(5)
    prompts = jnp.asarray(rng.integers(3, VOCAB, size=(4, 4)))
    prompt_mask = jnp.asarray(np.arange(4)[None] >= rng.integers(0, 3, size=(4, 1)))
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    placed = jax.device_put(stacked, sharding.param_shardings(stacked, mesh, sharding.RULES["fsdp_tensor"]))
    assert tuple(placed["layers"]["mlp"]["up_proj"][...].sharding.spec) == (None, "fsdp", "tensor")
    expected = sampling.sample(model, params, prompts, prompt_mask, jax.random.key(3), **kwargs(num_samples=2))
    got = sampling.Sampler(model=scanned, eos_ids=(EOS,), pad_id=PAD, mesh=mesh)(
        placed, prompts, prompt_mask, jax.random.key(3), num_samples=2, max_new_tokens=9
    )
    for name in ("tokens", "completion_mask", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(got, name), getattr(expected, name), err_msg=name)
    np.testing.assert_allclose(got.logprobs, expected.logprobs, atol=1e-5)


def ROWS_OVER_DATA_AND_FSDP(mesh):
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec((sharding.DATA, sharding.FSDP)))


@pytest.mark.parametrize(
    "mesh_shape, num_prompts, group",
    [
        ((1, 8, 1), 4, 2),  # 8 rows: each device prefills the 4 prompts and decodes 1 row
        ((2, 4, 1), 2, 4),  # a data shard's 1 prompt, its 4 rows over 4 fsdp devices: groups split
        ((2, 2, 1), 2, 3),  # 3 rows per data shard do not split over 2: both fsdp devices decode them
    ],
    ids=["1x8x1-P4-G2", "2x4x1-P2-G4", "2x2x1-P2-G3"],
)
def test_rows_split_over_fsdp_when_the_prompts_do_not_are_the_single_device_samples(mesh_shape, num_prompts, group):
    """Fewer prompts than ``data x fsdp`` devices: each ``data`` shard's prompts are
    prefilled on all its ``fsdp`` devices and their rows decoded in blocks, one per
    device, where the rows split evenly; else the ``fsdp`` devices decode the same rows.
    Either way the samples are the single-device ones."""
    model, params = peaked_model(scale=2.0)
    rng = np.random.default_rng(7)
    prompts = jnp.asarray(rng.integers(3, VOCAB, size=(num_prompts, 4)))
    prompt_mask = jnp.asarray(np.arange(4)[None] >= rng.integers(0, 3, size=(num_prompts, 1)))
    mesh = sharding.make_mesh(data=mesh_shape[0], fsdp=mesh_shape[1], tensor=mesh_shape[2])
    expected = sampling.sample(model, params, prompts, prompt_mask, jax.random.key(8), **kwargs(num_samples=group))
    got = sampling.Sampler(model=model, eos_ids=(EOS,), pad_id=PAD, mesh=mesh)(
        params, prompts, prompt_mask, jax.random.key(8), num_samples=group, max_new_tokens=9
    )
    for name in ("tokens", "completion_mask", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(got, name), getattr(expected, name), err_msg=name)
    np.testing.assert_allclose(got.logprobs, expected.logprobs, atol=1e-5)
    rows_split = num_prompts * group % mesh.size == 0
    expected_sharding = ROWS_OVER_DATA_AND_FSDP(mesh) if rows_split else sharding.rows(mesh)
    assert got.tokens.sharding.is_equivalent_to(expected_sharding, 2)


def test_prompts_that_do_not_split_over_the_mesh_are_decoded_whole_on_every_device():
    model, params = peaked_model()
    expected = sampling.sample(model, params, PROMPTS, PROMPT_MASK, jax.random.key(0), **kwargs())
    mesh = sharding.make_mesh(2)
    got = sampling.sample(model, params, PROMPTS, PROMPT_MASK, jax.random.key(0), mesh=mesh, **kwargs())  # 3 prompts
    assert got.tokens.sharding.is_equivalent_to(sharding.replicated(mesh), 2)
    np.testing.assert_array_equal(got.tokens, expected.tokens)
    np.testing.assert_allclose(got.logprobs, expected.logprobs, atol=1e-5)
    with pytest.raises(ValueError, match=r"`num_devices` must be an integer in \[1, 8\]"):
        sharding.make_mesh(9)


def test_sampling_inside_jit_draws_the_eager_samples():
    """Under an outer jit the mask is traced: the empty-prompt check is skipped, the rest runs."""
    model, params = peaked_model(scale=2.0)
    eager = sampling.sample(model, params, PROMPTS, PROMPT_MASK, jax.random.key(3), **kwargs())
    traced = jax.jit(lambda p, t, m, k: sampling.sample(model, p, t, m, k, **kwargs()))(
        params, PROMPTS, PROMPT_MASK, jax.random.key(3)
    )
    np.testing.assert_array_equal(traced.tokens, eager.tokens)
    np.testing.assert_allclose(traced.logprobs, eager.logprobs, atol=1e-5)


def test_lengths_in_one_bucket_share_a_compilation():
    model, params = peaked_model()
    sampling.sample(model, params, PROMPTS, PROMPT_MASK, jax.random.key(0), **kwargs(max_new_tokens=9))
    compiled = sampling._generate._cache_size()
    for n, prompt_cut in ((12, 0), (16, 0), (5, 1)):
        sampling.sample(
            model,
            params,
            PROMPTS[:, prompt_cut:],
            PROMPT_MASK[:, prompt_cut:],
            jax.random.key(n),
            **kwargs(max_new_tokens=n),
        )
    assert sampling._generate._cache_size() == compiled


def test_sampler_backend_binds_the_settings():
    model, params = peaked_model()
    backend: sampling.RolloutBackend = sampling.Sampler(
        model=model, eos_ids=(EOS,), pad_id=PAD, sampling=sampling.SamplingConfig(temperature=0.0)
    )
    rollout = backend(params, PROMPTS, PROMPT_MASK, jax.random.key(0), num_samples=2, max_new_tokens=9)
    expected = sampling.sample(model, params, PROMPTS, PROMPT_MASK, jax.random.key(1), **kwargs(temperature=0.0))
    np.testing.assert_array_equal(rollout.tokens, expected.tokens)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(num_samples=0), "`num_samples` must be an integer >= 1; got 0"),
        (dict(eos_ids=()), "`eos_ids` must name at least one end-of-sequence token id"),
        (dict(eos_ids=(99,)), r"must be token ids in \[0, 24\)"),
        (dict(max_new_tokens=61), r"prompt length 4 \+ max_new_tokens 61 exceeds the model's max_position_embeddings"),
        (dict(top_p=0.0), r"`top_p` must be in \(0.0, 1.0\]"),
        (dict(temperature=-1.0), "`temperature` must be a finite number >= 0"),
        (dict(temperature=float("inf")), "`temperature` must be a finite number >= 0; got inf"),
        (dict(pad_id=2.5), "`pad_id` must be an integer token id; got 2.5"),
        (dict(min_p=-0.1), r"sample: `min_p` must be in \[0.0, 1.0\]; got -0.1"),
        (dict(min_p=1.5), r"sample: `min_p` must be in \[0.0, 1.0\]; got 1.5"),
        (dict(min_p=float("nan")), r"sample: `min_p` must be in \[0.0, 1.0\]; got nan"),
        (dict(min_p="0.1"), "sample: `min_p` must be a number or None; got '0.1'"),
        (dict(top_p=[0.9]), r"sample: `top_p` must be a number or None; got \[0.9\]"),
    ],
)
def test_bad_input_is_refused(changes, message):
    model, params = peaked_model()
    with pytest.raises((ValueError, TypeError), match=message):
        sampling.sample(model, params, PROMPTS, PROMPT_MASK, jax.random.key(0), **kwargs(**changes))


def test_empty_prompt_is_refused():
    model, params = peaked_model()
    mask = PROMPT_MASK.at[0].set(0)
    with pytest.raises(ValueError, match="every prompt needs at least one real token"):
        sampling.sample(model, params, PROMPTS, mask, jax.random.key(0), **kwargs())


@pytest.mark.parametrize("vocab", [1, 24, 37, 512, 1000, 151936])
def test_draw_inverts_the_cdf_of_the_weights(vocab):
    """The two-level draw against a float64 NumPy inverse CDF (``searchsorted``), on a
    grid of uniforms that includes 0 and the largest float32 below 1; zero weights
    (a whole block of them included) are never drawn, whether or not ``V`` is padded."""
    rng = np.random.default_rng(vocab)
    weights = rng.gamma(0.3, size=(4, vocab)).astype(np.float32)
    weights[:, rng.random(vocab) < 0.3] = 0.0
    weights[:, : min(vocab - 1, 2 * sampling.cdf_block(vocab))] = 0.0  # whole blocks of zeros
    weights[:, -1] = np.maximum(weights[:, -1], 1e-3)  # every row has some mass
    uniforms = np.concatenate([[0.0, np.nextafter(np.float32(1), np.float32(0))], rng.random(254)]).astype(np.float32)
    tokens = np.stack(
        [
            np.asarray(sampling.draw(jnp.asarray(uniforms), jnp.broadcast_to(jnp.asarray(row), (256, vocab))))
            for row in weights
        ]
    )  # [4, 256]
    for row, drawn in zip(weights, tokens):
        cdf = np.cumsum(row.astype(np.float64))
        targets = uniforms.astype(np.float64) * cdf[-1]
        expected = np.minimum(np.searchsorted(cdf, targets, side="right"), vocab - 1)
        # Away from a boundary of the CDF, float32 rounding cannot move the token.
        clear = np.min(np.abs(targets[:, None] - cdf[None, :]), axis=1) > 1e-6 * cdf[-1]
        assert clear.sum() > 150
        np.testing.assert_array_equal(drawn[clear], expected[clear])
        assert (row[drawn] > 0).all() and drawn.max() < vocab


def test_right_padded_prompts_are_refused_with_how_to_left_pad():
    """A Hugging Face tokenizer pads on the right by default; the sampler would continue
    each short prompt after its padding. Left padding is what it needs."""
    model, params = peaked_model()
    tokenizer = tasks.build_char_tokenizer(tasks.DIGITS_AND_OPERATORS)
    assert len(tokenizer) <= VOCAB
    texts = ["12+7=", "3+4="]
    tokenizer.padding_side = "right"
    right = tokenizer(texts, padding=True, return_tensors="np")
    with pytest.raises(
        ValueError,
        match=r"`prompt_mask` row 1 has padding at position 4, after a real token: "
        r"prompts must be left-padded.*tokenizer.padding_side = \"left\"",
    ):
        sampling.sample(model, params, right["input_ids"], right["attention_mask"], jax.random.key(0), **kwargs())
    hole = np.array([[1, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]])  # a pad between real tokens
    with pytest.raises(ValueError, match=r"row 0 has padding at position 1, after a real token"):
        sampling.sample(model, params, PROMPTS, hole, jax.random.key(0), **kwargs())
    tokenizer.padding_side = "left"
    left = tokenizer(texts, padding=True, return_tensors="np")
    rollout = sampling.sample(model, params, left["input_ids"], left["attention_mask"], jax.random.key(0), **kwargs())
    assert rollout.tokens.shape == (4, 5 + 9)


@pytest.mark.parametrize("bad", [-1, VOCAB, 1000])
def test_out_of_range_prompt_ids_are_refused_not_clamped(bad):
    model, params = peaked_model()
    prompts = np.array(PROMPTS)
    prompts[1, 2] = bad
    for given in (prompts, jnp.asarray(prompts)):  # host NumPy, or an eager jax.Array
        with pytest.raises(
            ValueError,
            match=rf"sample: `prompt_tokens` must hold token ids in \[0, {VOCAB}\) "
            rf"\(the vocabulary\); got \[{bad}\]",
        ):
            sampling.sample(model, params, given, PROMPT_MASK, jax.random.key(0), **kwargs())


@pytest.mark.parametrize("dtype, bad", [(np.float32, 2.0), (np.uint8, 255), (np.int32, -1)])
def test_prompt_masks_other_than_0_1_are_refused(dtype, bad):
    model, params = peaked_model()
    mask = np.asarray(PROMPT_MASK).astype(dtype)
    mask[1, 0] = bad
    with pytest.raises(ValueError, match=r"sample: `prompt_mask` must be boolean or 0/1; got values"):
        sampling.sample(model, params, PROMPTS, mask, jax.random.key(0), **kwargs())


@pytest.mark.parametrize("shape", [(0, 4), (3, 0)])
def test_empty_prompt_batches_are_refused(shape):
    model, params = peaked_model()
    with pytest.raises(
        ValueError,
        match=rf"sample: `prompt_tokens` is empty, shape \[{shape[0]}, {shape[1]}\]: "
        r"need at least one prompt of at least one token",
    ):
        sampling.sample(model, params, np.zeros(shape, np.int32), np.ones(shape, bool), jax.random.key(0), **kwargs())


def test_a_single_eos_id_may_be_an_int():
    """Hugging Face's ``generation_config.eos_token_id`` is an int or a list of ints."""
    model, params = peaked_model(eos_bias=3.0)
    expected = sampling.sample(model, params, PROMPTS, PROMPT_MASK, jax.random.key(0), **kwargs(eos_ids=(EOS,)))
    for eos in (EOS, np.int64(EOS), [EOS], np.array([EOS])):
        rollout = sampling.sample(model, params, PROMPTS, PROMPT_MASK, jax.random.key(0), **kwargs(eos_ids=eos))
        np.testing.assert_array_equal(rollout.tokens, expected.tokens)
    sampler = sampling.Sampler(model=model, eos_ids=EOS, pad_id=PAD)
    assert sampler.eos_ids == (EOS,)
    rollout = sampler(params, PROMPTS, PROMPT_MASK, jax.random.key(0), num_samples=2, max_new_tokens=9)
    np.testing.assert_array_equal(rollout.tokens, expected.tokens)


@pytest.mark.parametrize("eos", ["2", 2.0, (2, 2.5), True, [[2]], object()])
def test_eos_ids_that_are_not_ints_are_refused(eos):
    model, params = peaked_model()
    message = r"`eos_ids` must be a token id \(an int\) or a sequence of them; got "
    with pytest.raises(TypeError, match="sample: " + message):
        sampling.sample(model, params, PROMPTS, PROMPT_MASK, jax.random.key(0), **kwargs(eos_ids=eos))
    with pytest.raises(TypeError, match="Sampler: " + message):
        sampling.Sampler(model=model, eos_ids=eos, pad_id=PAD)


# --- min-p -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "top_k, top_p, min_p",
    [
        (None, None, 0.1),
        (None, None, 0.0),
        (None, None, 1.0),
        (10, None, 0.05),
        (None, 0.8, 0.2),
        (8, 0.9, 0.1),
        (None, 0.5, 0.01),
    ],
)
def test_filter_logits_matches_numpy_and_the_transformers_processors_in_their_order(top_k, top_p, min_p):
    """Under jit with traced ``top_p`` / ``min_p``, against the float64 reference and against
    transformers' warpers applied as ``generate`` applies them (``_get_logits_processor``:
    temperature, top-k, top-p, min-p)."""
    torch = pytest.importorskip("torch")
    from transformers.generation import logits_process

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((64, 40)) * rng.uniform(0.5, 4.0, size=(64, 1))).astype(np.float32)  # [B, V]
    filtered = np.asarray(
        jax.jit(lambda z, p, m: sampling.filter_logits(z, top_k=top_k, top_p=p, min_p=m))(logits, top_p, min_p)
    )
    kept = np.isfinite(filtered)
    np.testing.assert_array_equal(filtered[kept], logits[kept])
    np.testing.assert_array_equal(kept, reference_filter(logits, top_k=top_k, top_p=top_p, min_p=min_p))
    scores = torch.tensor(logits)
    if top_k is not None:
        scores = logits_process.TopKLogitsWarper(top_k)(None, scores)
    if top_p is not None:
        scores = logits_process.TopPLogitsWarper(top_p)(None, scores)
    scores = logits_process.MinPLogitsWarper(min_p)(None, scores)
    np.testing.assert_array_equal(kept, torch.isfinite(scores).numpy())
    assert kept.any(axis=1).all() and (min_p == 0.0 or (~kept).any())
    # Min-p first (vLLM's V1 order) is the same set without top-p, a smaller one with it.
    min_p_first = np.isfinite(
        np.asarray(
            sampling.filter_logits(sampling.filter_logits(jnp.asarray(logits), min_p=min_p), top_k=top_k, top_p=top_p)
        )
    )
    assert not (min_p_first & ~kept).any()
    assert np.array_equal(min_p_first, kept) == (top_p is None or min_p == 0.0)


@pytest.mark.parametrize("settings", [dict(min_p=0.5), dict(temperature=1.3, top_k=12, top_p=0.95, min_p=0.2)])
def test_sampling_logprobs_are_under_the_min_p_filtered_distribution(settings):
    """``sampling_logprobs`` = log softmax of the filtered ``logits / T`` at each drawn
    token and ``logprobs`` = log softmax of ``logits / T``, from full forward passes."""
    model, params = peaked_model(scale=3.0)
    rollout = sampling.sample(
        model, params, PROMPTS, PROMPT_MASK, jax.random.key(11), **kwargs(num_samples=4, **settings)
    )
    n, temperature = rollout.completion_mask.shape[1], settings.get("temperature", 1.0)
    logits = models.forward(model, params, rollout.tokens, attention_mask=rollout.attention_mask)
    scaled = logits[:, -n - 1 : -1].astype(jnp.float32) / temperature  # [B, N, V] predicting each completion token
    filtered = sampling.filter_logits(
        scaled.reshape(-1, VOCAB), top_k=settings.get("top_k"), top_p=settings.get("top_p"), min_p=settings["min_p"]
    ).reshape(scaled.shape)
    chosen = np.asarray(rollout.completion_tokens)[..., None]
    valid = np.asarray(rollout.completion_mask)
    expected = np.take_along_axis(np.asarray(jax.nn.log_softmax(filtered)), chosen, axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(rollout.sampling_logprobs)[valid], expected[valid], atol=1e-4)
    expected = np.take_along_axis(np.asarray(jax.nn.log_softmax(scaled)), chosen, axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(rollout.logprobs)[valid], expected[valid], atol=1e-4)
    assert (np.asarray(rollout.sampling_logprobs)[valid] > np.asarray(rollout.logprobs)[valid] + 1e-3).any()
    assert not np.asarray(rollout.sampling_logprobs)[~valid].any()


def test_min_p_is_traced_changing_it_does_not_recompile():
    model, params = peaked_model(scale=3.0)
    first = sampling.sample(model, params, PROMPTS, PROMPT_MASK, jax.random.key(0), **kwargs(min_p=0.05))
    compiled = sampling._generate._cache_size()
    rollouts = [
        sampling.sample(model, params, PROMPTS, PROMPT_MASK, jax.random.key(0), **kwargs(min_p=m))
        for m in (0.0, 0.3, np.float32(0.9), 1.0)
    ]
    assert sampling._generate._cache_size() == compiled
    assert not np.array_equal(first.tokens, rollouts[-1].tokens)  # the value reached the sampler
    traced = jax.jit(
        lambda p, m: sampling.sample(model, p, PROMPTS, PROMPT_MASK, jax.random.key(0), **kwargs(min_p=m))
    )(params, 0.3)  # min_p traced by an outer jit
    np.testing.assert_array_equal(traced.tokens, rollouts[1].tokens)


def test_sampler_binds_min_p_and_its_settings_are_checked_when_built():
    model, params = peaked_model(scale=3.0)
    sampler = sampling.Sampler(
        model=model, eos_ids=EOS, pad_id=PAD, sampling=sampling.SamplingConfig(top_k=8, min_p=0.2)
    )
    expected = sampling.sample(model, params, PROMPTS, PROMPT_MASK, jax.random.key(2), **kwargs(top_k=8, min_p=0.2))
    rollout = sampler(params, PROMPTS, PROMPT_MASK, jax.random.key(2), num_samples=2, max_new_tokens=9)
    np.testing.assert_array_equal(rollout.tokens, expected.tokens)
    np.testing.assert_array_equal(rollout.sampling_logprobs, expected.sampling_logprobs)
    for bad, message in (
        (dict(min_p=2.0), r"SamplingConfig: `min_p` must be in \[0.0, 1.0\]; got 2.0"),
        (dict(top_p=0.0), r"SamplingConfig: `top_p` must be in \(0.0, 1.0\]; got 0.0"),
        (dict(top_k=0), "SamplingConfig: `top_k` must be an integer >= 1; got 0"),
        (dict(temperature=-1.0), "SamplingConfig: `temperature` must be a finite number >= 0"),
        (dict(temperature=float("nan")), "SamplingConfig: `temperature` must be a finite number"),
        (dict(max_new_tokens=0), "SamplingConfig: `max_new_tokens` must be an integer >= 1"),
        (dict(max_prompt_length=2.5), "SamplingConfig: `max_prompt_length` must be an integer"),
        (
            dict(prompt_truncation="right"),
            "SamplingConfig: `prompt_truncation` must be one of 'error', 'left'; got 'right'",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            sampling.SamplingConfig(**bad)
    with pytest.raises(TypeError, match="Sampler: `sampling` must be a SamplingConfig; got"):
        sampling.Sampler(model=model, eos_ids=EOS, pad_id=PAD, sampling=dict(top_k=8))


# --- stop strings --------------------------------------------------------------------------


def host_rollout(tokenizer, rows, *, slots, prompt="1=", seed=0):
    """A host :class:`sampling.Rollout` from ``rows`` of ``(ids, stopped_by_eos, ids_after)``:
    the prompt, the completion ``ids`` (+ EOS), then ``ids_after`` beyond the valid length
    (what a sampler would never write there: it must survive untouched), then padding."""
    rng = np.random.default_rng(seed)
    prompt_ids = tokenizer.encode(prompt)
    completions, lengths, truncated = [], [], []
    for ids, ends, after in rows:
        valid = list(ids) + ([tokenizer.eos_token_id] if ends else [])
        row = (valid + list(after))[:slots]
        completions.append(row + [tokenizer.pad_token_id] * (slots - len(row)))
        lengths.append(min(len(valid), slots))
        truncated.append(not ends)
    completion = np.array(completions, np.int32)  # [B, N]
    lengths = np.array(lengths, np.int32)
    mask = np.arange(slots)[None, :] < lengths[:, None]  # [B, N]
    logprobs = np.where(mask, -rng.uniform(0.1, 3.0, size=mask.shape), 0.0).astype(np.float32)
    return sampling.Rollout(
        tokens=np.concatenate([np.tile(prompt_ids, (len(rows), 1)), completion], axis=1).astype(np.int32),
        attention_mask=np.concatenate([np.ones((len(rows), len(prompt_ids)), bool), mask], axis=1),
        completion_mask=mask,
        logprobs=logprobs,
        sampling_logprobs=logprobs / 2,
        lengths=lengths,
        truncated=np.array(truncated),
    )


def slow_stop_at_strings(rollout, tokenizer, stop_strings, pad_id):
    """Decodes every prefix of every row, shortest first, and cuts at the first with a stop string."""
    out = {name: np.array(value) for name, value in zip(sampling.Rollout._fields, rollout)}
    slots = out["completion_mask"].shape[1]
    start = out["tokens"].shape[1] - slots  # first completion column
    for b in range(len(out["lengths"])):
        ids = out["tokens"][b, start : start + out["lengths"][b]].tolist()
        for k in range(1, len(ids) + 1):
            if any(stop in tokenizer.decode(ids[:k], skip_special_tokens=True) for stop in stop_strings):
                out["tokens"][b, start + k :] = pad_id
                out["attention_mask"][b, start + k :] = False
                out["completion_mask"][b, k:] = False
                out["logprobs"][b, k:] = 0.0
                out["sampling_logprobs"][b, k:] = 0.0
                out["lengths"][b], out["truncated"][b] = k, False
                break
    return sampling.Rollout(**out)


def assert_rollouts_equal(got, expected):
    for name, a, b in zip(sampling.Rollout._fields, got, expected):
        assert isinstance(a, np.ndarray), name
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_stop_at_strings_cuts_after_the_token_that_completes_a_stop_string():
    tokenizer = tasks.build_char_tokenizer(tasks.DIGITS_AND_OPERATORS + "abc<>/")
    enc = tokenizer.encode
    stops = ("</a>", "7", "b c")
    rows = [
        (enc("12</a>34"), True, []),  # the stop spans four tokens: keep "12</a>", drop "34" and EOS
        (enc("7+1"), True, []),  # the stop is the first token
        (enc("1+2=3"), True, []),  # no stop: unchanged
        (enc("12"), True, enc("</a>7")),  # a stop after the EOS, beyond the valid length: unchanged
        (enc("ab</a>c12345"), False, []),  # hit the budget: cut, and no longer truncated
        (enc("99</a>"), True, []),  # completed by the last token before EOS: EOS dropped
        (enc("cab c"), True, []),  # a stop with a space in it
        (enc("a7</a>"), True, []),  # two stops: the one that ends first wins
    ]
    rollout = host_rollout(tokenizer, rows, slots=12)
    before = [np.array(x) for x in rollout]
    got = sampling.stop_at_strings(rollout, tokenizer=tokenizer, stop_strings=stops, pad_id=tokenizer.pad_token_id)
    np.testing.assert_array_equal(got.lengths, [6, 1, 6, 3, 6, 6, 5, 2])
    np.testing.assert_array_equal(got.truncated, False)
    texts = [tokenizer.decode(row[:n]) for row, n in zip(got.completion_tokens, got.lengths)]
    assert texts == ["12</a>", "7", "1+2=3<eos>", "12<eos>", "ab</a>", "99</a>", "cab c", "a7"]
    unchanged = [2, 3]
    for name, a, b in zip(sampling.Rollout._fields, got, before):
        if name != "truncated":
            np.testing.assert_array_equal(a[unchanged], b[unchanged], err_msg=name)
    assert tokenizer.decode(got.completion_tokens[3, 3:7]) == "</a>"  # after the EOS, left as it was
    for row in (0, 4, 5):
        n = got.lengths[row]
        assert (got.completion_tokens[row, n:] == tokenizer.pad_token_id).all()
        assert not got.completion_mask[row, n:].any() and not got.attention_mask[row, -12 + n :].any()
        assert not got.logprobs[row, n:].any() and not got.sampling_logprobs[row, n:].any()
        np.testing.assert_array_equal(got.logprobs[row, :n], before[3][row, :n])
    for a, b in zip(rollout, before):  # the input is not modified
        np.testing.assert_array_equal(a, b)
    assert_rollouts_equal(got, slow_stop_at_strings(rollout, tokenizer, stops, tokenizer.pad_token_id))
    one = sampling.stop_at_strings(rollout, tokenizer=tokenizer, stop_strings="</a>", pad_id=tokenizer.pad_token_id)
    assert_rollouts_equal(one, slow_stop_at_strings(rollout, tokenizer, ["</a>"], tokenizer.pad_token_id))


def byte_level_bpe():
    """A small byte-level BPE (GPT-2 style), trained here: multi-character tokens, and
    characters split over several byte tokens."""
    import transformers
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tokenizer_models

    backend = Tokenizer(tokenizer_models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = ["<answer>42</answer> done", "the answer is 7", "héllo wörld", "answers and questions"] * 20
    backend.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=330, special_tokens=["<pad>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def test_stop_at_strings_equals_the_slow_reference_on_byte_level_bpe():
    tokenizer = byte_level_bpe()
    pieces = ["<answer>", "42", "</answer>", " done", " héllo", " wörld", "ü", " the answer", " 7", "\n", "s"]
    stops = ("</answer>", "wö", "e a", "7\n")
    rng = np.random.default_rng(1)
    rows = []
    for _ in range(60):
        ids = tokenizer.encode("".join(rng.choice(pieces, size=rng.integers(1, 7))))[:16]  # may split a character
        after = tokenizer.encode("".join(rng.choice(pieces, size=3)))
        rows.append((ids, bool(rng.random() < 0.6) and len(ids) < 16, after))
    rollout = host_rollout(tokenizer, rows, slots=16, prompt="Q:", seed=1)
    got = sampling.stop_at_strings(rollout, tokenizer=tokenizer, stop_strings=stops, pad_id=tokenizer.pad_token_id)
    assert_rollouts_equal(got, slow_stop_at_strings(rollout, tokenizer, stops, tokenizer.pad_token_id))
    cut = got.lengths < rollout.lengths
    assert 10 < cut.sum() < 50
    # Some stops span tokens (the last kept token alone does not hold one), some end inside one.
    last = [tokenizer.decode(row[n - 1 : n]) for row, n in zip(got.completion_tokens[cut], got.lengths[cut])]
    assert any(not any(stop in text for stop in stops) for text in last)
    whole = [tokenizer.decode(row[:n]) for row, n in zip(got.completion_tokens[cut], got.lengths[cut])]
    assert any(not any(text.endswith(stop) for stop in stops) for text in whole)


def test_stop_at_strings_on_a_sampled_device_rollout_equals_the_slow_reference():
    tokenizer = tasks.build_char_tokenizer(tasks.DIGITS_AND_OPERATORS + "abc")
    assert len(tokenizer) == VOCAB and (tokenizer.eos_token_id, tokenizer.pad_token_id) == (EOS, PAD)
    model, params = peaked_model(scale=2.0, eos_bias=1.0)
    rollout = sampling.sample(model, params, PROMPTS, PROMPT_MASK, jax.random.key(3), **kwargs(num_samples=8))
    texts = tokenizer.batch_decode(
        [row[:n] for row, n in zip(np.asarray(rollout.completion_tokens), np.asarray(rollout.lengths))],
        skip_special_tokens=True,
    )
    pairs = [text[i : i + 2] for text in texts for i in range(len(text) - 1)]
    stops = [max(set(pairs), key=pairs.count), "c"]  # the commonest two-character string, and a character
    got = sampling.stop_at_strings(rollout, tokenizer=tokenizer, stop_strings=stops, pad_id=PAD)  # device arrays
    assert_rollouts_equal(got, slow_stop_at_strings(jax.device_get(rollout), tokenizer, stops, PAD))
    assert 0 < (got.lengths < np.asarray(rollout.lengths)).sum() < len(texts) - 2


@pytest.mark.parametrize(
    "changes, error, message",
    [
        (dict(stop_strings=""), ValueError, "`stop_strings` must be non-empty strings"),
        (dict(stop_strings=["a", ""]), ValueError, "`stop_strings` must be non-empty strings"),
        (dict(stop_strings=[]), ValueError, "`stop_strings` must name at least one stop string; got \\[\\]"),
        (dict(stop_strings=["a", 7]), TypeError, "`stop_strings` must hold strings; got 7"),
        (dict(stop_strings=b"</a>"), TypeError, "`stop_strings` must be a string or a sequence of strings"),
        (dict(stop_strings=None), TypeError, "`stop_strings` must be a string or a sequence of strings; got None"),
        (dict(tokenizer=None), TypeError, "`tokenizer` must have a `decode\\(ids, skip_special_tokens=True\\)` method"),
        (dict(pad_id=0.5), TypeError, "`pad_id` must be an integer token id; got 0.5"),
        (dict(rollout=()), TypeError, "`rollout` must be a sampling.Rollout; got tuple"),
        (
            dict(lengths=13),
            ValueError,
            r"`rollout.lengths` must have shape \[2\] with values in \[0, 12\]; got shape \[2\], values \[3, 13\]",
        ),
    ],
)
def test_stop_at_strings_refuses_bad_arguments(changes, error, message):
    tokenizer = tasks.build_char_tokenizer(tasks.DIGITS_AND_OPERATORS + "abc<>/")
    rollout = host_rollout(tokenizer, [(tokenizer.encode("12</a>"), True, []), ([5], False, [])], slots=12)
    arguments = {"rollout": rollout, "tokenizer": tokenizer, "stop_strings": ["</a>"], "pad_id": 0, **changes}
    if "lengths" in arguments:
        arguments["rollout"] = rollout._replace(lengths=np.array([3, arguments.pop("lengths")], np.int32))
    with pytest.raises(error, match="stop_at_strings: " + message):
        sampling.stop_at_strings(arguments.pop("rollout"), **arguments)
