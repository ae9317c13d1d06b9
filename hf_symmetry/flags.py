"""Command-line flags declared once, on the fields of an options dataclass.

A field that a command sets from a flag is declared with :func:`flag` in place of a plain default; the flag's
name, type, choices, metavar, action and help live there and nowhere else::

    @dataclass(frozen=True)
    class MatchOptions:
        residual_iters: int = flag(0, "refinement passes ...", type=int)

* :func:`add_flags` ``(parser, Options, *names)`` adds the flags of ``Options`` to an ``argparse`` parser or
  argument group: those of ``names``, in that order, else every flagged field in field order (``"field.sub"``
  names one flag of a nested field, for a command that shows its flags in different places);
* :func:`from_args` ``(Options, args, **given)`` builds the options from the parsed arguments (fields whose flag
  the parser lacks keep their default; ``given`` sets the others);
* :func:`changed_flags` ``(Options, args)``: the flags given a value other than the field's default, as the user
  would have typed them (for "only applies with ..." refusals).

A field holding another dataclass (e.g. :class:`hf_symmetry.calibration.CalibrationText`) is declared with
:func:`nested`: each of its fields takes a flag of the outer class's choosing, and the field is None while its
first flag is not given (:func:`nested_from_args`: the value a nested field's flags give, whatever its default).
The parser's value of a flag becomes the field's value through ``Flag.parse``
(default: unchanged); ``Flag.unset`` is what the parser holds when the flag is not given, where that differs
from the field's default (e.g. None for "not given: a preset decides").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: the metadata key of a field's :class:`Flag` (or :class:`Nested`)
FLAG = "hf_symmetry.flag"


class _Same:
    """``Flag.unset``'s marker: the parser's default is the field's."""

    def __repr__(self) -> str:
        return "SAME"


SAME = _Same()


@dataclass(frozen=True)
class Flag:
    """How one field appears on the command line (the keywords of ``ArgumentParser.add_argument``; ``name``:
    the flag, default ``--`` and the field's name with ``-`` for ``_``)."""

    help: str | None = None
    name: str | None = None
    type: Callable | None = None
    choices: tuple | list | None = None
    metavar: str | None = None
    action: Any = None
    unset: Any = SAME
    parse: Callable[[Any], Any] | None = None

    def argument(self, field_name: str, field_default) -> tuple[str, dict]:
        """``(flag, keywords)`` for ``add_argument``."""
        name = self.name or "--" + field_name.replace("_", "-")
        keywords = {"type": self.type, "choices": self.choices, "metavar": self.metavar, "action": self.action}
        keywords = {k: v for k, v in keywords.items() if v is not None}
        keywords["default"] = field_default if self.unset is SAME else self.unset
        if self.help is not None:
            keywords["help"] = self.help
        return name, keywords

    def dest(self, field_name: str) -> str:
        """The attribute argparse stores the value under (derived from the flag, as argparse derives it)."""
        return (self.name or "--" + field_name).lstrip("-").replace("-", "_")

    def value(self, args, field_name: str):
        raw = getattr(args, self.dest(field_name))
        return raw if self.parse is None else self.parse(raw)


@dataclass(frozen=True)
class Nested:
    """A field holding a dataclass ``cls``, each of whose fields named in ``flags`` takes that flag."""

    cls: type
    flags: dict[str, Flag]


def flag(default, help: str | None = None, **how) -> Any:
    """A dataclass field with ``default`` that takes a flag (:class:`Flag`'s keywords in ``how``)."""
    return dataclasses.field(default=default, metadata={FLAG: Flag(help=help, **how)})


def nested(cls: type, default=None, **flags: Flag) -> Any:
    """A dataclass field holding a ``cls`` (or ``default`` when its first flag is not given), whose fields take
    ``flags`` (field name -> :class:`Flag`; a flag's ``unset`` is the parser's default, ``SAME``: ``cls``'s)."""
    return dataclasses.field(default=default, metadata={FLAG: Nested(cls, flags)})


def _flagged(options_cls, names: tuple[str, ...]) -> list[tuple[dataclasses.Field, Any]]:
    """The fields of ``options_cls`` named (all flagged ones when none is), with their flag declaration; a
    ``"field.sub"`` name gives the nested field ``field`` with only its flag ``sub``."""
    fields = {f.name: f for f in dataclasses.fields(options_cls)}
    outer = [n.split(".")[0] for n in names]
    unknown = [n for n, o in zip(names, outer) if FLAG not in getattr(fields.get(o), "metadata", {})]
    unknown += [
        n
        for n, o in zip(names, outer)
        if n not in unknown and "." in n and n.split(".")[1] not in getattr(fields[o].metadata[FLAG], "flags", {})
    ]
    if unknown:
        raise KeyError(f"{options_cls.__name__} declares no flag for {', '.join(unknown)}")
    if not names:
        return [(f, f.metadata[FLAG]) for f in fields.values() if FLAG in f.metadata]
    chosen = []
    for name, o in zip(names, outer):
        decl = fields[o].metadata[FLAG]
        if "." in name:
            sub = name.split(".")[1]
            decl = Nested(decl.cls, {sub: decl.flags[sub]})
        chosen.append((fields[o], decl))
    return chosen


def _nested_defaults(decl: Nested) -> dict:
    return {f.name: f.default for f in dataclasses.fields(decl.cls)}


def add_flags(parser, options_cls, *names: str) -> None:
    """Add the flags of ``options_cls``'s fields ``names`` (default: every flagged field, in field order; a
    ``"field.sub"`` name: one flag of a nested field) to ``parser`` (a parser or an argument group)."""
    for field, decl in _flagged(options_cls, names):
        if isinstance(decl, Nested):
            defaults = _nested_defaults(decl)
            for sub, sub_flag in decl.flags.items():
                name, keywords = sub_flag.argument(sub, defaults[sub])
                parser.add_argument(name, **keywords)
        else:
            name, keywords = decl.argument(field.name, field.default)
            parser.add_argument(name, **keywords)


def nested_from_args(options_cls, name: str, args):
    """The value the flags of ``options_cls``'s nested field ``name`` give in the parsed ``args``: a ``cls``
    built from them, or None while the first is not given (whatever the field's default)."""
    ((_, decl),) = _flagged(options_cls, (name,))
    subs = {sub: f.value(args, sub) for sub, f in decl.flags.items()}
    return None if next(iter(subs.values())) is None else decl.cls(**subs)


def from_args(options_cls, args, **given):
    """``options_cls`` built from the parsed ``args`` (each flagged field whose flag ``args`` holds) and
    ``given`` (any field, taking precedence)."""
    values = {}
    for field, decl in _flagged(options_cls, ()):
        if field.name in given:
            continue
        if isinstance(decl, Nested):
            subs = {sub: f.value(args, sub) for sub, f in decl.flags.items() if hasattr(args, f.dest(sub))}
            if len(subs) == len(decl.flags):
                first = next(iter(decl.flags))
                values[field.name] = field.default if subs[first] is None else decl.cls(**subs)
        elif hasattr(args, decl.dest(field.name)):
            values[field.name] = decl.value(args, field.name)
    return options_cls(**values, **given)


def changed_flags(options_cls, args, *names: str) -> list[str]:
    """The flags among ``names`` (default: all) whose parsed value differs from the field's default, spelt as
    given (``--no-X`` for a switch whose default is on)."""
    out = []
    for field, decl in _flagged(options_cls, names):
        if isinstance(decl, Nested) or not hasattr(args, decl.dest(field.name)):
            continue
        if decl.value(args, field.name) != field.default:
            name = decl.name or "--" + field.name.replace("_", "-")
            out.append(name.replace("--", "--no-", 1) if field.default is True else name)
    return out
