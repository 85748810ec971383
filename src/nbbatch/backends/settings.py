"""Backend settings, declared once: a frozen dataclass per backend whose fields carry what a setting accepts.

A backend's settings are the experiment's ``backend:`` mapping (and the keywords Python callers pass). Each is
one field of the backend's :attr:`~nbbatch.backends.base.Backend.Settings` dataclass: its annotation says
which types it takes, its default is the default, and :func:`setting` adds the rest (a minimum, the only
values allowed, values a form suggests, the form's label, whether it is for Python callers only, the command-line
option that sets it)::

    @dataclass(frozen=True)
    class LocalSettings:
        max_parallel: int | None = field(default=None, metadata=setting(minimum=1))

:func:`setting_table` turns the dataclass into :class:`Setting` rows, which drive validation
(:func:`validated`: unknown names get "did you mean", values are checked, secrets never echoed), the
Jupyter form (:mod:`nbbatch.ui.widgets.cluster`), what is kept on disk
(:meth:`~nbbatch.backends.base.Backend.storable_settings`) and a managed cluster's command line
(:mod:`nbbatch.backends.cluster`). A group of settings that belongs together (a cluster's size) is a dataclass
of its own that the backend's settings extend.
"""

from __future__ import annotations

import dataclasses
import functools
import reprlib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nbbatch.errors import BackendError, did_you_mean
from nbbatch.redact import has_secret, is_secret

_METADATA_KEY = "nbbatch.setting"


@dataclass(frozen=True)
class Setting:
    """One backend setting: what it accepts, its default, and how a form shows it."""

    default: Any = None
    kinds: tuple[type, ...] = ()  # accepted types (empty: anything); bool is never taken for a number
    minimum: float | None = None
    choices: tuple[Any, ...] = ()  # the only values allowed
    suggestions: tuple[Any, ...] = ()  # values a form offers (others are allowed)
    label: str | None = None  # shown in a form (settings without one are not in the form)
    python_only: bool = False  # an object for Python callers and tests (a client, a credential): never stored or shown
    option: str | None = None  # the command-line option that sets it (``nbbatch cluster --max-nodes``), if any

    def problem(self, value: Any) -> str | None:
        """What ``value`` must be instead, e.g. ``"an integer ≥ 1"`` (None: it is fine)."""
        if value is None:
            return None
        numeric = bool(self.kinds) and all(k in (int, float) for k in self.kinds)
        wrong_kind = bool(self.kinds) and (not isinstance(value, self.kinds) or (numeric and isinstance(value, bool)))
        if wrong_kind or (self.minimum is not None and value < self.minimum):
            return self._description()
        if self.choices and value not in self.choices:
            return " or ".join(f"`{c}`" for c in self.choices)
        return None

    def _description(self) -> str:
        if float in self.kinds:
            what = "a number"
        else:
            what = " or ".join(_KIND_NAMES.get(k.__name__, k.__name__) for k in self.kinds) or "a value"
        return what + (f" ≥ {self.minimum:g}" if self.minimum is not None else "")


_KIND_NAMES = {"int": "an integer", "str": "a string", "bool": "true or false", "dict": "a mapping",
               "Mapping": "a mapping", "list": "a list", "PathLike": "a path"}


def setting(*, minimum: float | None = None, choices: tuple[Any, ...] = (), suggestions: tuple[Any, ...] = (),
            label: str | None = None, python_only: bool = False, option: str | None = None) -> dict[str, Setting]:
    """A settings field's ``metadata``: what its annotation and default do not say.

    ``python_only`` settings (a client, a credential) take any object: tests pass doubles for them. ``option``
    names the command-line option that sets it (a managed cluster's settings: ``nbbatch cluster``).
    """
    return {_METADATA_KEY: Setting(minimum=minimum, choices=tuple(choices), suggestions=tuple(suggestions),
                                   label=label, python_only=python_only, option=option)}


@dataclass(frozen=True)
class NoSettings:
    """The settings of a backend that has none."""


@functools.cache
def setting_table(settings_class: type) -> dict[str, Setting]:
    """The settings a settings dataclass declares, by name, in declaration order."""
    hints = typing.get_type_hints(settings_class)
    table = {}
    for spec in dataclasses.fields(settings_class):
        declared = spec.metadata.get(_METADATA_KEY) or Setting()
        default = spec.default if spec.default is not dataclasses.MISSING else None
        kinds = () if declared.python_only else _kinds(hints[spec.name])
        table[spec.name] = dataclasses.replace(declared, default=default, kinds=kinds)
    return table


def _kinds(annotation: Any) -> tuple[type, ...]:
    """The types a value of ``annotation`` may have (empty: any); ``float`` takes integers too, ``None`` is implied."""
    if annotation is Any:
        return ()
    union = isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union  # X | Y, Optional[X]
    members = typing.get_args(annotation) if union else (annotation,)
    kinds: list[type] = []
    for member in members:
        if member is Any:
            return ()
        origin = typing.get_origin(member) or member
        if origin is type(None):
            continue
        kinds += [int, float] if origin is float else [origin]
    return tuple(dict.fromkeys(kinds))


def validated(settings_class: type, backend: str, values: Mapping[str, Any], hint: str = "") -> Any:
    """``settings_class(**values)``, after checking every value; a :class:`BackendError` names the first mistake.

    Values are never echoed for secret-looking names: a mistaken setting may hold a key. ``hint`` is added to
    the unknown-setting error (e.g. where else a key belongs).
    """
    table = setting_table(settings_class)
    unknown = sorted(str(k) for k in values if k not in table)
    if unknown:
        bad = unknown[0]
        known = [k for k, s in table.items() if not s.python_only]
        raise BackendError(f"unknown {backend} backend setting `{bad}`{did_you_mean(bad, known)}; "
                           f"known: {', '.join(known) or '(none)'}{f'; {hint}' if hint else ''}")
    for key, value in values.items():
        problem = table[key].problem(value)
        if problem:
            shown = "a value" if is_secret(key) or has_secret(value) else reprlib.repr(value)
            raise BackendError(f"{backend} backend setting `{key}` must be {problem} (got {shown})")
    return settings_class(**values)


def settings_values(settings: Any) -> dict[str, Any]:
    """A settings dataclass's values by name (shallow: clients and credentials stay the same objects)."""
    return {spec.name: getattr(settings, spec.name) for spec in dataclasses.fields(settings)}


__all__ = ["NoSettings", "Setting", "setting", "setting_table", "settings_values", "validated"]
