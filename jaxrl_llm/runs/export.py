"""A run's policy written out (``jaxrl-llm export``): a Hugging Face directory, PEFT adapters, or a GGUF file."""

from __future__ import annotations

import os
import pathlib
from typing import Literal

from jaxrl_llm import models
from jaxrl_llm.runs.directory import BASE_CHECKPOINT, RunDirectoryError, stored_config
from jaxrl_llm.runs.policy import base_record, restore_policy


def export_run(
    run_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    step: int | None = None,
    overwrite: bool = False,
    adapter: bool = False,
    format: Literal["hf", "gguf"] = "hf",  # noqa: A002 (the CLI's --format)
    file_type: str = "f16",
) -> int:
    """Writes checkpoint ``step``'s policy (default: the latest) with its tokenizer and the
    task's stop ids and the run's sampling settings (the policy trained is the one sampled at
    ``train.sampling.temperature``); returns the step.

    ``format="hf"``: a Hugging Face directory with a generation config holding those. A LoRA
    run's policy is written merged (``W + s A B``), or with ``adapter`` as its adapters alone
    in PEFT's format (``adapter_config.json``, ``adapter_model.safetensors``), naming its base:
    ``model.path`` (with its tokenizer), or, for a base that is not a model directory's
    weights as they are (the built-in model, a warm start, a GGUF file), the Hugging Face
    directory ``out/base``, with the tokenizer and generation config, written beside them.
    ``out`` must not hold anything unless ``overwrite`` (the files it writes are then
    replaced, other files kept).

    ``format="gguf"``: ``out``, a ``.gguf`` file for llama.cpp (:func:`jaxrl_llm.models.save_gguf`),
    its matrices as ``file_type``, the sampling settings as its ``general.sampling`` defaults; a
    LoRA run's policy merged. ``out`` must not exist unless ``overwrite``.

    ``out`` must not lie in the run directory. Raises RunDirectoryError for such an ``out``,
    ``adapter`` for a run without LoRA or with ``format="gguf"``, or an unknown ``format``,
    before reading the checkpoint; ValueError for a tokenizer GGUF cannot hold, before writing."""
    if format not in ("hf", "gguf"):
        raise RunDirectoryError(f"--format must be hf or gguf; got {format!r}.")
    out_path, run_path = pathlib.Path(out).resolve(), pathlib.Path(run_dir).resolve()
    if format == "gguf" and out_path.suffix.lower() != models.gguf.SUFFIX:
        raise RunDirectoryError(f"--format gguf writes one file: name it with .gguf (--out {out_path.name}.gguf).")
    if out_path == run_path or run_path in out_path.parents:
        raise RunDirectoryError(f"--out {str(out)!r} lies in the run directory {str(run_dir)!r}; export elsewhere.")
    existing = next(path for path in (out_path, *out_path.parents) if path.exists())
    if existing != out_path and not existing.is_dir():
        raise RunDirectoryError(
            f"--out {str(out)!r} lies under {str(existing)!r}, which is a file; choose another directory."
        )
    if out_path.exists() and (not out_path.is_dir() or any(out_path.iterdir())) and not overwrite:
        what = "the GGUF file" if format == "gguf" else "the model and tokenizer files there"
        raise RunDirectoryError(
            f"--out {str(out_path)!r} exists{'' if format == 'gguf' else ' and is not empty'}; choose another "
            f"{'file' if format == 'gguf' else 'directory'}, or pass --overwrite to replace {what}."
        )
    if format == "gguf" and out_path.is_dir():
        raise RunDirectoryError(f"--out {str(out_path)!r} is a directory; name the GGUF file to write.")
    if adapter and format == "gguf":
        raise RunDirectoryError(
            "--adapter writes a LoRA run's adapters in PEFT's format; a GGUF export holds the policy with its "
            "adapters merged: drop --adapter."
        )
    if adapter:
        stored = stored_config(run_dir)
        if stored is not None and stored.lora.build() is None:
            raise RunDirectoryError(
                f"--adapter writes a LoRA run's adapters; the run in {str(run_dir)!r} trained every weight "
                "(lora.rank = 0). Export it without --adapter."
            )
    config, task, model, params, step = restore_policy(run_dir, step)
    sampling = config.train.sampling
    truncation = {"top_k": sampling.top_k, "top_p": sampling.top_p, "min_p": sampling.min_p}
    truncation = {k: v for k, v in truncation.items() if v is not None}
    if format == "gguf":
        models.save_gguf(
            out_path,
            model,
            params,
            tokenizer=task.tokenizer,
            file_type=file_type,
            name=f"{out_path.stem} (step {step})",
            eos_token_ids=task.eos_ids,
            sampling={"temperature": sampling.temperature, **truncation},
        )
        return step
    generation = {
        "eos_token_id": list(task.eos_ids),
        "pad_token_id": task.pad_id,
        "do_sample": True,
        "temperature": sampling.temperature,
        **truncation,
    }
    if not adapter:
        models.save_pretrained(out, model, params, tokenizer=task.tokenizer, generation_config=generation)
        return step
    base_path = base_record(run_dir)["path"]
    if base_path is None or models.gguf.find_file(base_path) is not None:
        # The base goes beside the adapters, named relative to them: the directory moves whole.
        base_path = BASE_CHECKPOINT
        base, _ = models.lora.split(params)
        models.save_pretrained(
            out_path / base_path,
            models.lora.base_model(model),
            base,
            tokenizer=task.tokenizer,
            generation_config=generation,
        )
    models.lora.save_adapter(out, model, params, base_model_name_or_path=base_path)
    return step
