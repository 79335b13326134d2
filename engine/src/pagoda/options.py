"""Options declared once, as dataclass fields: each field's default, help and choices also make its flag.

A field made with :func:`option` carries an :class:`Option` in its metadata. :func:`add_options` turns the fields of
such a dataclass (a *table*: :class:`pagoda.config.EngineArgs`, ``pagoda serve``'s ``ServerConfig`` and
``ServerLimits``) into ``argparse`` arguments, in field order, and :func:`from_namespace` builds the dataclass back
from the parsed command line. The flag is ``--field-name`` unless the option spells it otherwise; its argparse type
is the field's annotation (``int`` or ``float``, optional or not; ``bool`` fields are ``--x`` / ``--no-x``
switches, as ``vllm serve`` spells them), so that the name, the type and the default are each written once.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Collection
from typing import Any, Optional, TypeVar

_OPTION = "pagoda.option"
_TABLE = "pagoda.option_table"  # a field holding a nested table: its flags are added in the field's place

Table = TypeVar("Table")


@dataclasses.dataclass(frozen=True, slots=True)
class Option:
    """How one field is set on the command line."""

    help: str
    flag: Optional[str] = None  # the long flag; None: --field-name
    short: Optional[str] = None  # a second spelling, such as -q
    choices: Optional[tuple[Any, ...]] = None
    action: Optional[str] = None  # such as "append"; bool fields are switches without one
    nargs: Optional[str] = None
    positional: bool = False  # an optional positional argument (nargs "?") instead of a flag
    parse: Optional[Callable[[Any], Any]] = None  # the parsed command-line value -> the field's value
    type: Optional[Callable[[str], Any]] = None  # argparse's type; None: from the field's annotation

    def names(self, field_name: str) -> list[str]:
        """What ``add_argument`` is given: the positional's name, or the flag's spellings."""
        if self.positional:
            return [field_name]
        flag = self.flag or "--" + field_name.replace("_", "-")
        return [flag, self.short] if self.short else [flag]

    def dest(self, field_name: str) -> str:
        """The attribute of the parsed namespace that holds the value (argparse's ``dest``)."""
        return field_name if self.positional else self.names(field_name)[0].lstrip("-").replace("-", "_")

    @property
    def repeatable(self) -> bool:
        return self.action == "append" or self.nargs in ("+", "*")


def option(default: Any, help: str, **how: Any) -> Any:
    """A dataclass field with ``default`` that is also a command-line option (``how``: :class:`Option`'s fields)."""
    return dataclasses.field(default=default, metadata={_OPTION: Option(help, **how)})


def table_field(table: type) -> Any:
    """A dataclass field holding another table (default: its defaults), whose flags are added in this field's place."""
    return dataclasses.field(default_factory=table, metadata={_TABLE: table})


def add_options(
    parser: argparse.ArgumentParser,
    table: type,
    only: Optional[Collection[str]] = None,
    exclude: Collection[str] = (),
) -> None:
    """One argument per option field of ``table``, in field order; or per field named in ``only``, in that order."""
    hints = typing.get_type_hints(table)
    fields = {field.name: field for field in dataclasses.fields(table)}
    for field in fields.values() if only is None else (fields[name] for name in only):
        if field.name in exclude:
            continue
        if _TABLE in field.metadata:
            add_options(parser, field.metadata[_TABLE])
        elif _OPTION in field.metadata:
            spec: Option = field.metadata[_OPTION]
            parser.add_argument(*spec.names(field.name), **_argparse_settings(field, spec, hints[field.name]))


def from_namespace(table: type[Table], namespace: argparse.Namespace, **given: Any) -> Table:
    """``table`` built from a parsed command line; ``given`` sets the fields that are not read from it."""
    values = dict(given)
    for field in dataclasses.fields(table):
        if field.name in values:
            continue
        if _TABLE in field.metadata:
            values[field.name] = from_namespace(field.metadata[_TABLE], namespace)
        elif _OPTION in field.metadata:
            spec: Option = field.metadata[_OPTION]
            value = getattr(namespace, spec.dest(field.name))
            values[field.name] = spec.parse(value) if spec.parse is not None else value
    return table(**values)


def _argparse_settings(field: dataclasses.Field, spec: Option, hint: Any) -> dict[str, Any]:
    # A repeatable option starts as None: argparse appends to a fresh list, never to the field's default.
    settings: dict[str, Any] = {"default": None if spec.repeatable else field.default, "help": spec.help}
    if hint is bool:  # --x and --no-x, as vllm serve spells its switches
        settings["action"] = argparse.BooleanOptionalAction
        return settings
    kind = spec.type or _scalar_type(hint)
    extra = {"type": kind, "choices": spec.choices, "action": spec.action, "nargs": spec.nargs}
    if spec.positional:
        extra["nargs"] = "?"
    return settings | {key: value for key, value in extra.items() if value is not None}


def _scalar_type(hint: Any) -> Optional[type]:
    """int or float for a field annotated with one of them (optional or not); None (strings) otherwise."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    kinds = [kind for kind in (typing.get_args(hint) if union else (hint,)) if kind is not type(None)]
    return kinds[0] if kinds in ([int], [float]) else None
