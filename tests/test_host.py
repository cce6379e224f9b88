"""host.reuse_freed_memory: XLA's per-call temporaries stop being faulted in afresh each call.
host.full_collections_deferred: full collections put off inside, the caller's thresholds after."""

import gc
import subprocess
import sys

import jax
import pytest

from jaxrl_llm import algorithms, host, models, training
from jaxrl_llm.sampling import SamplingConfig
from jaxrl_llm.tasks import DigitSumTask

# In a fresh process (the setting must precede JAX's CPU backend): faults per call of a
# jitted gradient whose temporaries (the [2**14, 1024] float32 hidden layer and its
# cotangent, 64 MB each; narrow inputs keep the matmuls cheap) live in one block allocated by
# each call.
SCRIPT = """
import resource, sys
from jaxrl_llm import host
applied = host.reuse_freed_memory() if sys.argv[1] == "reuse" else False
import jax, jax.numpy as jnp
def loss(w, x):
    return jnp.mean(jnp.square(jnp.tanh(x @ w[0]) @ w[1]))
grad = jax.jit(jax.grad(loss))
x, w = jnp.ones((2**14, 16)), (jnp.ones((16, 1024)) / 16, jnp.ones((1024, 16)) / 1024)
faults = []
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jax.block_until_ready(grad(w, x))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, sorted(faults[10:])[5])  # the median call once the heap has grown to its size
"""
HIDDEN_PAGES = 2**14 * 1024 * 4 // 4096


def median_faults_per_call(mode: str) -> tuple[bool, float]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True).stdout
    applied, faults = out.split()
    return applied == "True", float(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_temporaries_are_reused_instead_of_faulted_in_every_call():
    applied, faults = median_faults_per_call("reuse")
    assert applied
    assert faults < 0.05 * HIDDEN_PAGES
    _, default_faults = median_faults_per_call("default")
    assert default_faults > HIDDEN_PAGES  # what the setting saves: more than the hidden layer, page by page


@pytest.fixture
def default_thresholds():
    """CPython's default thresholds for the test (the suite runs with full collections deferred)."""
    suites = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    if gc.get_threshold() != (700, 10, 10):
        gc.set_threshold(*suites)
        pytest.skip("this Python's collector has no third threshold (3.14's incremental one)")
    yield (700, 10, 10)
    gc.set_threshold(*suites)


def test_full_collections_are_deferred_inside_and_the_thresholds_restored_after(default_thresholds):
    with host.full_collections_deferred():
        assert gc.get_threshold() == (700, 10, host.FULL_COLLECTION_THRESHOLD)
        with host.full_collections_deferred():  # nested: the outer block's deferral stays
            pass
        assert gc.get_threshold() == (700, 10, host.FULL_COLLECTION_THRESHOLD)
        gc.set_threshold(500, 20, host.FULL_COLLECTION_THRESHOLD)  # younger ones changed inside: kept
    assert gc.get_threshold() == (500, 20, 10)
    gc.set_threshold(*default_thresholds)
    with pytest.raises(KeyError), host.full_collections_deferred():
        raise KeyError("an error inside")
    assert gc.get_threshold() == default_thresholds
    gc.set_threshold(700, 10, 5000)  # a caller's own, already rarer: kept
    with host.full_collections_deferred():
        assert gc.get_threshold() == (700, 10, 5000)


def test_train_runs_its_steps_with_full_collections_deferred(default_thresholds):
    task = DigitSumTask()
    config = models.ModelConfig(
        vocab_size=len(task.tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=32,
    )
    model, params = models.init(config, jax.random.key(0))
    run = training.TrainConfig(num_prompts=2, group_size=2, sampling=SamplingConfig(max_new_tokens=2))
    during = []
    training.train(
        model, params, algorithms.GRPO, run, steps=2, task=task, callback=lambda end: during.append(gc.get_threshold())
    )
    assert during == [(700, 10, host.FULL_COLLECTION_THRESHOLD)] * 2 and gc.get_threshold() == default_thresholds

    def stop(end):
        raise RuntimeError("stopped by the callback")

    with pytest.raises(training.RunStopped):
        training.train(model, params, algorithms.GRPO, run, steps=2, task=task, callback=stop)
    assert gc.get_threshold() == default_thresholds
