"""Plain record classes for the audit log's readers: compared, hashed and shown as
their ``__slots__``' values, as a dataclass would be, without a dataclass's cost at
import (about 0.7 ms a class, which `gatewayd audit verify` paid for each at its
start). One copy of ``__eq__``, ``__repr__`` and, for the immutable ones,
``__setattr__`` and ``__hash__``, instead of one per class.
"""

from __future__ import annotations

# typing's flag without importing typing: the readers start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class PlainRecord:
    """Equal to another of the same class with the same values (in ``__slots__``);
    unhashable, as a mutable record is."""

    __slots__ = ()

    def _names(self) -> tuple[str, ...]:
        names: tuple[str, ...] = self.__slots__
        return names

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._names())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PlainRecord) or type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._names())
        return f"{type(self).__name__}({shown})"


class FrozenRecord(PlainRecord):
    """A :class:`PlainRecord` whose values are set once (in ``__init__``, with
    ``object.__setattr__``) and hashed as their tuple."""

    __slots__ = ()

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a {type(self).__name__} is immutable (its {name} cannot be set)")

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(self._values())
