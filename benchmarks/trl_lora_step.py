"""TRL's ``GRPOTrainer`` at the Qwen2.5-0.5B shape, full training or PEFT LoRA, bfloat16:
``lora_memory.py``'s side-by-side measurement (run it in ``.venv-trl`` with ``peft``
installed; this file imports no JAX).

The work is ``lora_memory.py``'s run part: transformers' ``Qwen2ForCausalLM`` with
Qwen2.5-0.5B's sizes and random weights (``trl_grpo_step.py``'s ``qwen05b`` config,
tokenizer, prompts and parity reward), loaded in bfloat16
(``model_init_kwargs={"dtype": torch.bfloat16}``), 2 prompts x 2 completions, prompt 32,
completion 32 (``min_new_tokens``), beta 0.04, mu 1, one optimizer step per generation
round, plain ``generate``, no gradient checkpointing, learning rate 1e-6. ``--method
lora`` passes ``peft_config=LoraConfig(r=16, lora_alpha=32,
target_modules="all-linear")``: PEFT keeps the adapters in float32 over the bfloat16
base (its ``autocast_adapter_dtype``), and TRL's reference is the base with the adapters
disabled (no reference model). ``--method full`` trains every weight in bfloat16 (AdamW's
moments in bfloat16 too: no float32 master copy) beside a bfloat16 reference model.

The last line is one JSON object: the step times (``trl_grpo_step.StepTimer``; the first
step left out of the median) and the process's peak resident memory (``VmHWM``).

    .venv-trl/bin/python benchmarks/trl_lora_step.py --method full|lora [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import tempfile
import warnings

import step_report
import torch
import transformers
import trl_grpo_step as base
from peft import LoraConfig
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from trl import GRPOConfig, GRPOTrainer

PROMPTS, GROUP, PROMPT_LEN, NEW_TOKENS = 2, 2, 32, 32  # lora_memory.RUN_BATCH


def vm_hwm_bytes() -> int:
    """This process's peak resident memory: ``VmHWM`` of ``/proc/self/status`` (kB)."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", choices=("full", "lora"), required=True)
    parser.add_argument("--repeats", type=int, default=2, help="timed steps after the first")
    args = parser.parse_args(argv)
    shape = base.SHAPES["qwen05b"]
    config = shape["config"]()
    torch.set_num_threads(os.cpu_count())
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.manual_seed(0)
    tokenizer = base.make_tokenizer(config)
    steps = 1 + args.repeats
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        shape["model"](config).to(torch.bfloat16).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        trl_config = GRPOConfig(
            output_dir=os.path.join(tmp, "out"),
            max_steps=steps,
            seed=0,
            use_cpu=True,
            model_init_kwargs={"dtype": torch.bfloat16},
            per_device_train_batch_size=PROMPTS * GROUP,
            gradient_accumulation_steps=1,
            num_generations=GROUP,
            max_completion_length=NEW_TOKENS,
            generation_kwargs={"min_new_tokens": NEW_TOKENS},
            temperature=1.0,
            beta=0.04,
            num_iterations=1,
            learning_rate=1e-6,
            use_vllm=False,
            activation_checkpointing=False,
            report_to="none",
            logging_strategy="no",
            save_strategy="no",
            disable_tqdm=True,
        )
        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear") if args.method == "lora" else None
        trainer = GRPOTrainer(
            model=model_dir,
            reward_funcs=base.make_parity_reward(NEW_TOKENS),
            args=trl_config,
            train_dataset=base.make_dataset(config, PROMPTS * steps, PROMPT_LEN),
            processing_class=tokenizer,
            peft_config=peft_config,
        )
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        timer = base.StepTimer()
        trainer.add_callback(timer)
        assert (trainer.ref_model is None) == (args.method == "lora")
        trainer.train()
    model = trainer.model
    trained = [p for p in model.parameters() if p.requires_grad]
    times = [step["step"] for step in timer.steps]
    assert len(times) == steps
    result = dict(
        library="trl",
        method=args.method,
        trained_params=sum(p.numel() for p in trained),
        trained_dtypes=sorted({str(p.dtype) for p in trained}),
        first_step_s=times[0],
        step_median_s=statistics.median(times[1:]),
        steps_s=times,
        peak_rss_bytes=vm_hwm_bytes(),
        versions=step_report.versions("trl", "peft", "torch", "transformers"),
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
