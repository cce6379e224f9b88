"""One GRPO optimizer step of TRL's ``GRPOTrainer`` (PyTorch, on the CPU, or on a GPU where
torch sees one): the side-by-side reference for ``grpo_step.py``. Run it with ``make
bench-trl``, which builds its own venv (``.venv-trl``, from ``benchmarks/trl/requirements.txt``);
this file imports no JAX.

Configuration (``--shape tiny``, the default, grpo_step.py's): a random Llama-style model,
4 layers, d_model 256, 4 heads of 64 (4 KV heads), MLP 1024, vocab 512, untied output
layer, float32; 8 prompts x 4 completions per optimizer step, prompt 16 tokens, completion
32 tokens. ``--shape qwen05b``: transformers' ``Qwen2ForCausalLM`` with Qwen2.5-0.5B's sizes
(24 layers, hidden 896, 14 query / 2 KV heads of 64, MLP 4864, vocab 151,936, tied
embeddings, q/k/v biases, RoPE theta 1e6), random weights, float32; 2 prompts x 4, prompt
32, completion 64. ``--shape gpu`` (``gpu_side_by_side.py``'s): the same model, 16 prompts x 8,
prompt 128, completion 256, mixed precision, and the backward pass in two micro-batches of 64
(``per_device_train_batch_size`` 64, 2 gradient-accumulation steps: the same gradient, at
about the memory an 80 GB GPU has). ``--layers``, ``--group-size`` and ``--new-tokens``
override the shape's (``side_by_side.py``'s scaling curves). ``--precision``: ``float32``
(the CPU shapes' default) or ``mixed``, TRL's ``bf16=True`` (float32 weights, bfloat16
autocast). All: beta 0.04 (so the reference model runs), mu = 1, temperature 1.0, plain
``generate`` (no vLLM), no gradient checkpointing. One optimizer step is one generation
round (``per_device_train_batch_size`` times the accumulation steps is all ``P x G``
completions) and its backward pass over all of them (our single minibatch), and no extra
"old" log-prob pass runs. The
tokenizer is a word-level one (token i is the word ``w{i:03d}``; pad ``w000``, EOS the
last id, as in grpo_step.py), so a prompt of 16 words is 16 tokens, and
``min_new_tokens`` keeps EOS from ending any completion early. The reward is the parity
of the first completion token, computed on the host.

A ``TrainerCallback`` times each optimizer step (``on_step_begin`` to ``on_step_end``, on a
GPU each mark after a ``torch.cuda.synchronize()``:
generation, scoring, loss forward and backward, gradient clipping, the AdamW step). The
split wraps the trainer's own methods and maps onto grpo_step.py's phases:

* rollout: ``_generate`` (tokenise, ``generate``, decode) and ``_calculate_rewards``;
* logprobs: the rest of ``_generate_and_score_completions``: the reference model's
  forward pass (``_get_per_token_logps_and_entropies`` on ``ref_model``, also shown
  alone) and the advantages;
* update: the rest of the step (the policy's forward and backward pass, the optimizer).

On a 2-core machine the step times are noisy (and anything else running skews them); the
minimum shows an undisturbed step. The first step (``first_step_s``; TRL compiles nothing,
so it is mostly allocator and thread-pool warm-up) is left out of the medians, like the
second; ``to_first_step_s`` counts from the process's start, imports and model loading
included. ``peak_device_gb`` is ``torch.cuda.max_memory_allocated()`` on a GPU (``None`` on
the CPU). The last line of output is one JSON object (``side_by_side.py`` reads it).

    .venv-trl/bin/python benchmarks/trl_grpo_step.py [--shape tiny|qwen05b|gpu] [--repeats 10]
                                                     [--precision float32|mixed] [--layers L]
                                                     [--group-size G] [--new-tokens N]
"""

from __future__ import annotations

import time

PROCESS_STARTED = time.perf_counter()  # before the imports: they count toward the first step

import os  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: nothing is fetched
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import dataclasses  # noqa: E402
import functools  # noqa: E402
import tempfile  # noqa: E402
import warnings  # noqa: E402
from collections import defaultdict  # noqa: E402

import step_report  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    TrainerCallback,
)
from transformers.trainer_callback import PrinterCallback, ProgressCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

CUDA = torch.cuda.is_available()
SYNC = torch.cuda.synchronize if CUDA else (lambda: None)  # GPU work is asynchronous: wait before each mark


def qwen25_05b() -> Qwen2Config:
    """Qwen2.5-0.5B's sizes, random weights; EOS the last id."""
    return Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=151935,
    )


SHAPES = {
    "tiny": dict(
        model=LlamaForCausalLM,
        prompts=8,
        group=4,
        prompt_len=16,
        new_tokens=32,
        config=lambda: LlamaConfig(
            vocab_size=512,
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=64,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
            pad_token_id=0,
            bos_token_id=None,
            eos_token_id=511,
        ),
    ),
    "qwen05b": dict(model=Qwen2ForCausalLM, prompts=2, group=4, prompt_len=32, new_tokens=64, config=qwen25_05b),
    "gpu": dict(
        model=Qwen2ForCausalLM,
        prompts=16,
        group=8,
        prompt_len=128,
        new_tokens=256,
        config=qwen25_05b,
        precision="mixed",
        micro_batch=64,
    ),
}
WARMUP = 2  # optimizer steps not counted (allocator and thread-pool warm-up)
PHASES = ("rollout", "logprobs", "reference", "update", "step")


def word(token_id: int) -> str:
    return f"w{token_id:03d}"


def make_tokenizer(config) -> PreTrainedTokenizerFast:
    """A word-level tokenizer, built offline: token i is the word ``w{i:03d}``, no BOS."""
    vocab = {word(i): i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=word(config.pad_token_id)))  # no unknown words occur
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=word(config.pad_token_id),
        eos_token=word(config.eos_token_id),
        padding_side="left",
    )


def make_dataset(config, rows: int, prompt_len: int) -> Dataset:
    """``rows`` prompts of ``prompt_len`` random words, neither pad nor EOS."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, config.eos_token_id, (rows, prompt_len), generator=generator)
    return Dataset.from_dict({"prompt": [" ".join(word(int(i)) for i in row) for row in ids]})


def make_parity_reward(new_tokens: int):
    def parity_reward(completions, completion_ids, **kwargs) -> list[float]:  # TRL logs rewards by __name__
        """A stand-in verifier on the host: the parity of the first completion token."""
        assert all(len(ids) == new_tokens for ids in completion_ids), "a completion ended early"
        return [float(ids[0] % 2) for ids in completion_ids]

    return parity_reward


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
            SYNC()
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                SYNC()
                self.current[phase] += time.perf_counter() - start

        setattr(obj, name, timed)

    def on_step_begin(self, args, state, control, **kwargs):
        SYNC()
        self.current = defaultdict(float)
        self.current["begin"] = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        SYNC()
        now = time.perf_counter()
        self.current["step"] = now - self.current.pop("begin")
        self.current["since_start"] = now - PROCESS_STARTED
        self.steps.append(dict(self.current))


def main(argv=None) -> None:
    args, shape = step_report.parse(__doc__.split("\n\n")[0], SHAPES, argv, precision=True)
    config = shape["config"]()
    if args.layers is not None:
        config.num_hidden_layers = args.layers
    prompts, prompt_len, group, new_tokens = shape["prompts"], shape["prompt_len"], args.group_size, args.new_tokens
    micro_batch = min(shape.get("micro_batch", prompts * group), prompts * group)
    if (prompts * group) % micro_batch:
        raise SystemExit(f"{prompts} x {group} completions do not split into micro-batches of {micro_batch}")
    # Off under each name the installed versions have: TRL turns gradient_checkpointing on by default, and
    # transformers 5.2x calls it activation_checkpointing.
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    checkpointing = {name: False for name in ("activation_checkpointing", "gradient_checkpointing") if name in names}

    torch.set_num_threads(os.cpu_count())
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # TRL reads transformers' deprecated names
    torch.manual_seed(0)
    tokenizer = make_tokenizer(config)
    assert all(
        len(ids) == prompt_len
        for ids in tokenizer(list(make_dataset(config, prompts, prompt_len)["prompt"]))["input_ids"]
    )

    with tempfile.TemporaryDirectory() as tmp:
        # TRL builds the reference model from the policy's path (config._name_or_path), so
        # the random model is saved first and the trainer loads both models from there.
        model_dir = os.path.join(tmp, "model")
        shape["model"](config).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        trl_config = GRPOConfig(
            output_dir=os.path.join(tmp, "out"),
            max_steps=WARMUP + args.repeats,
            seed=0,
            use_cpu=not CUDA,
            per_device_train_batch_size=micro_batch,
            gradient_accumulation_steps=prompts * group // micro_batch,
            num_generations=group,
            max_completion_length=new_tokens,
            generation_kwargs={"min_new_tokens": new_tokens},
            temperature=1.0,
            beta=0.04,
            num_iterations=1,
            use_vllm=False,
            **checkpointing,
            bf16=args.precision == "mixed",
            fp16=False,
            report_to="none",
            logging_strategy="no",
            save_strategy="no",
            disable_tqdm=True,
        )
        trainer = GRPOTrainer(
            model=model_dir,
            reward_funcs=make_parity_reward(new_tokens),
            args=trl_config,
            train_dataset=make_dataset(config, prompts * (WARMUP + args.repeats), prompt_len),
            processing_class=tokenizer,
        )
        trainer.remove_callback(PrinterCallback)  # the end-of-training metrics dict
        trainer.remove_callback(ProgressCallback)
        timer = StepTimer()
        trainer.add_callback(timer)
        timer.wrap(trainer, "_generate", "rollout")
        timer.wrap(trainer, "_calculate_rewards", "rollout")
        timer.wrap(trainer, "_generate_and_score_completions", "scoring")
        timer.wrap(
            trainer,
            "_get_per_token_logps_and_entropies",
            "reference",
            when=lambda model, *args, **kwargs: model is trainer.ref_model,
        )
        assert trainer.ref_model is not None and not any(getattr(trainer.args, f) for f in checkpointing)
        assert not trainer.model.is_gradient_checkpointing
        trainer.train()

    assert len(timer.steps) == WARMUP + args.repeats
    for step in timer.steps:  # the three phases partition the step
        step["logprobs"] = step["scoring"] - step["rollout"]
        step["update"] = step["step"] - step["scoring"]

    model = trainer.model
    device = torch.cuda.get_device_name(0) if CUDA else "cpu"
    print(
        f"torch {torch.__version__} ({device}, {torch.get_num_threads()} threads), trl {trl.__version__}, "
        f"transformers {transformers.__version__}; {step_report.PRECISIONS[args.precision]} (loaded as {model.dtype}), "
        f"attention {model.config._attn_implementation}, optimizer {type(trainer.optimizer.optimizer).__name__}"
    )
    print(
        f"TRL GRPOTrainer step ({args.shape}): {prompts} prompts x {group} completions, prompt {prompt_len}, "
        f"completion {new_tokens}; {config.num_hidden_layers} layers, d_model {config.hidden_size}, vocab "
        f"{config.vocab_size}; {args.repeats} steps after {WARMUP} warm-up"
    )
    lib = step_report.versions("trl", "torch", "transformers", "accelerate", "datasets")
    if torch.version.cuda:
        lib["cuda"] = torch.version.cuda
    results = {
        "library": "trl",
        "shape": args.shape,
        "versions": lib,
        "prompts": prompts,
        "group": group,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "layers": config.num_hidden_layers,
        "params": sum(p.numel() for p in model.parameters()),
        "repeats": args.repeats,
        "warmup": WARMUP,
        "precision": args.precision,
        "weights_dtype": str(model.dtype).removeprefix("torch."),
        "micro_batch": micro_batch,
        "device": device,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "peak_device_gb": torch.cuda.max_memory_allocated() / 1e9 if CUDA else None,
        "peak_device_reserved_gb": torch.cuda.max_memory_reserved() / 1e9 if CUDA else None,
    }
    step_report.finish(results, timer.steps, warmup=WARMUP, phases=PHASES)


if __name__ == "__main__":
    main()
