"""The strategy registry, filled through the pluggy hook ``memstrat_register_strategies``."""

from __future__ import annotations

import difflib
import re
import threading

import pluggy

from . import hookspecs

__all__ = ["Registry", "get_registry", "plugin_manager"]

_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.\-]*$")


class Registry:
    """Strategy classes by name (and alias).

    ``add(cls)`` takes a :class:`~cupy_memstrat.Strategy` subclass with a
    ``name`` (and optional ``aliases``, ``description``).
    """

    def __init__(self):
        self._by_name: dict[str, type] = {}
        self._aliases: dict[str, str] = {}

    def add(self, cls) -> None:
        """Register a strategy class.

        Raises:
            TypeError: ``cls`` is not a Strategy subclass.
            ValueError: it has no name, or its name or an alias is taken.
        """
        from .strategies.base import Strategy

        if not (isinstance(cls, type) and issubclass(cls, Strategy)):
            raise TypeError(f"registry.add: expected a cupy_memstrat.Strategy subclass, got {cls!r}")
        req = getattr(cls, "requires", None)
        if req is not None and not (isinstance(req, str) and re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", req)):
            raise TypeError(
                f"registry.add: {cls.__qualname__}.requires must be None or a module name such as 'torch', got {req!r}"
            )
        if not isinstance(cls.aliases, tuple):
            raise TypeError(f"registry.add: {cls.__qualname__}.aliases must be a tuple of names, got {cls.aliases!r}")
        for key in (cls.name, *cls.aliases):
            if not isinstance(key, str) or not _NAME_RE.match(key):
                raise ValueError(
                    f"registry.add: {cls.__qualname__} has the name {key!r}; expected letters, digits, "
                    "'_', '-' or '.', starting with a letter"
                )
        for key in (cls.name, *cls.aliases):
            taken = self._by_name.get(key) or self._by_name.get(self._aliases.get(key, ""))
            if taken is not None:
                raise ValueError(
                    f"registry.add: strategy name {key!r} of {cls.__module__}.{cls.__qualname__} "
                    f"is already taken by {taken.__module__}.{taken.__qualname__}"
                )
        self._by_name[cls.name] = cls
        for alias in cls.aliases:
            self._aliases[alias] = cls.name

    def get(self, name: str):
        """The class registered as ``name`` (or an alias of it).

        Raises:
            ValueError: unknown name; the message lists the available ones.
        """
        canonical = self._aliases.get(name, name)
        try:
            return self._by_name[canonical]
        except KeyError:
            near = difflib.get_close_matches(
                str(name).lower(), [*self._by_name, *self._aliases], n=1, cutoff=0.6
            )
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"unknown strategy {name!r}{hint}; available: {self._listing()}") from None

    def _listing(self) -> str:
        aliases: dict[str, list[str]] = {}
        for alias, target in self._aliases.items():
            aliases.setdefault(target, []).append(alias)
        return ", ".join(
            n + (f" (alias {', '.join(sorted(aliases[n]))})" if n in aliases else "") for n in self.names()
        ) or "(none)"

    def names(self) -> list[str]:
        """Canonical names, sorted."""
        return sorted(self._by_name)

    def aliases(self) -> dict[str, str]:
        """Alias -> canonical name."""
        return dict(self._aliases)

    def describe(self) -> dict[str, str]:
        """Canonical name -> one-line description."""
        return {n: self._by_name[n].description for n in self.names()}


_registry: Registry | None = None
_pm: pluggy.PluginManager | None = None
_lock = threading.RLock()


def plugin_manager() -> pluggy.PluginManager:
    """The pluggy plugin manager with every ``cupy_memstrat`` entry point loaded."""
    global _pm
    with _lock:
        if _pm is None:
            pm = pluggy.PluginManager(hookspecs.PROJECT)
            pm.add_hookspecs(hookspecs)
            pm.load_setuptools_entrypoints(hookspecs.PROJECT)
            if pm.get_plugin("builtin") is None:
                # Running from a source tree without installed metadata: the
                # built-ins' entry point is not visible; register the module
                # it names under the same plugin name.
                from . import strategies

                pm.register(strategies, name="builtin")
            _pm = pm
        return _pm


def get_registry() -> Registry:
    """The process's registry, filled on first call from every plugin."""
    global _registry
    with _lock:
        if _registry is None:
            registry = Registry()
            plugin_manager().hook.memstrat_register_strategies(registry=registry)
            _registry = registry
        return _registry


def _reset() -> None:
    """Forget the registry and plugin manager (tests that add entry points)."""
    global _registry, _pm
    with _lock:
        _registry = None
        _pm = None
