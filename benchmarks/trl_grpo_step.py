"""One GRPO optimizer step of TRL's ``GRPOTrainer`` (PyTorch, CPU): the side-by-side
reference for ``grpo_step.py``. Run it with ``make bench-trl``, which builds its own venv
(``.venv-trl``, from ``benchmarks/trl/requirements.txt``); this file imports no JAX.

Configuration (grpo_step.py's): a random Llama-style model, 4 layers, d_model 256, 4 heads
of 64 (4 KV heads), MLP 1024, vocab 512, untied output layer, float32; 8 prompts x 4
completions per optimizer step, prompt 16 tokens, completion 32 tokens, beta 0.04 (so the
reference model runs), mu = 1, temperature 1.0, plain ``generate`` (no vLLM), no gradient
checkpointing, no mixed precision. ``per_device_train_batch_size`` 32 with no gradient
accumulation makes one optimizer step one generation round and one backward pass over all
32 completions (our single minibatch), and no extra "old" log-prob pass runs. The
tokenizer is a word-level one over ``w000`` ... ``w511`` (token i is ``w{i:03d}``; pad
``w000``, EOS ``w511``, as in grpo_step.py), so a prompt of 16 words is 16 tokens, and
``min_new_tokens`` keeps EOS from ending any completion before 32 tokens. The reward is
the parity of the first completion token, computed on the host.

A ``TrainerCallback`` times each optimizer step (``on_step_begin`` to ``on_step_end``:
generation, scoring, loss forward and backward, gradient clipping, the AdamW step). The
split wraps the trainer's own methods and maps onto grpo_step.py's phases:

* rollout: ``_generate`` (tokenise, ``generate``, decode) and ``_calculate_rewards``;
* logprobs: the rest of ``_generate_and_score_completions``: the reference model's
  forward pass (``_get_per_token_logps_and_entropies`` on ``ref_model``, also shown
  alone) and the advantages;
* update: the rest of the step (the policy's forward and backward pass, the optimizer).

On a 2-core machine the step times are noisy (and anything else running skews them); the
minimum shows an undisturbed step.

    .venv-trl/bin/python benchmarks/trl_grpo_step.py [--repeats 10]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: nothing is fetched
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import argparse
import functools
import statistics
import tempfile
import time
import warnings
from collections import defaultdict

import torch
import transformers
import trl
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from trl import GRPOConfig, GRPOTrainer

CONFIG = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
                     tie_word_embeddings=False, pad_token_id=0, bos_token_id=None, eos_token_id=511)
PROMPTS, GROUP, PROMPT_LEN, NEW_TOKENS = 8, 4, 16, 32
WARMUP = 2  # optimizer steps not counted (allocator and thread-pool warm-up)
PHASES = ("rollout", "logprobs", "reference", "update", "step")


def word(token_id: int) -> str:
    return f"w{token_id:03d}"


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer, built offline: token i is the word ``w{i:03d}``, no BOS."""
    vocab = {word(i): i for i in range(CONFIG.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=word(CONFIG.pad_token_id)))  # no unknown words occur
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=word(CONFIG.pad_token_id),
                                   eos_token=word(CONFIG.eos_token_id), padding_side="left")


def make_dataset(rows: int) -> Dataset:
    """``rows`` prompts of ``PROMPT_LEN`` random words, neither pad nor EOS."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, CONFIG.eos_token_id, (rows, PROMPT_LEN), generator=generator)
    return Dataset.from_dict({"prompt": [" ".join(word(int(i)) for i in row) for row in ids]})


def parity_reward(completions, completion_ids, **kwargs) -> list[float]:
    """A stand-in verifier on the host: the parity of the first completion token."""
    assert all(len(ids) == NEW_TOKENS for ids in completion_ids), "a completion ended early"
    return [float(ids[0] % 2) for ids in completion_ids]


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step and of the trainer methods wrapped by :meth:`wrap`."""

    def __init__(self):
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, obj, name: str, phase: str, when=lambda *args, **kwargs: True) -> None:
        """Add the time of ``obj.name(...)`` calls for which ``when(...)`` holds to ``phase``."""
        method = getattr(obj, name)

        @functools.wraps(method)
        def timed(*args, **kwargs):
            if not when(*args, **kwargs):
                return method(*args, **kwargs)
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.current[phase] += time.perf_counter() - start

        setattr(obj, name, timed)

    def on_step_begin(self, args, state, control, **kwargs):
        self.current = defaultdict(float)
        self.current["begin"] = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.current["step"] = time.perf_counter() - self.current.pop("begin")
        self.steps.append(dict(self.current))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)

    torch.set_num_threads(os.cpu_count())
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # TRL reads transformers' deprecated names
    torch.manual_seed(0)
    tokenizer = make_tokenizer()
    assert all(len(ids) == PROMPT_LEN for ids in tokenizer(list(make_dataset(PROMPTS)["prompt"]))["input_ids"])

    with tempfile.TemporaryDirectory() as tmp:
        # TRL builds the reference model from the policy's path (config._name_or_path), so
        # the random model is saved first and the trainer loads both models from there.
        model_dir = os.path.join(tmp, "model")
        LlamaForCausalLM(CONFIG).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        config = GRPOConfig(
            output_dir=os.path.join(tmp, "out"), max_steps=WARMUP + args.repeats, seed=0, use_cpu=True,
            per_device_train_batch_size=PROMPTS * GROUP, gradient_accumulation_steps=1, num_generations=GROUP,
            max_completion_length=NEW_TOKENS, generation_kwargs={"min_new_tokens": NEW_TOKENS}, temperature=1.0,
            beta=0.04, num_iterations=1, use_vllm=False, activation_checkpointing=False, bf16=False, fp16=False,
            report_to="none", logging_strategy="no", save_strategy="no", disable_tqdm=True,
        )
        trainer = GRPOTrainer(model=model_dir, reward_funcs=parity_reward, args=config,
                              train_dataset=make_dataset(PROMPTS * (WARMUP + args.repeats)),
                              processing_class=tokenizer)
        trainer.remove_callback(PrinterCallback)  # the end-of-training metrics dict
        trainer.remove_callback(ProgressCallback)
        timer = StepTimer()
        trainer.add_callback(timer)
        timer.wrap(trainer, "_generate", "rollout")
        timer.wrap(trainer, "_calculate_rewards", "rollout")
        timer.wrap(trainer, "_generate_and_score_completions", "scoring")
        timer.wrap(trainer, "_get_per_token_logps_and_entropies", "reference",
                   when=lambda model, *args, **kwargs: model is trainer.ref_model)
        assert trainer.ref_model is not None and not trainer.args.activation_checkpointing
        trainer.train()

    steps = timer.steps[WARMUP:]
    assert len(steps) == args.repeats
    for step in steps:  # the three phases partition the step
        step["logprobs"] = step["scoring"] - step["rollout"]
        step["update"] = step["step"] - step["scoring"]

    model = trainer.model
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), trl {trl.__version__}, "
          f"transformers {transformers.__version__}; {model.dtype}, attention {model.config._attn_implementation}, "
          f"optimizer {type(trainer.optimizer.optimizer).__name__}")
    print(f"TRL GRPOTrainer step: {PROMPTS} prompts x {GROUP} completions, prompt {PROMPT_LEN}, completion "
          f"{NEW_TOKENS}; {CONFIG.num_hidden_layers} layers, d_model {CONFIG.hidden_size}, vocab "
          f"{CONFIG.vocab_size}; {args.repeats} steps after {WARMUP} warm-up")
    header = f"{'phase':<12} {'median s':>9} {'min s':>8} {'share':>7}"
    print(header)
    print("-" * len(header))
    step_s = statistics.median(step["step"] for step in steps)
    for phase in PHASES:
        times = [step[phase] for step in steps]
        label = "  reference" if phase == "reference" else phase  # a part of logprobs
        print(f"{label:<12} {statistics.median(times):>9.4f} {min(times):>8.4f} "
              f"{statistics.median(times) / step_s:>6.0%}")


if __name__ == "__main__":
    main()
