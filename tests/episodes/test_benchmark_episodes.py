"""``benchmarks/episodes.py``'s two methods, continuing the KV cache across turns and
re-prefilling the conversation every turn (TRL's loop), run the same scripted episodes."""

import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmarks"))
import episodes as bench  # noqa: E402
from layer_scan import qwen25_05b  # noqa: E402


def test_both_methods_write_the_scripted_episodes():
    # Qwen2's structure at toy widths: tied embeddings (the script read through them), q/k/v biases.
    work = bench.workload(qwen25_05b(2, tiny=True), prompts=2, group=2, turns=2, filler=3, result_len=5, system=6)
    continued, reprefilled = bench.continued(work), bench.reprefilled(work)
    assert continued.ids == reprefilled.ids
    np.testing.assert_array_equal(continued.model_tokens, reprefilled.model_tokens)
    np.testing.assert_array_equal(continued.turns, 3)  # two rounds, then a call left unanswered
    np.testing.assert_array_equal(reprefilled.turns, 3)
    turn = f"<f0><f1><f2><tool_call>{bench.LOOKUP_CALL}</tool_call><eos>"
    expected = f"{turn}<|tool|>78901<eos><|assistant|>" * 2 + turn
    assert all(work.tokenizer.decode(ids, skip_special_tokens=False) == expected for ids in continued.ids)
    np.testing.assert_array_equal(continued.model_tokens, 3 * 7)
