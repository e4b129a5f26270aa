"""What docs/PROTOCOL.md and the README's troubleshooting tell clients to match is what
the code says: each message quoted there (in backticks, with words in capitals such as
NAME, N, MODEL, TENANT, and "...", standing for what varies) is, piece by piece, a
string of fair_frontend's source."""

from __future__ import annotations

import re
from pathlib import Path

from fair_frontend.admission.throttle import ThrottleDecision, overloaded_error
from fair_frontend.errors import QueueFull

ROOT = Path(__file__).resolve().parent.parent
PLACEHOLDER = re.compile(
    r"\b(?:NAME|N|MODEL|TENANT|LIMIT|WAIT|TARGET|CAP|MESSAGE|IDENTITY|UNIT)\b|\.\.\."
)
# Adjacent string literals on consecutive lines ("... " "..."), joined as Python joins them.
_ADJACENT = re.compile(r"\"\s*\n\s*(?:rf|fr|f|r)?\"")


def source_text() -> str:
    """Every module of the package, its implicitly concatenated strings joined."""
    return "\n".join(
        _ADJACENT.sub("", p.read_text()) for p in sorted((ROOT / "fair_frontend").rglob("*.py"))
    )


def missing_from_source(message: str, source: str) -> list[str]:
    """The pieces of ``message`` (split at its placeholders, without the quotes, brackets
    and spaces at their ends, which the code writes around what varies) that the source
    lacks."""
    pieces = [piece.strip(" '()") for piece in PLACEHOLDER.split(message)]
    return [piece for piece in pieces if len(piece) >= 3 and piece not in source]


def composed_messages() -> list[str]:
    """Messages whose fixed words the source writes apart (a constant, a phrase chosen
    at run time), as the code composes them."""
    out = [QueueFull("global max_queued=10000").message]
    for deadline in (False, True):
        decision = ThrottleDecision(False, 2.5, 1.0, 4, "over target", deadline, 1.5)
        out.append(overloaded_error(decision, "llm").message)
    return out


def unsaid(message: str, source: str) -> list[str]:
    """What of ``message`` the code does not say: nothing where ``message``, its
    placeholders standing for anything, is one the code composes whole; else the
    pieces the source lacks."""
    pattern = ".+?".join(re.escape(piece) for piece in PLACEHOLDER.split(message))
    if any(re.search(pattern, m) for m in composed_messages()):
        return []
    return missing_from_source(message, source)


def protocol_error_rows() -> list[tuple[str, str, str]]:
    """(situation, HTTP status, message column) of docs/PROTOCOL.md's errors table."""
    text = (ROOT / "docs" / "PROTOCOL.md").read_text()
    table = text.split("## Errors", 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("situation", "---"):
            rows.append((cells[0], cells[2], cells[3]))
    return rows


def test_protocol_errors_table_quotes_the_codes_messages() -> None:
    rows = protocol_error_rows()
    statuses = {status.split()[0] for _, status, _ in rows}
    assert {"400", "401", "403", "408", "429", "501", "503"} <= statuses
    source = source_text()
    problems = []
    for situation, _, column in rows:
        for message in re.findall(r"`([^`]+)`", column):
            missing = unsaid(message, source)
            if missing:
                problems.append(f"{situation}: {message!r} lacks {missing}")
    assert not problems, "\n".join(problems)


def test_the_check_finds_a_message_the_code_does_not_say() -> None:
    source = source_text()
    assert missing_from_source("tenant 'TENANT' may not use model 'MODEL'", source) == []
    assert missing_from_source("tenant 'TENANT' may not call model 'MODEL'", source)


def readme_troubleshooting() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("\n## Troubleshooting\n", 1)[1].split("\n## ", 1)[0]


def shown_messages(section: str) -> list[str]:
    """The messages of the section's "**Shows:**" bullets (not "**Shows (kubectl):**"):
    the backticked strings with a space (a header's name has none)."""
    bullets = re.split(r"\n(?=- )", section)
    return [
        message
        for bullet in bullets
        if bullet.startswith("- **Shows:**")
        for message in re.findall(r"`([^`]+)`", bullet)
        if " " in message
    ]


def test_readme_troubleshooting_quotes_the_codes_messages() -> None:
    section = readme_troubleshooting()
    for symptom in ("401", "403", "429", "503", "ImagePullBackOff", "0/1 Ready"):
        assert re.search(rf"^#### .*{re.escape(symptom)}", section, re.MULTILINE), symptom
    messages = shown_messages(section)
    assert len(messages) >= 12, messages
    source = source_text()
    problems = [f"{m!r} lacks {missing}" for m in messages if (missing := unsaid(m, source))]
    assert not problems, "\n".join(problems)
