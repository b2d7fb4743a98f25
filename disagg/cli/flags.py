"""Flags from config structs: one argparse group per struct, built from its fields' types,
defaults and ``Flag`` annotations (``disagg.config``), and the struct read back from the
parsed flags (the idea of vLLM's ``EngineArgs.add_cli_args``, over msgspec structs).

A field with a ``Flag`` becomes one flag: its type from the annotation (int, float, str; the
values of a ``Literal`` as choices; ``X | None`` as X), its default the struct's. A field whose
type is a struct holds a layer of its own (its group, read back recursively); a field without
a ``Flag`` has no flag.
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import msgspec

from disagg.config import Flag

S = TypeVar("S", bound=msgspec.Struct)


@dataclass(frozen=True)
class FieldFlag:
    """One field's flag, resolved: where it sits and how argparse reads it."""

    field: str
    flag: Flag
    name: str  # --page-size
    dest: str  # page_size: the parsed flags' attribute
    kind: type  # bool, int, float, str, list
    choices: tuple[Any, ...] | None
    default: Any  # the struct's default, as the field holds it


def _flag_name(field: str) -> str:
    return "--" + field.removesuffix("_s").replace("_", "-")


def _unwrap(tp: Any) -> tuple[type, tuple[Any, ...] | None]:
    """(the value's kind, its choices) of an annotation, ``X | None`` read as X."""
    if get_origin(tp) in (Union, types.UnionType):
        (tp,) = [a for a in get_args(tp) if a is not type(None)]
    if get_origin(tp) is Literal:
        return type(get_args(tp)[0]), get_args(tp)
    if get_origin(tp) is list:
        return list, None
    if tp in (bool, int, float, str):
        return tp, None
    raise TypeError(f"no flag type for {tp!r}")


def field_flags(cls: type[msgspec.Struct]) -> list[FieldFlag]:
    """The flags of ``cls``'s own fields (not of the structs it holds), in field order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    defaults = cls()
    out = []
    for name in cls.__struct_fields__:
        hint = hints[name]
        flags = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Flag)]
        if not flags:
            continue
        kind, choices = _unwrap(get_args(hint)[0])
        flag_name = flags[0].name or _flag_name(name)
        dest = flags[0].dest or flag_name.removeprefix("--").replace("-", "_")
        out.append(FieldFlag(name, flags[0], flag_name, dest, kind, choices,
                             getattr(defaults, name)))
    return out


def layers(cls: type[msgspec.Struct]) -> list[tuple[str, type[msgspec.Struct]]]:
    """(field name, struct type) of the struct-typed fields of ``cls``: its layers."""
    hints = typing.get_type_hints(cls)
    return [(name, hints[name]) for name in cls.__struct_fields__
            if isinstance(hints[name], type) and issubclass(hints[name], msgspec.Struct)]


def add_flags(ap: argparse.ArgumentParser, cls: type[msgspec.Struct],
              title: str | None = None) -> Any:
    """Add ``cls``'s flags to ``ap`` in a group of their own, then those of each of its
    layers (a group each, titled by the layer's field). Returns ``cls``'s group."""
    doc = (cls.__doc__ or "").replace("``", "").strip()
    group = ap.add_argument_group(title or cls.__name__, doc or None)
    for f in field_flags(cls):
        kw: dict[str, Any] = {"dest": f.dest, "help": f.flag.help}
        if f.flag.metavar is not None:
            kw["metavar"] = f.flag.metavar
        if f.kind is bool:
            default = f.default != f.flag.invert
            group.add_argument(f.name, action="store_false" if default else "store_true",
                               default=default, **kw)
            continue
        if f.kind is list:
            if f.flag.sep:
                kw["default"] = f.flag.sep.join(f.default)
            else:
                kw.update(action="append", default=list(f.default))
        else:
            kw["default"] = f.default
            if f.kind is not str:
                kw["type"] = f.kind
            if f.choices is not None:
                kw["choices"] = list(f.choices)
        group.add_argument(f.name, **kw)
    for name, layer in layers(cls):
        add_flags(ap, layer, f"{name} ({layer.__name__})")
    return group


def from_flags(cls: type[S], args: argparse.Namespace, **given: Any) -> S:
    """``cls`` (and its layers) from the flags ``add_flags`` added; ``given`` sets fields
    whose value is not their flag's as parsed (``devices`` with ``--tp``). Not validated."""
    values: dict[str, Any] = dict(given)
    for f in field_flags(cls):
        if f.field in values:
            continue
        v = getattr(args, f.dest)
        if f.kind is bool:
            v = v != f.flag.invert
        elif f.kind is list and f.flag.sep:
            v = [x.strip() for x in v.split(f.flag.sep) if x.strip()]
        elif f.kind is list:
            v = list(v)
        values[f.field] = v
    for name, layer in layers(cls):
        values.setdefault(name, from_flags(layer, args))
    return cls(**values)


def all_flags(cls: type[msgspec.Struct]) -> list[FieldFlag]:
    """Every flag of ``cls`` and its layers."""
    out = field_flags(cls)
    for _, layer in layers(cls):
        out += all_flags(layer)
    return out
