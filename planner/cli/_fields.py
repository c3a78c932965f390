"""Command-line flags generated from pydantic models: each field's description is its help text."""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel

from ..workload import parse_lora_targets

__all__ = ["add_fields", "collect_fields", "flag_name"]

_AUTO = "auto"


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("true", "yes", "1", "on"):
        return True
    if low in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parse_targets(text: str) -> str | tuple[str, ...]:
    """LoRA targets: ``all-linear`` or comma-separated module names (:func:`planner.workload.parse_lora_targets`)."""
    try:
        return parse_lora_targets(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _members(annotation: Any) -> list[Any]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return list(typing.get_args(annotation))
    return [annotation]


def _converter(annotation: Any) -> tuple[Callable[[str], Any], list[str] | None, bool]:
    members = [m for m in _members(annotation) if m is not type(None)]
    optional = len(members) < len(_members(annotation))
    choices = None
    convert: Callable[[str], Any]
    if len(members) == 1 and typing.get_origin(members[0]) is Literal:
        choices = [str(c) for c in typing.get_args(members[0])]
        values = {str(c): c for c in typing.get_args(members[0])}

        def convert(text: str, values: dict[str, Any] = values, choices: list[str] = choices) -> Any:
            if text not in values:
                raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)} (got {text!r})")
            return values[text]
    elif bool in members:
        convert = _parse_bool
    elif int in members:
        convert = int
    elif float in members:
        convert = float
    elif any(typing.get_origin(m) is tuple for m in members):
        convert = _parse_targets
    else:
        convert = str

    def parse(text: str) -> Any:
        if optional and text.lower() in (_AUTO, "none"):
            return None
        return convert(text)

    # argparse says "invalid <name> value" when the conversion fails
    parse.__name__ = "integer" if convert is int else "number" if convert is float else ""
    return parse, choices, optional


def add_fields(
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    *,
    skip: tuple[str, ...] = (),
    group_title: str | None = None,
) -> None:
    """One ``--field-name`` flag per field; unset flags keep the model's defaults."""
    target = parser.add_argument_group(group_title) if group_title else parser
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        parse, choices, optional = _converter(field.annotation)
        default = field.default
        metavar = "{" + ",".join(choices) + "}" if choices else name.upper()
        extra = " ('auto' lets the planner choose)" if optional else ""
        # A flag that is off by default also turns on bare (--full-finetune), or takes true/false.
        bare: dict[str, Any] = dict(nargs="?", const=True) if field.annotation is bool and default is False else {}
        if bare:
            metavar = "true|false"
        target.add_argument(
            flag_name(name),
            dest=f"{model.__name__}.{name}",
            type=parse,
            default=argparse.SUPPRESS,
            metavar=metavar,
            help=f"{field.description}{extra} [default: {default}]",
            **bare,
        )


def collect_fields(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """The flags the user set for ``model``'s fields."""
    prefix = f"{model.__name__}."
    return {k[len(prefix) :]: v for k, v in vars(args).items() if k.startswith(prefix)}
