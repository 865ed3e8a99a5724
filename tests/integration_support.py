"""Importing a framework for the tests of rlkernel.integrations: skipped cleanly where it is absent (the plain
`py` env), required where its own tox env says so (RLKERNEL_REQUIRE_INTEGRATIONS=trl,... : a missing package or an
unsupported version then fails instead of skipping)."""
from __future__ import annotations

import importlib
import os

import pytest

REQUIRE_ENV = "RLKERNEL_REQUIRE_INTEGRATIONS"


def required(framework: str) -> bool:
    return framework in {x.strip() for x in os.environ.get(REQUIRE_ENV, "").split(",") if x.strip()}


def framework(module: str, integration: str):
    """The framework's module for the tests of ``rlkernel.integrations.<integration>``: imported (ImportError in
    its own env), or the test module skipped; also skipped (failed in its own env) when the installed version is
    one the integration does not support."""
    if required(integration):
        mod = importlib.import_module(module)
    else:
        mod = pytest.importorskip(module)
    from importlib import metadata

    from rlkernel.integrations import _patch

    adapter = importlib.import_module(f"rlkernel.integrations.{integration}")
    try:
        version = getattr(mod, "__version__", None) or metadata.version(module)  # openrlhf has no __version__
        _patch.check_version(integration, module, version, adapter.MINIMUM, adapter.BELOW)
    except _patch.UnsupportedVersionError as exc:
        if required(integration):
            raise
        pytest.skip(str(exc), allow_module_level=True)
    return mod
