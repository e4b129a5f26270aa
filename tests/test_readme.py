"""The README's configuration and metrics references are the ones the code declares, and
its minimal config is one ``fair-frontend check-config`` says OK to as it stands."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from benchmarks import bench_engine, headline
from fair_frontend.auth import KeyRing
from fair_frontend.config import load_config, reference
from fair_frontend.core.metrics import STATE_GAUGE_LABELS, STATE_GAUGES
from fair_frontend.core.metrics import reference as metrics_reference

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def test_readme_config_reference_is_current() -> None:
    text = (ROOT / "README.md").read_text()
    embedded = text.split(START, 1)[1].split(END, 1)[0].strip()
    assert embedded == reference().strip(), "run: fair-frontend config-reference"


def test_readme_metrics_reference_is_current() -> None:
    """Every family /metrics exports, with its type, labels and help (the frontend's
    registry and the scheduler-state gauges): fair_vtc_counter was documented nowhere."""
    text = (ROOT / "README.md").read_text()
    start, end = "<!-- metrics-reference:start -->", "<!-- metrics-reference:end -->"
    embedded = text.split(start, 1)[1].split(end, 1)[0].strip()
    assert embedded == metrics_reference().strip(), "run: fair-frontend metrics-reference"
    assert "| `fair_vtc_counter` | gauge | `endpoint`, `tenant` |" in embedded
    assert set(STATE_GAUGE_LABELS) == set(STATE_GAUGES)


def test_readme_demo_keys_open_the_example_config() -> None:
    ring = KeyRing.from_config(load_config(ROOT / "examples" / "config.yaml"))
    for tenant in ("acme", "globex", "initech", "umbrella"):
        assert ring.tenant_for(f"{tenant}-demo-key") == tenant
        assert f"`{tenant}-demo-key`" in (ROOT / "README.md").read_text()


MINIMAL = "<!-- minimal-config -->"


def readme_block(marker: str) -> str:
    """The fenced block right after ``marker`` in README.md, without its fences."""
    after = (ROOT / "README.md").read_text().split(marker, 1)[1].lstrip("\n")
    assert after.startswith("```"), f"no fenced block right after {marker}"
    return after.split("\n", 1)[1].split("\n```", 1)[0] + "\n"


def test_readme_minimal_config_passes_check_config_as_pasted(tmp_path: Path) -> None:
    """Pasted into a file, the README's minimal config is OK: the CLI's check-config runs
    every check serve runs before it starts (exit 0 only when serve has nothing to say).
    It said: 'sha256:' must be followed by 64 lowercase hex digits, and the same key is
    given to tenant 'acme' (its placeholders)."""
    path = tmp_path / "config.yaml"
    path.write_text(readme_block(MINIMAL))
    out = subprocess.run(
        [sys.executable, "-m", "fair_frontend.cli", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (out.returncode, out.stderr) == (0, ""), out
    assert out.stdout == f"{path}: OK (2 tenants, 2 endpoints)\n"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but - and _ dropped,
    spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_table_of_contents_reaches_every_section() -> None:
    """Each link of the contents at the top goes to a heading or a file there is, and
    every section (##) is listed."""
    text = (ROOT / "README.md").read_text()
    toc = text.split("<!-- toc:start -->", 1)[1].split("<!-- toc:end -->", 1)[0]
    assert text.index("<!-- toc:start -->") < text.index("\n## ")
    headings = re.findall(r"^#{2,4} (.+)$", text, re.MULTILINE)
    anchors = {github_anchor(h) for h in headings}
    links = re.findall(r"\]\(([^)]+)\)", toc)
    for link in links:
        if link.startswith("#"):
            assert link[1:] in anchors, link
        else:
            assert (ROOT / link).is_file(), link
    listed = {link[1:] for link in links if link.startswith("#")}
    sections = {github_anchor(h) for h in re.findall(r"^## (.+)$", text, re.MULTILINE)}
    assert sections <= listed, sorted(sections - listed)


def test_readme_headline_figures_are_the_committed_results() -> None:
    """The front page's figures are the ones benchmarks.headline writes from
    benchmarks/results/ (they had drifted from the files: 6.2 s / 44 ms / 140x quoted,
    2.6 s / 46 ms / 56x committed)."""
    text = (ROOT / "README.md").read_text()
    assert headline.embedded(text) == headline.headline(), (
        "run: python -m benchmarks.headline --write"
    )
    assert text.index(headline.START) < text.index("\n## "), "the headline is on the front page"


def test_headline_follows_the_result_files(tmp_path: Path) -> None:
    """A new run's file changes the figures (the generator reads them, it does not
    keep them), and the scenario's fixed numbers are bench_engine's own."""
    for name in ("noisy_neighbour.json", "engine.json"):
        (tmp_path / name).write_text((headline.RESULTS / name).read_text())
    noisy = json.loads((tmp_path / "noisy_neighbour.json").read_text())
    noisy["burst"] = 10_000
    noisy["targets"]["triton direct"]["after"]["b_max_ms"] = 6_197.0
    (tmp_path / "noisy_neighbour.json").write_text(json.dumps(noisy))
    paragraph = headline.headline(tmp_path)
    assert "bursts 10,000 requests" in paragraph
    assert "straight to Triton 6.2 s" in paragraph
    assert paragraph != headline.headline()
    assert (bench_engine.SLOTS, bench_engine.RESERVED) == (
        headline.ENGINE_SLOTS,
        headline.ENGINE_RESERVED,
    )
    assert (bench_engine.B_REQUESTS, bench_engine.B_TOKENS) == (
        headline.B_REQUESTS,
        headline.B_TOKENS,
    )


def test_readme_architecture_picture_has_every_part() -> None:
    """clients -> shells -> core -> Tritons, Redis and Prometheus, as a mermaid block
    on the front page (GitHub draws it)."""
    block = readme_block("<!-- architecture -->")
    text = (ROOT / "README.md").read_text()
    assert text.index("<!-- architecture -->") < text.index("\n## ")
    assert block.startswith("flowchart")
    edges = {
        ("clients", "shells"),
        ("shells", "core"),
        ("core", "tritons"),
        ("shells", "tritons"),
        ("core", "redis"),
        ("prometheus", "core"),
        ("prometheus", "tritons"),
    }
    found = set(re.findall(r"^\s*(\w+)\s*[-.<>]+(?:\|[^|]*\|)?\s*(\w+)\s*$", block, re.MULTILINE))
    assert edges <= found, sorted(edges - found)
