"""llama.cpp runs the GGUF files jaxrl_llm writes: SmolLM2-135M-Instruct (``make model``) exported by
``models.save_gguf`` in several types, each given to llama.cpp (node-llama-cpp 3.21.1's prebuilt CPU
binaries, ``benchmarks/llama_cpp``) and to jaxrl_llm, on the same chat prompts.

For each file: whether llama.cpp tokenizes the rendered chat prompt into jaxrl_llm's ids (the
vocabulary, merges, pre-tokenizer and special tokens written), and its greedy completion against
jaxrl_llm's on the same file, as the number of leading tokens they share. F32 and F16 should agree
throughout; llama.cpp multiplies quantized weights by quantized activations where jaxrl_llm
dequantizes the weights, so a quantized type may part from it after a few tokens (the answer
itself is then the check). The original Q4_1 file is the baseline. Not part of the test suite
(it needs Node.js and the npm registry): ``make check-llama-cpp`` installs and runs it.

    make check-llama-cpp    # or: python benchmarks/llama_cpp_check.py [--types f32 f16 q8_0 q4_0]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import tempfile

import jax
import numpy as np

from jaxrl_llm import host, models, sampling

HERE = pathlib.Path(__file__).resolve().parent
MODEL = HERE.parent / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = ("What is 37 + 48? Reply with just the number.", "Name three primary colors.")
NEW_TOKENS = 24


def llama_cpp(path: pathlib.Path, prompt: str) -> dict:
    """llama.cpp's prompt ids and greedy completion (``benchmarks/llama_cpp/generate.mjs``)."""
    command = ["node", str(HERE / "llama_cpp" / "generate.mjs"), str(path), prompt, str(NEW_TOKENS)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=HERE / "llama_cpp")
    if done.returncode:
        raise SystemExit(f"llama.cpp failed on {path.name} (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ours(path: pathlib.Path, prompt: str) -> dict:
    """jaxrl_llm's prompt ids and greedy completion (the sampler at temperature 0) on ``path``."""
    model, params = models.from_pretrained(path)
    tokenizer = models.load_tokenizer(path)
    ids = np.asarray([tokenizer(prompt)["input_ids"]])
    eos = model.config.eos_token_ids
    rollout = sampling.sample(
        model, params, ids, np.ones_like(ids, bool), jax.random.key(0), num_samples=1,
        max_new_tokens=NEW_TOKENS, temperature=0.0, eos_ids=eos, pad_id=eos[0],
    )  # fmt: skip
    completion = np.asarray(rollout.completion_tokens)[0, : int(rollout.lengths[0])].tolist()
    completion = [token for token in completion if token not in eos]
    return {"prompt_ids": ids[0].tolist(), "completion_ids": completion, "text": tokenizer.decode(completion)}


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", default=["f32", "f16", "bf16", "q8_0", "q4_0"])
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "results" / "llama_cpp_check.md")
    args = parser.parse_args(argv)
    if not (HERE / "llama_cpp" / "node_modules").is_dir():
        raise SystemExit("benchmarks/llama_cpp/node_modules is missing: run `make check-llama-cpp`.")
    host.reuse_freed_memory()
    model, params = models.from_pretrained(MODEL)
    tokenizer = models.load_tokenizer(MODEL)
    work = pathlib.Path(tempfile.mkdtemp(prefix="llama_cpp_check-"))
    files = {"original Q4_1": MODEL}
    for file_type in args.types:
        files[file_type] = models.save_gguf(work / f"smollm2.{file_type}.gguf", model, params, tokenizer=tokenizer,
                                            file_type=file_type)  # fmt: skip
    rows = ["| file | MB | prompt ids equal | greedy tokens shared | llama.cpp's answer | jaxrl_llm's answer |"]
    rows.append("|---|---:|---|---|---|---|")
    for name, path in files.items():
        for question in QUESTIONS:
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
            )
            theirs, mine = llama_cpp(path, prompt), ours(path, prompt)
            shared = shared_prefix(theirs["completion_ids"], mine["completion_ids"])
            rows.append(
                f"| {name} | {path.stat().st_size / 1e6:.0f} | {theirs['prompt_ids'] == mine['prompt_ids']} | "
                f"{shared} of {len(mine['completion_ids'])} | {theirs['text']!r} | {mine['text']!r} |"
            )
            print(rows[-1], flush=True)
    text = "\n".join(rows) + "\n"
    args.out.write_text(text)
    print(f"\nWritten to {args.out}")


if __name__ == "__main__":
    main()
