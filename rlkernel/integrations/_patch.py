"""The patch handle every ``rlkernel.integrations`` module returns, and the one version check they share.

A patch replaces one attribute (a module global, a class method, a model's ``forward``) and ``undo()`` puts back
exactly what was there. Patching the framework's own entry point, not the submodules around a wrapper, keeps DDP,
FSDP and ZeRO hooks in the call path: the wrapper still calls the patched code.
"""
from __future__ import annotations

import re
from collections.abc import Callable

_MISSING = object()


class UnsupportedVersionError(RuntimeError):
    """The installed framework is outside the versions an integration supports (the one error apply raises)."""


def release(version: str) -> tuple[int, ...]:
    """The leading release numbers of a version string: '5.25.0' -> (5, 25, 0), '1.16.0.dev0' -> (1, 16, 0)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(version))
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def check_version(integration: str, framework: str, version: str, minimum: tuple[int, ...],
                  below: tuple[int, ...]) -> None:
    """Raise UnsupportedVersionError unless ``minimum <= version < below`` (release numbers, pre-releases as their
    release)."""
    rel = release(version)
    if not rel or not minimum <= rel < below:
        raise UnsupportedVersionError(
            f"rlkernel.integrations.{integration} supports {framework} >={'.'.join(map(str, minimum))},"
            f"<{'.'.join(map(str, below))}; found {framework} {version}")


class Patch:
    """One applied patch: ``undo()`` restores the patched attribute (a second undo does nothing); also a context
    manager (``with apply(...):`` undoes on exit)."""

    def __init__(self, name: str, owner, attr: str, new, options: dict, on_undo: Callable[[], None] | None = None):
        self.name = name
        self.options = dict(options)
        self._owner, self._attr, self._new, self._on_undo = owner, attr, new, on_undo
        # an instance attribute that was not there (a model's forward comes from its class) is deleted on undo
        self._previous = vars(owner).get(attr, _MISSING)
        setattr(owner, attr, new)
        self.active = True

    @property
    def replacement(self):
        return self._new

    def undo(self) -> None:
        if not self.active:
            return
        current = vars(self._owner).get(self._attr, _MISSING)
        if current is not self._new:
            raise RuntimeError(f"{self.name}: cannot undo, {self._attr} was replaced again after this patch "
                               f"(undo the later patch first)")
        if self._previous is _MISSING:
            delattr(self._owner, self._attr)
        else:
            setattr(self._owner, self._attr, self._previous)
        self.active = False
        if self._on_undo is not None:
            self._on_undo()

    def __enter__(self) -> Patch:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"<rlkernel patch {self.name} ({'active' if self.active else 'undone'})>"


def reuse(existing: Patch | None, name: str, options: dict) -> Patch | None:
    """Idempotence: the active patch of the same target when its options are the same; ValueError when they
    differ (undo it first); None when there is none."""
    if existing is None or not existing.active:
        return None
    if existing.options != options:
        raise ValueError(f"{name} is already applied with {existing.options}; undo() it before applying {options}")
    return existing
