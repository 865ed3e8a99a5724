"""The patch handle every ``rlkernel.integrations`` module returns, and the one version check they share.

A patch replaces attributes (a module global, a class method, a model's ``forward``) and ``undo()`` puts back
exactly what was there. Patching the framework's own entry point, not the submodules around a wrapper, keeps DDP,
FSDP and ZeRO hooks in the call path: the wrapper still calls the patched code.
"""
from __future__ import annotations

import re
import sys
from collections.abc import Callable


class _CopiedAsItself:
    """An object there is one of per process: a copy, deep or not, is the object itself (a deep copy of a patched
    model or class carries its Patch, and with it these)."""

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


class _Missing(_CopiedAsItself):
    """No instance attribute was there before the patch (it is deleted on undo): the one sentinel, so the patch a
    deep copy of a patched model carries still recognises it."""


_MISSING = _Missing()


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
    """One applied patch: ``targets`` ``[(owner, attr, new)]`` are replaced together, and ``undo()`` restores each
    (a second undo does nothing); also a context manager (``with apply(...):`` undoes on exit)."""

    def __init__(self, name: str, targets: list, options: dict, on_undo: Callable[[Patch], None] | None = None):
        self.name = name
        self.options = dict(options)
        self._on_undo = on_undo
        # an instance attribute that was not there (a model's forward comes from its class) is deleted on undo
        self._targets = [(owner, attr, new, vars(owner).get(attr, _MISSING)) for owner, attr, new in targets]
        for owner, attr, new, _ in self._targets:
            setattr(owner, attr, new)
        self.active = True

    def undo(self) -> None:
        if not self.active:
            return
        for owner, attr, new, _ in self._targets:
            if vars(owner).get(attr, _MISSING) is not new:
                raise RuntimeError(f"{self.name}: cannot undo, {attr} was replaced again after this patch "
                                   f"(undo the later patch first)")
        for owner, attr, _, previous in reversed(self._targets):
            if previous is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, previous)
        self.active = False
        if self._on_undo is not None:
            self._on_undo(self)  # this patch, not one a closure captured (a deep copy of a model carries its patch)

    def owners(self) -> list:
        """The objects whose attributes this patch replaced, in order."""
        return [owner for owner, _, _, _ in self._targets]

    def __enter__(self) -> Patch:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"<rlkernel patch {self.name} ({'active' if self.active else 'undone'})>"


def check_options(backend: str, require_fused: bool) -> None:
    """The rlkernel ops' rules for ``backend`` / ``require_fused``, checked when a patch is applied, not at its
    first call."""
    from rlkernel.dispatch import BACKENDS

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "native" and require_fused:
        raise ValueError('backend="native" contradicts require_fused=True')


def reuse(existing: Patch | None, name: str, options: dict) -> Patch | None:
    """Idempotence: the active patch of the same target when its options are the same; ValueError when they
    differ (undo it first); None when there is none."""
    if existing is None or not existing.active:
        return None
    if existing.options != options:
        raise ValueError(f"{name} is already applied with {existing.options}; undo() it before applying {options}")
    return existing


class ProcessPatch(_CopiedAsItself):
    """The one patch of a process-wide integration (a framework's module functions or classes): the active Patch,
    the rlkernel ops' options its replacements call with, and the framework's own functions they replaced, kept
    past undo(): a framework module imported while the patch was active bound a replacement, which then calls the
    framework's own again (replacements check ``active``). Undoing a deep copy of its patch (a patch of classes)
    frees this slot, the one per process."""

    def __init__(self, name: str):
        self.name = name
        self.patch: Patch | None = None
        self.options: dict = {}
        self.originals: dict = {}

    @property
    def active(self) -> bool:
        return self.patch is not None

    def reuse(self, recorded: dict) -> Patch | None:
        """``reuse`` for this integration's active patch."""
        return reuse(self.patch, self.name, recorded)

    def install(self, targets: list, recorded: dict, options: dict | None = None) -> Patch:
        """Replace ``targets`` [(owner, attr, new)] as one Patch (``recorded``: its options, for ``reuse``) and keep
        each replaced function, by name, in ``originals``."""
        self.originals.update({attr: vars(owner)[attr] for owner, attr, _ in targets if attr in vars(owner)})
        self.options = dict(options or {})
        self.patch = Patch(self.name, targets, recorded, on_undo=self._undone)
        return self.patch

    def _undone(self, _patch: Patch) -> None:
        self.patch, self.options = None, {}


def bound_by_name(prefix: str, targets: list) -> list:
    """[(module, attr, new)] for every loaded module under ``prefix`` that bound one of ``targets``' functions by
    name (``from .utils import f``) before the patch: patched beside ``targets`` [(owner, attr, new)], whose owners
    still hold the originals."""
    found = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith(prefix):
            continue
        found += [(mod, attr, new) for owner, attr, new in targets
                  if mod is not owner and vars(mod).get(attr) is vars(owner)[attr]]
    return found
