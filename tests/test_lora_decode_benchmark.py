"""``benchmarks/lora_decode.py``'s methods at a toy shape: decoding with the adapters merged
(float32) gives the unmerged LoRA model's greedy tokens, and the adapters change them."""

import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
import lora_decode as bench  # noqa: E402
from layer_scan import qwen25_05b  # noqa: E402


def test_merged_and_unmerged_decode_the_same_tokens():
    # Qwen2's structure at toy widths (q/k/v biases, tied embeddings), adapters on all seven projections,
    # their B large enough that the adapted model's greedy tokens are not the base's.
    work = bench.workload(qwen25_05b(2, tiny=True), prompts=2, samples=2, new_tokens=12, rank=4, adapter_std=0.5)
    runs = bench.methods(work)
    unmerged, _ = runs["unmerged"]()
    merged, merge_s = runs["merged f32"]()
    base, _ = runs["base"]()
    tokens = np.asarray(unmerged.completion_tokens)
    assert tokens.shape == (4, 12) and int(unmerged.lengths.min()) > 0
    np.testing.assert_array_equal(np.asarray(merged.completion_tokens), tokens)
    assert bench.agreement(unmerged, base) < 0.5  # the adapters matter: the check above could fail
    assert merge_s > 0
