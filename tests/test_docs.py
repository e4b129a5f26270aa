"""What docs/PROTOCOL.md and the README's troubleshooting tell clients to match is what
the code says: each message quoted there (in backticks, with NAME, N, MODEL and TENANT
standing for what varies) is, piece by piece, a string of fair_frontend's source."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLACEHOLDER = re.compile(r"\b(?:NAME|N|MODEL|TENANT)\b")
# Adjacent string literals on consecutive lines ("... " "..."), joined as Python joins them.
_ADJACENT = re.compile(r"\"\s*\n\s*(?:rf|fr|f|r)?\"")


def source_text() -> str:
    """Every module of the package, its implicitly concatenated strings joined."""
    return "\n".join(
        _ADJACENT.sub("", p.read_text()) for p in sorted((ROOT / "fair_frontend").rglob("*.py"))
    )


def missing_from_source(message: str, source: str) -> list[str]:
    """The pieces of ``message`` (split at its placeholders) that the source lacks."""
    pieces = [piece for piece in PLACEHOLDER.split(message) if len(piece.strip(" '()")) >= 3]
    return [piece for piece in pieces if piece not in source]


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
            missing = missing_from_source(message, source)
            if missing:
                problems.append(f"{situation}: {message!r} lacks {missing}")
    assert not problems, "\n".join(problems)


def test_the_check_finds_a_message_the_code_does_not_say() -> None:
    source = source_text()
    assert missing_from_source("tenant 'TENANT' may not use model 'MODEL'", source) == []
    assert missing_from_source("tenant 'TENANT' may not call model 'MODEL'", source)
