"""One registry mechanism for every kind of component a plugin can add.

A :class:`Registry` maps names to components of one kind (recipes, RL environments, renderers,
dataset formats, graders, code runners, RL losses, advantage estimators). It is filled three ways,
in this order, the first time it is read:

1. the modules named in ``builtins`` are imported (their module-level ``register`` calls or
   decorators fill it; importing them lazily keeps this package free of import circles);
2. every Python entry point of the registry's group (``prefect_tinker.<kind>``) of any installed
   distribution: an entry point ``name = "pkg.module:attr"`` registers ``attr`` under ``name``;
   one naming a module only (``name = "pkg.module"``) imports it, and the module registers
   itself (e.g. with :func:`~prefect_tinker.recipes.rl.envs.register_env`);
3. direct :meth:`Registry.register` calls at any time (a later registration of a name replaces
   the earlier one, so tests and plugins may override a built-in).

A plugin package therefore adds a component without touching this repository: it declares, in
its ``pyproject.toml``::

    [project.entry-points."prefect_tinker.losses"]
    my_loss = "my_plugin.losses:MyLoss"

A module or entry point that fails to import (a broken or half-installed plugin) does not stop the
others from loading; every later read that it may concern -- a listing, or a name that no working
module registered -- raises :class:`PluginLoadError` with the same one line naming it, while
names registered by the working ones still resolve.

The registries and their groups are listed in ``docs/recipes.md``. Entry points are read with
:func:`importlib.metadata.entry_points` (Python packaging's entry-point specification,
https://packaging.python.org/en/latest/specifications/entry-points/).
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import ModuleType
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError

__all__ = ["PluginLoadError", "Registry", "TaggedBy", "UnknownComponentError", "tagged_options", "tagged_union_schema"]

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class UnknownComponentError(ValueError):
    """A name that no registration provides; the message lists the registered names."""


class PluginLoadError(ImportError):
    """A built-in module or a plugin's entry point of a registry failed to import; raised, with
    the same one line naming it, by every read of the registry that it may concern
    (:meth:`Registry._check`)."""


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


_BY_GROUP: dict[str, Registry[Any]] = {}  # the first registry made for each entry-point group


def _registry_of(group: str, owner: str) -> Registry[Any]:
    """The registry of entry-point group ``group``, made by module ``owner`` (imported if it is not yet):
    what a pickled registry is read back as."""
    if group not in _BY_GROUP and owner:
        importlib.import_module(owner)
    return _BY_GROUP[group]


class Registry(MutableMapping[str, T], Generic[T]):
    """Components of one kind by name, filled by built-in modules, entry points and
    :meth:`register` (see the module docstring).

    A mutable mapping (``reg[name]``, ``name in reg``, iteration in registration order), so tests
    may ``monkeypatch.setitem`` it; :meth:`get_or_raise` is the lookup with a readable error.

    Args:
        kind: what is registered, in words, for error messages (``"RL loss"``).
        group: the entry-point group (``"prefect_tinker.losses"``).
        builtins: modules imported before the entry points are read (they register the
            built-in components).
    """

    def __init__(self, kind: str, group: str, builtins: Iterable[str] = ()):
        self.kind, self.group = kind, group
        self._owner = str(sys._getframe(1).f_globals.get("__name__", ""))  # the module that made it
        _BY_GROUP.setdefault(group, self)
        self._builtins = tuple(builtins)
        self._items: dict[str, T] = {}
        self._loaded = False
        self._broken: dict[str, tuple[str, BaseException]] = {}  # name -> (what, its import error)
        self._lock = threading.RLock()

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        # pickled by reference (a flow run's context sent to Ray workers carries the flow function, and
        # cloudpickle takes the globals it reads): the receiving process finds the registry of the same
        # group by importing the module that made it, so it is the one its registrations go to
        return _registry_of, (self.group, self._owner)

    def register(self, name: str, component: T) -> T:
        """Register ``component`` under ``name`` (replacing an earlier one) and return it.

        Raises:
            ValueError: an empty name.
        """
        if not name:
            raise ValueError(f"a {self.kind} needs a non-empty name")
        self._items[name] = component
        return component

    def load(self) -> None:
        """Import the built-in modules and the entry points of :attr:`group` (once; later calls
        do nothing). A module or entry point that fails to import does not stop the others: each
        is tried, and the failures are kept for :meth:`_check` to raise on every later read.
        """
        with self._lock:
            if self._loaded:
                return
            for module in self._builtins:
                try:
                    importlib.import_module(module)
                except Exception as exc:
                    self._broken[module] = (f"built-in module {module} of the {self.kind} registry", exc)
            for ep in entry_points(group=self.group):
                try:
                    obj = ep.load()
                except Exception as exc:
                    self._broken[ep.name] = (f"entry point {ep.name} = {ep.value!r} of group {self.group}", exc)
                    continue
                if not isinstance(obj, ModuleType):
                    self.register(ep.name, obj)
            self._loaded = True

    def _check(self, name: str | None = None) -> None:
        """Load, then raise :class:`PluginLoadError` when a module or entry point failed to import,
        unless ``name`` is given and registered by one that imported: a read of the whole
        registry (listing, iteration, length) or of a name that is not registered cannot tell
        whether the broken plugin would have provided it, so it fails, every time, with the same
        line."""
        self.load()
        if not self._broken or (name is not None and name in self._items and name not in self._broken):
            return
        first = next(iter(self._broken.values()))[1]
        raise PluginLoadError(
            "; ".join(f"{where} does not import: {_one_line(exc)}" for where, exc in self._broken.values())
        ) from first

    def names(self) -> list[str]:
        """Registered names, sorted.

        Raises:
            PluginLoadError: a module or entry point of the registry failed to import.
        """
        self._check()
        return sorted(self._items)

    def get_or_raise(self, name: str) -> T:
        """The component registered as ``name``.

        Raises:
            UnknownComponentError: unknown name (the message lists the registered names).
            PluginLoadError: ``name`` is not registered by a module that imported, and a module
                or entry point of the registry failed to import.
        """
        self._check(name)
        try:
            return self._items[name]
        except KeyError:
            raise UnknownComponentError(
                f"unknown {self.kind} {name!r}; registered: {', '.join(sorted(self._items)) or '(none)'}"
            ) from None

    # ----- the mapping protocol --------------------------------------------------------------
    def __getitem__(self, name: str) -> T:
        self._check(name)
        return self._items[name]

    def __setitem__(self, name: str, component: T) -> None:
        self.load()
        self.register(name, component)

    def __delitem__(self, name: str) -> None:
        self.load()
        del self._items[name]

    def __iter__(self) -> Iterator[str]:
        self._check()
        return iter(list(self._items))

    def __len__(self) -> int:
        self._check()
        return len(self._items)

    def __contains__(self, name: object) -> bool:
        self._check(name if isinstance(name, str) else None)
        return name in self._items

    def __repr__(self) -> str:
        self.load()
        broken = f", broken={sorted(self._broken)}" if self._broken else ""
        return f"Registry({self.kind!r}, group={self.group!r}, names={sorted(self._items)}{broken})"


@dataclass(frozen=True)
class TaggedBy:
    """Marks a pydantic field (``Annotated[Model, TaggedBy("env")]``) whose model the field
    ``tag`` of the same config picks from a registry; the config's own validator resolves it, so
    readers of the annotation (the CLI's unknown-key check) leave the field to that validator."""

    tag: str


def tagged_union_schema(
    schema: dict[str, Any], *, tag: str, field: str, branches: Mapping[str, dict[str, Any]], default: str
) -> None:
    """Spell out, in the JSON schema ``schema`` of a model, a ``field`` whose model the ``tag`` field
    picks from a registry (an RL config's ``env_options`` by ``env``, a source's ``options`` by
    ``format``): one ``if tag == <name> then field: <branch>`` per registered name, and one for an
    absent tag (its ``default``), added to ``allOf`` (JSON Schema 2020-12 ``if``/``then``,
    https://json-schema.org/understanding-json-schema/reference/conditionals).
    """
    rules = schema.setdefault("allOf", [])
    rules += [
        {"if": {"properties": {tag: {"const": name}}, "required": [tag]}, "then": {"properties": {field: branch}}}
        for name, branch in branches.items()
    ]
    if default in branches:
        rules.append({"if": {"not": {"required": [tag]}}, "then": {"properties": {field: branches[default]}}})


def tagged_options(tag: str, name: str, model: type[M], given: Any, *, field: str = "options") -> M:
    """``given`` as an instance of ``model``, the options model that the value ``name`` of a config's
    ``tag`` field picks (``env_options`` by ``env``, a source's ``options`` by ``format``): an instance
    is kept, another model's options are read as this one's (the fields they set), a mapping is
    validated, ``None`` gives the defaults.

    Raises:
        ValueError: one line, ``<tag> '<name>': <field>.<option>: <problem>; ...``.
    """
    if isinstance(given, model):
        return given
    if isinstance(given, BaseModel):
        given = given.model_dump(exclude_unset=True)
    try:
        return model.model_validate({} if given is None else given)
    except ValidationError as exc:
        raise ValueError(f"{tag} {name!r}: {_options_problems(exc, field)}") from None


def _options_problems(exc: ValidationError, prefix: str = "options") -> str:
    """One line of a ValidationError of an options model: ``<prefix>.<field>: <problem>; ...``."""
    return "; ".join(f"{prefix}.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
