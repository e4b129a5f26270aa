"""Parts by name: a registry of one kind of part (fairness policies, dispatch modes).

The module that owns a kind declares its registry (``scheduler.fairness.FAIRNESS_POLICIES``,
``core.dispatch.DISPATCH_MODES``); the module that defines each part adds it, by one line;
whoever builds a part looks it up by the name the config or the plan gives. So adding a
part is its module and that line, and nothing outside it asks which class a part is.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

F = TypeVar("F")


class UnknownPart(KeyError):
    """A name no part of the kind answers to; the message lists those that do."""

    def __str__(self) -> str:
        return str(self.args[0])


class Registry(Mapping[str, F], Generic[F]):
    """Name -> factory, for one ``kind`` of part (a read-only mapping, filled by ``add``)."""

    __slots__ = ("_parts", "kind")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._parts: dict[str, F] = {}

    def add(self, name: str, factory: F) -> F:
        """Register ``factory`` as ``name`` (once: a second part of one name is a bug)."""
        if name in self._parts:
            raise ValueError(f"{self.kind} {name!r} is registered already")
        self._parts[name] = factory
        return factory

    def names(self) -> list[str]:
        """The known names, sorted (as messages list them)."""
        return sorted(self._parts)

    def unknown(self, name: str) -> str:
        """What to say of a name no part answers to."""
        return f"unknown {self.kind} {name!r} (known: {', '.join(self.names())})"

    def __getitem__(self, name: str) -> F:
        try:
            return self._parts[name]
        except KeyError:
            raise UnknownPart(self.unknown(name)) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._parts)

    def __len__(self) -> int:
        return len(self._parts)

    def __contains__(self, name: object) -> bool:
        return name in self._parts

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"
