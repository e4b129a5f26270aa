"""The README's configuration reference is the one the code declares."""

from __future__ import annotations

from pathlib import Path

from fair_frontend.auth import KeyRing
from fair_frontend.config import load_config, reference

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def test_readme_config_reference_is_current() -> None:
    text = (ROOT / "README.md").read_text()
    embedded = text.split(START, 1)[1].split(END, 1)[0].strip()
    assert embedded == reference().strip(), "run: fair-frontend config-reference"


def test_readme_demo_keys_open_the_example_config() -> None:
    ring = KeyRing.from_config(load_config(ROOT / "examples" / "config.yaml"))
    for tenant in ("acme", "globex", "initech", "umbrella"):
        assert ring.tenant_for(f"{tenant}-demo-key") == tenant
        assert f"`{tenant}-demo-key`" in (ROOT / "README.md").read_text()
