"""TRL 1.16's ``GRPOTrainer`` on SmolLM2-135M-Instruct: the TRL side of ``real_model.py``, run
in ``.venv-trl`` (``make .venv-trl/.installed``); this file imports no JAX.

The model is the GGUF file ``make model`` fetches, dequantized to float32 by transformers
(``from_pretrained(dir, gguf_file=...)``) and copied into a plain ``LlamaForCausalLM``, which
transformers will train and save (a GGUF-loaded model it refuses to save). The prompts are the
JSONL file ``real_model.py`` writes from jaxrl_llm's arithmetic task (``prompt``: the question,
``answer``: the sum), given to TRL in its conversational form, so the tokenizer's chat template
renders them as jaxrl_llm's does. The reward is ``real_model_reward.correct``, the same function
jaxrl_llm's run scores with.

The settings are those of ``experiments/configs/default.toml`` in TRL's names: 8 prompts x 8
completions a step (``per_device_train_batch_size`` 64, one optimizer step a generation
batch), at most 24 new tokens, temperature 1, GRPO's loss (``loss_type="grpo"``: each
sequence's token mean, then the mean over sequences), rewards scaled by the group's std
(TRL's own convention; jaxrl_llm runs with ``--conventions trl`` to match), no KL term
(``beta`` 0), AdamW at 5e-6 with a constant rate, gradient-norm clip 1, float32, no gradient
checkpointing (jaxrl_llm's default; TRL's own default turns it on: slower, less memory).

Writes ``OUT/result.json`` (per step: seconds, reward, completion length; the process's wall
time, its peak RSS) and the trained model to ``OUT/model`` (safetensors, with the tokenizer),
which ``real_model.py`` evaluates with jaxrl_llm's evaluator, as it does jaxrl_llm's own.

    .venv-trl/bin/python benchmarks/trl_real_model.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf
        --data DIR/train.jsonl --steps 30 --seed 0 --out DIR/trl-0
"""

from __future__ import annotations

import time

PROCESS_STARTED = time.perf_counter()

import os  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import resource  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from real_model_reward import correct  # noqa: E402
from transformers.trainer_callback import PrinterCallback, ProgressCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl_grpo_step import StepTimer  # noqa: E402

NUM_PROMPTS, GROUP, NEW_TOKENS, LEARNING_RATE = 8, 8, 24, 5e-6


def trainable_model(path: pathlib.Path) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """The GGUF checkpoint as a plain float32 model transformers trains and saves, and its tokenizer."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=pathlib.Path, required=True, help="the GGUF file")
    parser.add_argument("--data", type=pathlib.Path, required=True, help="the prompts: JSONL of prompt and answer")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args(argv)

    torch.set_num_threads(os.cpu_count())
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    model, tokenizer = trainable_model(args.model)
    rows = [json.loads(line) for line in args.data.read_text().splitlines()]
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": row["prompt"]}], "answer": row["answer"]} for row in rows]
    )
    config = GRPOConfig(
        output_dir=str(args.out / "trainer"),
        max_steps=args.steps,
        seed=args.seed,
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=NUM_PROMPTS * GROUP,
        gradient_accumulation_steps=1,
        num_generations=GROUP,
        max_completion_length=NEW_TOKENS,
        temperature=1.0,
        beta=0.0,
        loss_type="grpo",
        scale_rewards="group",
        num_iterations=1,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        gradient_checkpointing=False,
        use_vllm=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=correct, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    timer = StepTimer()
    trainer.add_callback(timer)
    trainer.train()
    trainer.save_model(str(args.out / "model"))
    tokenizer.save_pretrained(args.out / "model")

    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    steps = [
        {
            "step": index,
            "seconds": timing["step"],
            "reward": entry["reward"],
            "length": entry.get("completions/mean_length"),
        }
        for index, (timing, entry) in enumerate(zip(timer.steps, logged))
    ]
    result = {
        "library": "trl",
        "seed": args.seed,
        "steps": steps,
        "wall_seconds": time.perf_counter() - PROCESS_STARTED,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "versions": {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "threads": torch.get_num_threads(),
    }
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({key: value for key, value in result.items() if key != "steps"}))


if __name__ == "__main__":
    main()
