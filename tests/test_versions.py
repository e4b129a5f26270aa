"""One version: ``pyproject.toml``'s. The package's ``__version__`` (what the frontend
says in ``x-fair-frontend`` and its server metadata), the Helm chart's ``version`` and
``appVersion``, and the newest entry of ``CHANGELOG.md`` all say the same; an entry for
each version the chart has carried since the first release with a changelog."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

import fair_frontend

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "docker" / "helm" / "fair-frontend" / "Chart.yaml"
# A released entry's heading, Keep a Changelog's form: "## [0.2.0] - 2026-12-06".
RELEASE = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", re.MULTILINE)


def _pyproject_version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def test_the_package_chart_and_changelog_say_pyprojects_version() -> None:
    version = _pyproject_version()
    assert fair_frontend.__version__ == version
    chart = yaml.safe_load(CHART.read_text())
    assert (chart["version"], chart["appVersion"]) == (version, version)
    text = (ROOT / "CHANGELOG.md").read_text()
    releases = RELEASE.findall(text)
    assert releases, "CHANGELOG.md has no '## [x.y.z] - YYYY-MM-DD' entry"
    assert releases[0][0] == version, f"newest CHANGELOG entry {releases[0][0]}, not {version}"
    # Newest first, each version once, dates never going forward down the file.
    numbers = [tuple(map(int, v.split("."))) for v, _ in releases]
    assert numbers == sorted(set(numbers), reverse=True)
    dates = [d for _, d in releases]
    assert dates == sorted(dates, reverse=True)
    # Anything above the newest release is the Unreleased section only.
    assert text.index("## [Unreleased]") < text.index(f"## [{version}]")


def test_the_version_is_written_once() -> None:
    """No file of the package or the chart writes the version itself: each reads it
    (the chart's is checked above, since Chart.yaml cannot read pyproject.toml)."""
    version = _pyproject_version()
    written = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "fair_frontend").rglob("*.py"))
        if re.search(rf"['\"]{re.escape(version)}['\"]", p.read_text())
    ]
    assert written == []
