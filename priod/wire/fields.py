"""How a message type's fields are read off the wire and checked: the machinery under
messages.py (requests) and replies.py (replies).

A message type is a frozen dataclass whose annotations are the wire's field types; `Wire` reads
them once per class into a table, and `Wire._read` checks a decoded frame against it with exact
types (msgpack keeps bool and int apart, so this does too) and an error that names the field.
Every mismatch is refused the same way (`InvalidRequest`, ``bad_request``, the connection goes
on), whatever the value: a bin, a float or a bool where an int belongs, or an array or a map,
which the frame decoder hands over as a `priod.wire.frames.Nested` (its kind and length).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, ClassVar, Union, get_args, get_origin, get_type_hints

from priod.errors import InvalidRequest

__all__ = ["MISSING", "Message", "Wire", "type_name"]

Message = dict[str, Any]
MISSING: Any = object()
"""A field's default when it has none: the field must be given."""


class Wire:
    """Shared by every message type: a field table read once per class, and the checks."""

    __slots__ = ()
    op: ClassVar[str] = ""
    _field_table: ClassVar[tuple[tuple[str, tuple[type, ...], Any], ...]]

    @classmethod
    def _fields(cls) -> tuple[tuple[str, tuple[type, ...], Any], ...]:
        """(name, accepted types, default or MISSING) per field, built on first use."""
        table: tuple[tuple[str, tuple[type, ...], Any], ...] | None = cls.__dict__.get("_field_table")
        if table is None:
            hints = get_type_hints(cls)
            table = tuple(
                (f.name, _kinds(hints[f.name]), MISSING if f.default is dataclasses.MISSING else f.default)
                for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            )
            cls._field_table = table
        return table

    @classmethod
    def _read(cls, msg: Message) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, kinds, default in cls._fields():
            value = msg.get(name, MISSING)
            if value is MISSING or (value is None and default is None):
                if default is MISSING:
                    raise InvalidRequest(f"field '{name}' is missing from '{cls.op}'; see docs/protocol.md")
                out[name] = default
                continue
            if type(value) not in kinds:  # exact types: bool is no int here (msgpack keeps them apart)
                if float in kinds and type(value) is int:
                    value = float(value)
                else:
                    names = " or ".join(k.__name__ for k in kinds if k is not type(None))
                    raise InvalidRequest(f"field '{name}' must be {names}, got {type_name(value)}")
            out[name] = value
        return out

    def _fields_dict(self) -> Message:
        return {name: getattr(self, name) for name, _, _ in self._fields()}


def type_name(value: Any) -> str:
    """A field value's type as a refusal names it: Python's name, or for an array or a map the
    frame decoder kept only as its kind and length (`priod.wire.frames.Nested`) its wire name,
    ``array`` or ``map``."""
    wire_name = getattr(value, "wire_name", None)
    return wire_name if isinstance(wire_name, str) else type(value).__name__


def _kinds(hint: Any) -> tuple[type, ...]:
    origin = get_origin(hint)
    if origin is Union or origin is types.UnionType:
        return tuple(a for a in get_args(hint) if isinstance(a, type))
    return (origin if origin is not None else hint,)
