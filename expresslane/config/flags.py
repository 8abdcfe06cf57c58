"""Flags from the config tree. A knob is a dataclass field made with ``_knob``: its default
(written there and nowhere else), its help and its choices. ``add_args`` turns every knob of a
section (and of the sections nested in it) into one ``--kebab-case`` flag whose help ends with
that default; ``from_args`` builds the typed section back from the parsed namespace.

Every generated flag defaults to ``argparse.SUPPRESS`` and keeps its value under
``"Section.field"``, so a flag the user did not give leaves the dataclass default in charge and
two sections may share a field name (``--seed``, ``--input-len``) without mixing. The flag's
type follows the field's annotation: ``int``, ``float``, ``str``, ``bool`` (``--x/--no-x``, or
``store_true`` with ``negatable=False``) and ``tuple[T, ...]`` (comma-separated, or repeated with
``repeat=True``). A section may name its help group in a ``TITLE`` class variable.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import MISSING, field
from typing import Any, Callable, Iterator

_SCALARS: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str}


def _knob(default: Any = MISSING, help: str = "", choices: tuple | None = None, *, flag: str | None = None,
          aliases: tuple[str, ...] = (), metavar: str | None = None, nargs: str | None = None,
          repeat: bool = False, negatable: bool = True, exclusive: str | None = None) -> Any:
    """A user-facing knob. ``flag``: the flag's name when it is not the field's (kebab-case, without
    the dashes; or an option string in full: ``"-n"``); ``aliases``: more option strings, in full
    (``"-o"``); ``exclusive``: knobs of a section with the same name exclude each other; no
    default: a required flag."""
    return field(default=default, metadata={
        "help": help, "choices": choices, "flag": flag, "aliases": aliases, "metavar": metavar, "nargs": nargs,
        "repeat": repeat, "negatable": negatable, "exclusive": exclusive})


def is_knob(f: dataclasses.Field) -> bool:
    return "help" in f.metadata


def _section_type(f: dataclasses.Field) -> type | None:
    """The section class of a nested-section field (``field(default_factory=Section)``)."""
    factory = f.default_factory
    return factory if isinstance(factory, type) and dataclasses.is_dataclass(factory) else None


def knobs(cls: type) -> Iterator[tuple[type, dataclasses.Field]]:
    """(owning section, field) for every knob of ``cls`` and of the sections nested in it."""
    for f in dataclasses.fields(cls):
        if (sub := _section_type(f)) is not None:
            yield from knobs(sub)
        elif is_knob(f):
            yield cls, f


def dest(cls: type, f: dataclasses.Field) -> str:
    return f"{cls.__name__}.{f.name}"


def flag_name(cls: type, name: str) -> str:
    """``--the-flag`` of a knob, for messages."""
    return _option(next(f for owner, f in knobs(cls) if f.name == name))


def _option(f: dataclasses.Field) -> str:
    flag = f.metadata["flag"] or f.name.replace("_", "-")
    return flag if flag.startswith("-") else "--" + flag


def default_of(cls: type, name: str) -> Any:
    """A knob's default, for code that needs it outside a config instance."""
    f = next(f for owner, f in knobs(cls) if f.name == name)
    return f.default


def _kind(f: dataclasses.Field) -> tuple[str, Callable[[str], Any]]:
    """("bool" | "list" | "scalar", the parser of one value), from the field's annotation."""
    annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    first = next(p.strip() for p in annotation.split("|") if p.strip() != "None")
    if first == "bool":
        return "bool", str
    if first.startswith("tuple["):
        return "list", _SCALARS.get(first[len("tuple["):].split(",")[0].strip(), str)
    return "scalar", _SCALARS.get(first, str)


def comma_list(parse: Callable[[str], Any]) -> Callable[[str], list]:
    def parse_list(text: str) -> list:
        try:
            return [parse(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {parse.__name__} values, got {text!r}")

    parse_list.__name__ = f"{parse.__name__}_list"
    return parse_list


def shown(default: Any) -> str:
    if isinstance(default, tuple):
        return ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in default)
    return str(default)


def _help(f: dataclasses.Field, text: str | None) -> str:
    text = f.metadata["help"] if text is None else text
    quiet = f.default in (None, MISSING, (), "") or (f.default is False and not f.metadata["negatable"])
    return (text if quiet else f"{text} (default: {shown(f.default)})").replace("%", "%%")


def add_args(parser: argparse.ArgumentParser | Any, cls: type, *, skip: tuple[str, ...] = (),
             only: tuple[str, ...] | None = None, required: tuple[str, ...] = (),
             help: dict[str, str] | None = None, _group: Any = None) -> None:
    """One flag per knob of ``cls`` (nested sections included) but ``skip`` (or those not in
    ``only``). ``required``: knobs this command needs given; ``help``: a command's own wording."""
    title = getattr(cls, "TITLE", None)
    group = parser.add_argument_group(title) if title else (_group or parser)
    exclusive: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if (sub := _section_type(f)) is not None:
            add_args(parser, sub, skip=skip, only=only, required=required, help=help, _group=group)
        elif is_knob(f) and f.name not in skip and (only is None or f.name in only):
            if (name := f.metadata["exclusive"]) is not None and name not in exclusive:
                exclusive[name] = group.add_mutually_exclusive_group()
            into = group if name is None else exclusive[name]
            _add_knob(into, cls, f, f.name in required, (help or {}).get(f.name))


def _add_knob(group: Any, cls: type, f: dataclasses.Field, required: bool, text: str | None) -> None:
    m = f.metadata
    options = sorted([_option(f), *m["aliases"]], key=lambda o: o.startswith("--"))  # -o before --output
    kwargs: dict[str, Any] = {"dest": dest(cls, f), "default": argparse.SUPPRESS, "help": _help(f, text)}
    if required or f.default is MISSING:
        kwargs["required"] = True
    kind, parse = _kind(f)
    if kind == "bool":
        kwargs["action"] = argparse.BooleanOptionalAction if m["negatable"] else "store_true"
    elif kind == "list" and not (m["repeat"] or m["nargs"]):
        kwargs["type"] = comma_list(parse)
    else:
        kwargs["type"] = parse
    if m["repeat"]:
        kwargs["action"] = "append"
    for key in ("nargs", "metavar", "choices"):
        if m[key]:
            kwargs[key] = m[key]
    if kind != "bool" and not m["metavar"] and not m["choices"]:
        kwargs["metavar"] = _option(f).lstrip("-").replace("-", "_").upper()  # what argparse would show
    group.add_argument(*options, **kwargs)


def given(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The knobs of ``cls`` (nested ones included) the user gave, by field name."""
    out = {}
    for owner, f in knobs(cls):
        if hasattr(args, dest(owner, f)):
            value = getattr(args, dest(owner, f))
            out[f.name] = tuple(value) if isinstance(value, list) else value
    return out


def from_args(cls: type, args: argparse.Namespace, **extra: Any) -> Any:
    """``cls`` built from the flags the user gave (the rest: its defaults); ``extra``: its
    fields that are not flags (a client, a parsed value)."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if (sub := _section_type(f)) is not None:
            values[f.name] = from_args(sub, args)
        elif is_knob(f) and hasattr(args, dest(cls, f)):
            value = getattr(args, dest(cls, f))
            values[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values, **extra)


def tree_dests(*roots: type) -> set[str]:
    """Every dest ``add_args`` can make from these sections (for the tests)."""
    return {dest(owner, f) for root in roots for owner, f in knobs(root)}


def check_choices(section: Any) -> None:
    """A knob with choices holds one of them or its default (argparse checks flags; this checks code)."""
    for f in dataclasses.fields(section):
        choices, value = f.metadata.get("choices"), getattr(section, f.name)
        if choices and value not in choices and value != f.default:
            raise ValueError(f"{f.name} must be one of {', '.join(map(str, choices))}, got {getattr(section, f.name)!r}")
