"""`Registry[T]`: names → objects of one kind, the one type behind every "pick it by name" setting.

Agent loops (`agents.registry`), reward functions (`rewards`), simulated users (`agents.interaction`),
group filters (`group_filters`) and tool-call parsers (`tools.parsers`) are each one `Registry`:

    REWARDS = Registry[RewardFn]("reward function")

    @REWARDS.register("exact_match")
    def exact_match(traj, sample): ...

    REWARDS.get("exact_match")      # unknown name: an error naming it and listing the registered ones
    REWARDS.names()                 # sorted

`builtins` names modules whose import registers the built-in entries; they are imported on the first
lookup (not at import time: the modules that register import the registry's module themselves).
"""

from __future__ import annotations

import importlib
from typing import Callable, Generic, Iterable, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """A named set of `T`s. `check(name, obj)` may refuse an entry (raise TypeError saying why)."""

    def __init__(
        self,
        kind: str,
        *,
        error: type[Exception] = KeyError,
        check: Callable[[str, T], None] | None = None,
        builtins: Iterable[str] = (),
    ) -> None:
        self.kind = kind
        self.error = error
        self.check = check
        self.builtins = tuple(builtins)
        self._entries: dict[str, T] = {}
        self._loaded = not self.builtins

    def add(self, name: str, obj: T) -> T:
        """Register `obj` under `name` (a later registration under the same name replaces it)."""
        if not name:
            raise ValueError(f"a {self.kind} needs a name")
        if self.check is not None:
            self.check(name, obj)
        self._entries[name] = obj
        return obj

    def register(self, *names: str) -> Callable[[T], T]:
        """Decorator: `@registry.register("name", ...)` registers the decorated object under each name."""
        if not names:
            raise ValueError(f"registering a {self.kind} needs at least one name")

        def deco(obj: T) -> T:
            for n in names:
                self.add(n, obj)
            return obj

        return deco

    def _load_builtins(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for module in self.builtins:
            importlib.import_module(module)

    def get(self, name: str) -> T:
        """The entry named `name`; an unknown name raises `error` naming it and the registered ones."""
        self._load_builtins()
        try:
            return self._entries[name]
        except KeyError:
            raise self.error(f"unknown {self.kind} {name!r}; registered: {self.names()}") from None

    def __contains__(self, name: object) -> bool:
        self._load_builtins()
        return name in self._entries

    def names(self) -> list[str]:
        """The registered names, sorted."""
        self._load_builtins()
        return sorted(self._entries)
