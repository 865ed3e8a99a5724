"""Where the analyzer's data folders are: ``queries/`` (SQL) and ``reports_templates/`` (Jinja).

The one place that knows it. In the repository they are top-level folders beside ``pipelines/``; a wheel installs
them inside the package (``pipelines/queries``, ``pipelines/reports_templates``: pyproject.toml maps them), so no
generic top-level name lands in site-packages. The package's own copy is looked for first: beside an installed
``pipelines`` a ``queries`` folder may be another distribution's package.
"""
from __future__ import annotations

import pathlib

_PACKAGE = pathlib.Path(__file__).resolve().parent


def folder(name: str) -> pathlib.Path:
    """``name``'s folder: the installed package's, else the checkout's (also an editable install's)."""
    inside = _PACKAGE / name
    return inside if inside.is_dir() else _PACKAGE.parent / name
