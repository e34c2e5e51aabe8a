"""Generate argparse options from frozen config dataclasses: one source of truth for every option.

A field whose metadata has ``"path": True`` is a filesystem path: ``config_from_args`` makes a relative
one absolute from the directory the command runs in (and expands ``~``), as a shell user means it, before
it reaches a process with another working directory (a Ray actor) or is joined to a root. ``"path":
"name_or_file"`` marks an option that is a name or a file (``--model``, ``--calibration``): a path only
when it is not a named shape and ends in ``.json`` or names a directory (``shapes.is_model_path``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def add_config_args(parser: argparse.ArgumentParser | Any, cls: type, skip: tuple[str, ...] = (),
                    nested: Any = None) -> None:
    """``--field-name`` for each field of ``cls``; a nested config dataclass is flattened into ``parser``, or
    handed to ``nested(kind)`` if given (``add_config_groups``)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if f.name in skip:
            continue
        if dataclasses.is_dataclass(kind):
            if nested is not None:
                nested(kind)
            else:
                add_config_args(parser, kind, skip)  # type: ignore[arg-type]
            continue
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        default = f.default if f.default is not dataclasses.MISSING else None
        # argparse %-formats a help string: a field's "%" (e.g. "1-3% of the mean") must reach it as "%%"
        help_ = f"{f.metadata.get('help', '')} (default: {default})".replace("%", "%%")
        if kind is bool:
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif typing.get_origin(kind) is tuple:
            parser.add_argument(*flags, nargs="+", default=None, help=help_)
        else:
            parser.add_argument(*flags, type=kind, dest=f.name, default=None, help=help_)


def add_config_groups(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """``add_config_args`` in one argument group per config dataclass (``--help`` lists them under the class's
    name and the first line of its docstring); a nested config dataclass gets a group of its own."""
    summary = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else None
    group = parser.add_argument_group(cls.__name__, summary)
    add_config_args(group, cls, skip, nested=lambda kind: add_config_groups(parser, kind, skip))


def config_from_args(cls: type[T], ns: argparse.Namespace, **overrides: Any) -> T:
    """Build ``cls`` from parsed options; options left unset keep the dataclass defaults."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        kind = hints[f.name]
        if f.name in overrides:
            kwargs[f.name] = overrides[f.name]
        elif dataclasses.is_dataclass(kind):
            kwargs[f.name] = config_from_args(kind, ns)  # type: ignore[arg-type]
        elif getattr(ns, f.name, None) is not None:
            value = getattr(ns, f.name)
            value = tuple(value) if typing.get_origin(kind) is tuple else value
            kwargs[f.name] = shell_paths(value, f.metadata.get("path", False))
    return cls(**kwargs)


def shell_path(value: str) -> str:
    """``value`` as a shell user means it: ``~`` expanded, relative to this process's working directory."""
    if "://" in value:  # a URL (s3://bucket/prefix): not a path of this machine
        return value
    return os.path.abspath(os.path.expanduser(value)) if value else value


def shell_paths(value: Any, kind: bool | str) -> Any:
    """Apply ``shell_path`` to a path field's value (a string or a tuple of them); others pass through."""
    if kind == "name_or_file":
        from lora_cache.adapters.shapes import is_model_path

        return shell_path(value) if is_model_path(value) else value
    if kind is True:
        return tuple(shell_path(v) for v in value) if isinstance(value, tuple) else shell_path(value)
    return value
