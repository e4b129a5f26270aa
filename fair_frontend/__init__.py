"""fair_frontend: a multi-tenant fair scheduler for LLM inference in front of Triton.

It speaks Triton's own protocol (KServe v2 over HTTP and gRPC) and puts every request
through admission, tier, deficit round robin and priority before batching it to Triton.
See README.md for the design and ``fair_frontend.scheduler`` for the algorithm.

``__version__`` is ``pyproject.toml``'s, the one place the version is written: read from
the installed package's metadata, or from ``pyproject.toml`` itself where the package runs
from a checkout (an editable install's metadata is written at install time, and a checkout
on ``PYTHONPATH`` has none of its own). ``tests/test_versions.py`` holds the Helm chart and
``CHANGELOG.md`` to it.
"""

from __future__ import annotations

import contextlib
import tomllib
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "fair-frontend"


def _version() -> str:
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    with contextlib.suppress(OSError, tomllib.TOMLDecodeError, KeyError, TypeError):
        project = tomllib.loads(pyproject.read_text())["project"]
        if project["name"] == DISTRIBUTION:
            return str(project["version"])
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = _version()
