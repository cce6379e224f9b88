"""``jaxrl-llm``: train, evaluate and export runs from the command line.

.. code-block:: text

    jaxrl-llm train  [--config NAME_OR_PATH] --run-dir DIR [--resume] [--overwrite] [--method NAME]
                     [--steps N] [--save-every K] [--train.optimizer.learning-rate 1e-5] [--any.config.field VALUE]
                     [--mesh.fsdp 8] [--distributed | --coordinator-address H:P --num-processes N --process-id I]
    jaxrl-llm eval   --run-dir DIR [--step N] [--num-samples K]
    jaxrl-llm eval   --model HF_DIR [--config NAME_OR_PATH] [--task.name jsonl --task.path data.jsonl ...]
    jaxrl-llm export --run-dir DIR --out OUT_DIR [--step N] [--adapter] [--format gguf --type q8_0]
    jaxrl-llm presets | tasks

A run's settings are one :class:`~jaxrl_llm.runs.RunConfig`: the embedded default, or
the file ``--config`` names (``experiments/configs/NAME.toml`` or a path), or, when
continuing, the config stored in the run directory; every field can then be set by a
flag generated from the dataclasses by tyro (``--train.share-prompts False``,
``--train.minibatch-size 16``, ``--train.sampling.temperature 0.7``, ``--task.operators + -``,
``--model.path None``), with the field's docstring as its help; the grouped train settings
also take their flat flags (``--train.temperature 0.7``). Bad settings end the program
with status 2 and a message before any compute; Ctrl-C saves a checkpoint and exits with
status 130.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import logging
import sys
import traceback
from collections.abc import Sequence

import tyro

from jaxrl_llm import algorithms, distributed, host, models, rewards, training
from jaxrl_llm.runs import build, run
from jaxrl_llm.runs import config as run_config
from jaxrl_llm.runs.directory import STORAGE_TEXTS, latest_checkpoint, storage_failure, stored_config
from jaxrl_llm.runs.evaluate import evaluate_model, evaluate_run, format_results
from jaxrl_llm.runs.export import export_run
from jaxrl_llm.training.config import GROUPED_FIELDS

PROG = "jaxrl-llm"
_TYRO = (tyro.conf.FlagConversionOff,)  # booleans take a value (`--x False`), as in config files


class UsageError(Exception):
    """A bad command line or setting: reported in one line with exit status 2."""


def _grouped_flags(argv: Sequence[str]) -> list[str]:
    """``argv`` with the flat flags of grouped train settings at their group's place:
    ``--train.temperature`` is ``--train.sampling.temperature``, ``--train.learning-rate=1e-5``
    is ``--train.optimizer.learning-rate=1e-5`` (:data:`jaxrl_llm.training.config.GROUPED_FIELDS`)."""
    flags = []
    for arg in argv:
        name, equals, value = arg.partition("=")
        field = name.removeprefix("--train.")
        group = GROUPED_FIELDS.get(field.replace("-", "_")) if name.startswith("--train.") else None
        flags.append(f"--train.{group}.{field}{equals}{value}" if group else arg)
    return flags


def _settings(base: run_config.RunConfig, argv: Sequence[str], prog: str) -> run_config.RunConfig:
    """``base`` with the ``--field value`` flags of ``argv`` applied (tyro; exits 2 on a bad
    one). ``--warm-start.*`` flags change the demo's warm start only on the demo, as a
    config file's ``[warm_start]`` does (:func:`~jaxrl_llm.runs.config.from_dict`). The flat
    flags of grouped train settings (``--train.learning-rate``) mean their group's."""
    argv = _grouped_flags(argv)

    def parse(start: run_config.RunConfig) -> run_config.RunConfig:
        return tyro.cli(
            run_config.RunConfig,
            default=start,
            args=list(argv),
            prog=prog,
            config=_TYRO,
            description="Settings of the run (any field of RunConfig):",
        )

    flags = [arg.replace("_", "-") for arg in argv if arg.startswith("--")]  # tyro takes either spelling
    if base.warm_start == run_config.DEMO_WARM_START and any(flag.startswith("--warm-start.") for flag in flags):
        settings = parse(dataclasses.replace(base, warm_start=run_config.WarmStartConfig()))
        return parse(base) if settings.is_demo else settings
    return parse(base)


def _base_config(
    config: str | None, method: str | None, stored: run_config.RunConfig | None, conventions: str | None = None
) -> run_config.RunConfig:
    """The config flags apply to: ``--config``'s file, else the run directory's, else the
    default; ``--method`` (a fresh preset) and ``--conventions`` (a peer's numerics) before
    them."""
    if config is not None:
        return run_config.load(config, method=method, conventions=conventions)
    base = stored or run_config.RunConfig()
    if method is not None and method != base.method:
        try:
            base = dataclasses.replace(base, method=method, algorithm=algorithms.get(method))
        except ValueError as error:
            raise UsageError(f"--method: {error}") from None
    if conventions is not None:
        try:
            base = dataclasses.replace(base, algorithm=base.algorithm.matching(conventions))
        except ValueError as error:
            raise UsageError(f"--conventions: {error}") from None
    return base


def _command_parser(name: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"{PROG} {name}", description=description, add_help=False, allow_abbrev=False)


def _help(parser: argparse.ArgumentParser, settings: bool) -> None:
    parser.print_help()
    if settings:
        print()
        _settings(run_config.RunConfig(), ["--help"], f"{parser.prog} [OPTIONS ABOVE]")
    raise SystemExit(0)


def _train_parser() -> argparse.ArgumentParser:
    parser = _command_parser("train", "Train a policy, or continue a run, in a run directory.")
    parser.add_argument(
        "--config",
        help="a named config (experiments/configs/NAME.toml) or a .toml/.json file "
        "(default: the run directory's config, else the embedded default)",
    )
    parser.add_argument("--run-dir", required=True, help="the run's directory: config, records, checkpoints")
    parser.add_argument("--resume", action="store_true", help="continue the run in --run-dir (an error if none)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run in --run-dir (only a run directory's own files are deleted)",
    )
    parser.add_argument("--method", help=f"the preset: {', '.join(algorithms.PRESETS)}")
    parser.add_argument(
        "--conventions",
        choices=algorithms.PEER_LIBRARIES,
        help="the peer's numerics for the method (Algorithm.matching; docs/methods.md, \"Matching TRL, "
        'verl and OpenRLHF"); --algorithm.* flags apply after it',
    )
    parser.add_argument(
        "--progress", choices=("auto", "on", "off"), default="auto", help="the progress bar (auto: on a terminal)"
    )
    group = parser.add_argument_group(
        "several processes (GPU nodes, TPU pod slices; every process runs the same command)"
    )
    group.add_argument(
        "--distributed",
        action="store_true",
        help="connect to the run's other processes (jax.distributed), what SLURM, Open MPI and TPU "
        "pods tell JAX through their environment; the options below imply it",
    )
    group.add_argument("--coordinator-address", metavar="HOST:PORT", help="process 0's address")
    group.add_argument("--num-processes", type=int, metavar="N", help="the run's processes")
    group.add_argument("--process-id", type=int, metavar="I", help="this process's index, from 0")
    group.add_argument("--local-device-ids", metavar="0,1,...", help="this process's devices (default: all)")
    return parser


def _connect(args: argparse.Namespace) -> None:
    """``jax.distributed`` from the multi-process options, before JAX starts."""
    given = {
        "coordinator_address": args.coordinator_address,
        "num_processes": args.num_processes,
        "process_id": args.process_id,
    }
    if args.local_device_ids is not None:
        try:
            given["local_device_ids"] = [int(i) for i in args.local_device_ids.split(",")]
        except ValueError:
            raise UsageError(
                f"--local-device-ids must be comma-separated integers; got {args.local_device_ids!r}."
            ) from None
    if args.distributed or any(value is not None for value in given.values()):
        distributed.initialize(**given)


def parse_train(argv: Sequence[str]) -> tuple[argparse.Namespace, run_config.RunConfig]:
    """The ``train`` command's own options and the run's config. Raises UsageError, or exits
    with status 2 on a bad ``--field`` flag (tyro's message)."""
    parser = _train_parser()
    if {"-h", "--help"} & set(argv):
        _help(parser, settings=True)
    args, rest = parser.parse_known_args(argv)
    try:
        stored = None if args.overwrite or args.config else stored_config(args.run_dir)
        return args, _settings(_base_config(args.config, args.method, stored, args.conventions), rest, parser.prog)
    except (ValueError, OSError) as error:  # a file that cannot be read is named by the error
        raise UsageError(str(error)) from error


def train(argv: Sequence[str]) -> int:
    parser = _train_parser()
    try:
        args, config = parse_train(argv)
    except UsageError as error:
        parser.exit(2, "\n".join([f"{parser.prog}: error: {error}", *user_traceback(error.__cause__)]) + "\n")
    try:
        progress = {"auto": None, "on": True, "off": False}[args.progress]
        _connect(args)
        with _storage_noise_muted():
            run.train_run(config, args.run_dir, resume=args.resume, overwrite=args.overwrite, progress=progress)
    except (UsageError, ValueError, FileNotFoundError) as error:
        if (reason := storage_failure(error)) is not None:
            return _report(
                f"{parser.prog}: error: could not use {args.run_dir}: {reason}.",
                error,
                args.run_dir,
                checkpoint=latest_checkpoint(args.run_dir),
                storage=True,
            )
        # Bad settings, found before any compute; an error importing the user's reward module
        # shows the frames of their code.
        parser.exit(2, "\n".join([f"{parser.prog}: error: {error}", *user_traceback(error.__cause__)]) + "\n")
    except training.RunInterrupted as interrupted:
        print(f"{PROG}: {_without_api_hint(interrupted)}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted before the first train step; no checkpoint to save.", file=sys.stderr)
        return 130
    except training.RunStopped as stopped:
        cause = stopped.__cause__ or stopped
        reason = storage_failure(cause)
        message = (
            f"{_without_api_hint(stopped).partition(': ')[0]}: could not write the run's files: {reason}."
            if reason
            else _without_api_hint(stopped)
        )
        return _report(
            f"{parser.prog}: error: {message}",
            cause,
            args.run_dir,
            checkpoint=getattr(stopped, "checkpoint_step", None),
            storage=reason is not None,
        )
    except (rewards.RewardFunctionError, OSError) as error:  # outside a train step: the warm start's evaluation
        reason = storage_failure(error)
        message = f"could not write the run's files: {reason}." if reason else error
        return _report(
            f"{parser.prog}: error: {message}",
            error,
            args.run_dir,
            checkpoint=latest_checkpoint(args.run_dir),
            storage=reason is not None,
        )
    return 0


def _without_api_hint(stopped: BaseException) -> str:
    """A stopped run's message without the hint for Python callers (``.state``, ``.history``)."""
    message, hint, _ = str(stopped).partition("; `.state` and `.history`")
    return message + "." if hint else message


def _report(
    message: str, error: BaseException, run_dir: str | None, *, checkpoint: int | None = None, storage: bool = False
) -> int:
    """Prints a failure for a person: ``message``, the traceback of their own code in
    ``error`` (:func:`user_traceback`) and, for a run, how to go on; returns the exit
    status, 1."""
    lines = [message, *([] if storage else user_traceback(error))]
    fix = "free space (or make it writable)" if storage else "fix the cause"
    if run_dir is not None and checkpoint is not None:
        lines.append(
            f"The checkpoint of step {checkpoint} in {run_dir} is intact; {fix} and continue with: "
            f"{PROG} train --run-dir {run_dir} --resume"
        )
    elif run_dir is not None:
        lines.append(f"No checkpoint was saved; {fix} and run the same command again.")
    print("\n".join(lines), file=sys.stderr)
    return 1


def user_traceback(error: BaseException | None) -> list[str]:
    """The lines of the traceback of the user's own code in ``error``'s chain (its causes
    and contexts): the frames outside installed code
    (:func:`~jaxrl_llm.runs.build.is_library_file`), innermost exception first found, with
    its type and message; or where the failing reward function is defined."""
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    for exception in reversed(chain):  # the innermost (the user's own exception) first
        frames = [
            frame
            for frame in traceback.extract_tb(exception.__traceback__)
            if not frame.filename.startswith("<") and not build.is_library_file(frame.filename)
        ]
        if frames:
            return [
                "Traceback of your code (most recent call last):",
                *"".join(traceback.format_list(frames)).rstrip("\n").split("\n"),
                *traceback.format_exception_only(exception)[-1].rstrip("\n").split("\n"),
            ]
    function = next((getattr(e, "function", None) for e in chain if getattr(e, "function", None)), None)
    code = getattr(inspect.unwrap(function), "__code__", None) if function is not None else None
    if code is not None and not build.is_library_file(code.co_filename):
        name = rewards.combine.reward_name(function)
        return [f"  {name} is defined in {code.co_filename}, line {code.co_firstlineno}."]
    return []


@contextlib.contextmanager
def _storage_noise_muted():
    """While a run writes its files: the warnings of orbax and the other libraries that log
    through absl (``Waiting for previous save to complete took 17.56 seconds``) are dropped,
    their errors kept; the errors orbax's writer threads log for a file system that is full
    or read-only are dropped too (the run reports the failure itself, in one line), and so,
    from then on, are Python's "Exception ignored" reports of them at exit."""

    def noise(record: logging.LogRecord) -> bool:
        text = record.getMessage() + ("".join(traceback.format_exception(*record.exc_info)) if record.exc_info else "")
        return not any(
            marker in text for marker in (*STORAGE_TEXTS.values(), "RESOURCE_EXHAUSTED", "PERMISSION_DENIED")
        )

    global _UNRAISABLE_HOOK
    if _UNRAISABLE_HOOK is None:  # once per process: the reports come at exit, after the run
        _UNRAISABLE_HOOK = sys.unraisablehook
        sys.unraisablehook = _unraisable
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
    absl_level = loggers[0].level
    loggers[0].setLevel(max(absl_level, logging.ERROR))
    for logger in loggers:
        logger.addFilter(noise)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(noise)
        loggers[0].setLevel(absl_level)


_UNRAISABLE_HOOK = None


def _unraisable(report) -> None:
    """``sys.unraisablehook`` without the storage failures of orbax's abandoned writes, and
    their "Python is likely shutting down" echoes."""
    error = report.exc_value
    if error is not None and (storage_failure(error) or "Python is likely shutting down" in str(error)):
        return
    _UNRAISABLE_HOOK(report)


def evaluate(argv: Sequence[str]) -> int:
    parser = _command_parser(
        "eval",
        "Greedy accuracy, mean reward and pass@k on a task's test split, of a run's "
        "checkpoint or of a Hugging Face model directory.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run-dir", help="a run directory: its task and a checkpoint")
    source.add_argument("--model", help="a Hugging Face model directory (the task from --config and flags)")
    parser.add_argument("--step", type=int, help="the checkpoint (default: the latest)")
    parser.add_argument("--num-samples", type=int, help="samples per prompt for pass@k (default: train.eval_samples)")
    parser.add_argument("--config", help="with --model: the config whose task and sampling settings to use")
    parser.add_argument("--out", help="also write the results as JSON to this file")
    if {"-h", "--help"} & set(argv):
        _help(parser, settings=True)
    args, rest = parser.parse_known_args(argv)
    try:
        if args.num_samples is not None and args.num_samples < 0:
            raise UsageError(f"--num-samples must be >= 0; got {args.num_samples}.")
        if args.run_dir is not None:
            if rest or args.config:
                raise UsageError(
                    f"with --run-dir the run's own settings are used; unexpected: {' '.join(rest) or '--config'}."
                )
            if args.step is not None and args.step < 1:
                raise UsageError(f"--step must be a checkpoint's step (>= 1); got {args.step}.")
            try:
                results = evaluate_run(args.run_dir, step=args.step, num_samples=args.num_samples)
            except (ValueError, FileNotFoundError) as error:
                raise UsageError(str(error)) from error
            where = f"{args.run_dir}/eval/step-{results['step']}.json"
        else:
            if args.step is not None:
                raise UsageError("--step selects a run's checkpoint; it needs --run-dir.")
            base = run_config.load(args.config) if args.config else run_config.RunConfig()
            config = run_config.absolute_paths(
                _settings(
                    dataclasses.replace(base, model=dataclasses.replace(base.model, path=args.model)), rest, parser.prog
                )
            )
            try:
                task = build.run_task(config)
                model, params = build.model(config, task)
            except (ValueError, FileNotFoundError) as error:
                raise UsageError(str(error)) from error
            results = evaluate_model(model, params, task, config, num_samples=args.num_samples)
            where = None
    except UsageError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    except rewards.RewardFunctionError as error:
        return _report(f"{parser.prog}: error: {error}", error, None)
    print(format_results(results))
    if args.out:
        with open(args.out, "w") as file:
            json.dump(results, file, indent=2)
        where = args.out
    if where:
        print(f"Written to {where}")
    return 0


def export(argv: Sequence[str]) -> int:
    parser = _command_parser(
        "export",
        "Write a run's policy as a Hugging Face directory (weights, config, tokenizer, generation config) "
        "that transformers loads, or as a GGUF file that llama.cpp runs.",
    )
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--out", required=True, help="the directory to write (with --format gguf: the .gguf file)")
    parser.add_argument(
        "--format",
        choices=("hf", "gguf"),
        default="hf",
        help="hf: a Hugging Face directory; gguf: one file for llama.cpp, Ollama, LM Studio (default: hf)",
    )
    parser.add_argument(
        "--type",
        choices=tuple(models.gguf.FILE_TYPES),
        help="with --format gguf: the matrices' type (norms stay float32; default: f16)",
    )
    parser.add_argument("--step", type=int, help="the checkpoint (default: the latest)")
    parser.add_argument("--overwrite", action="store_true", help="replace what --out holds")
    parser.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run: write its adapters alone, in PEFT's format (default: the model with them merged)",
    )
    if {"-h", "--help"} & set(argv):
        _help(parser, settings=False)
    args, rest = parser.parse_known_args(argv)
    if rest:
        parser.exit(2, f"{parser.prog}: error: unrecognized arguments: {' '.join(rest)}\n")
    if args.type is not None and args.format != "gguf":
        parser.exit(2, f"{parser.prog}: error: --type sets a GGUF file's type; add --format gguf.\n")
    try:
        step = export_run(
            args.run_dir,
            args.out,
            step=args.step,
            overwrite=args.overwrite,
            adapter=args.adapter,
            format=args.format,
            file_type=args.type or "f16",
        )
    except (ValueError, FileNotFoundError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    except OSError as error:  # a full or read-only disk
        parser.exit(1, f"{parser.prog}: error: could not write {args.out}: {storage_failure(error) or error}.\n")
    print(f"Exported {'the adapters of ' if args.adapter else ''}step {step} of {args.run_dir} to {args.out}")
    return 0


def presets(argv: Sequence[str]) -> int:
    """The method presets, one line each."""
    for name, algorithm in algorithms.PRESETS.items():
        print(f"{name:<20} advantage={algorithm.advantage}, objective={algorithm.objective}, agg={algorithm.agg}")
    return 0


def list_tasks(argv: Sequence[str]) -> int:
    """The task sources and the built-in reward functions."""
    print("Tasks (--task.name):")
    for name, description in run_config.TASKS.items():
        print(f"  {name:<14} {description}")
    print(f"Reward functions (--task.rewards): {', '.join(build.REWARDS)}, or a module:function import path")
    return 0


COMMANDS = {"train": train, "eval": evaluate, "export": export, "presets": presets, "tasks": list_tasks}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        usage = f"usage: {PROG} {{{','.join(COMMANDS)}}} ... ({PROG} COMMAND --help for its options)"
        if argv and argv[0] not in ("-h", "--help"):
            print(
                f"{usage}\n{PROG}: error: unknown command {argv[0]!r}; the commands are {', '.join(COMMANDS)}.",
                file=sys.stderr,
            )
            return 2
        print(usage)
        return 0 if argv else 2
    if argv[0] in ("train", "eval"):
        host.reuse_freed_memory()  # before JAX's first computation: the CLI owns its process
    with host.full_collections_deferred():  # its evaluations build programs too, not only train's steps
        return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
