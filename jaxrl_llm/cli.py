"""Command lines generated from frozen config dataclasses: one flag per field, plus ``--algorithms``."""

from __future__ import annotations

import argparse
import dataclasses

from jaxrl_llm import algorithms


def parse(config_class: type, description: str, argv: list[str] | None = None, *, check=None):
    """``(config, methods)`` from ``--field-name value`` flags (defaults: the dataclass's)
    and ``--algorithms a,b`` (default: every preset).

    Every setting is validated before the caller computes anything: the config's own
    checks, the method names and ``check(config, methods)`` if given. A bad one ends the
    program with argparse's usage line, the message and exit status 2, not a traceback.
    """
    parser = argparse.ArgumentParser(description=description)
    defaults = config_class()
    for field in dataclasses.fields(config_class):
        default = getattr(defaults, field.name)
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(default), default=default)
    parser.add_argument("--algorithms", default=",".join(algorithms.PRESETS),
                        help=f"comma-separated presets (default: all): {', '.join(algorithms.PRESETS)}")
    args = vars(parser.parse_args(argv))
    try:
        methods = [algorithms.get(name) for name in args.pop("algorithms").split(",") if name]
        if not methods:
            raise ValueError(f"--algorithms names no method; known: {', '.join(algorithms.PRESETS)}.")
        config = config_class(**args)
        if check is not None:
            check(config, methods)
    except ValueError as error:
        parser.error(str(error))
    return config, methods
