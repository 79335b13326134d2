"""vLLM's ``--config FILE``: a YAML mapping of ``pagoda serve`` flags (``max-model-len: 512`` or
``max_model_len: 512``; booleans, lists and mappings too), read before the command line, which wins over it."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any, Optional

CONFIG_FLAG = "--config"


def expand_config_file(args: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """``pagoda serve``'s ``args`` (after ``serve``) with ``--config FILE`` replaced by the flags the file sets,
    placed first, leaving out those the command line sets itself. ValueError naming the file's unknown keys."""
    path, rest = _take_config(list(args))
    if path is None:
        return rest
    values = _read(path)
    actions = parser._option_string_actions
    unknown = [key for key in values if _flag(key) not in actions or _flag(key) == CONFIG_FLAG]
    if unknown:
        raise ValueError(f"--config {path}: unknown keys {', '.join(map(repr, unknown))} (not pagoda serve flags)")
    given = _given_dests(rest, actions)
    if "model" in values and parser.parse_known_args(rest)[0].model is not None:
        given.add("model_flag")  # the positional MODEL wins over the file's model
    tokens: list[str] = []
    seen: dict[str, str] = {}
    for key, value in values.items():
        action = actions[_flag(key)]
        if action.dest in seen:
            raise ValueError(f"--config {path}: {seen[action.dest]!r} and {key!r} set the same flag")
        seen[action.dest] = key
        if action.dest not in given:
            tokens += _tokens(_flag(key), action, value)
    return tokens + rest


def _take_config(args: list[str]) -> tuple[Optional[str], list[str]]:
    paths, rest, index = [], [], 0
    while index < len(args):
        arg = args[index]
        if arg == CONFIG_FLAG:
            if index + 1 >= len(args):
                raise ValueError("--config needs a file")
            paths.append(args[index + 1])
            index += 2
            continue
        if arg.startswith(CONFIG_FLAG + "="):
            paths.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        index += 1
    if len(paths) > 1:
        raise ValueError(f"--config given {len(paths)} times; give one file")
    return (paths[0] if paths else None), rest


def _read(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"--config {path}: cannot read it: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path}: not valid YAML: {' '.join(str(exc).split())}") from None
    if values is None:
        return {}
    if not isinstance(values, dict) or not all(isinstance(key, str) for key in values):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    return values


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _given_dests(args: list[str], actions: dict[str, argparse.Action]) -> set[str]:
    """The options the command line sets (``--x``, ``--x=v``, ``--no-x``, short forms such as ``-tp`` or ``-O3``)."""
    given = set()
    for arg in args:
        if not arg.startswith("-"):
            continue
        name = arg.split("=", 1)[0]
        action = actions.get(name) or (actions.get(arg[:2]) if not arg.startswith("--") else None)
        if action is not None:
            given.add(action.dest)
    return given


def _tokens(flag: str, action: argparse.Action, value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(action, argparse.BooleanOptionalAction) and isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    if action.nargs == 0:  # a switch: true sets it, false leaves it off
        if not isinstance(value, bool):
            raise ValueError(f"--config: {flag[2:]} is a switch: give true or false, not {value!r}")
        return [flag] if value else []
    if isinstance(value, list):
        if action.nargs in ("+", "*"):
            return [flag, *map(_text, value)]
        if isinstance(action, argparse._AppendAction):
            return [f"{flag}={_text(item)}" for item in value]
    return [f"{flag}={_text(value)}"]


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)
