"""The README's front-page figures, written from the committed result files.

``python -m benchmarks.headline`` prints the paragraph; ``--write`` puts it into
README.md between its markers. ``tests/test_readme.py`` holds the README equal to what
this writes, so a new run of either benchmark (its result file committed) changes the
front page with it, or fails the test until ``--write`` is run.

The figures: ``results/noisy_neighbour.json`` (``bench_noisy_neighbour``: B's worst of its
5 requests sent once A's burst has arrived, at B's own client, per target; B alone the
median of its solo requests; A's batch time) and ``results/engine.json``
(``bench_engine --scenarios noisy``: B's worst time to first token beside A's streams).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
START, END = "<!-- headline:start -->", "<!-- headline:end -->"
# bench_engine's noisy scenario (its SLOTS, RESERVED, B_REQUESTS, B_TOKENS): fixed in
# that file, not written to its results; checked against it by tests/test_readme.py.
ENGINE_SLOTS, ENGINE_RESERVED, B_REQUESTS, B_TOKENS = 64, 8, 5, 16


def ms(value: float) -> str:
    """A latency in milliseconds as the README writes it: seconds from 1 s on."""
    if value >= 1000:
        return seconds(value / 1000)
    return f"{value:.1f} ms" if value < 10 else f"{value:.0f} ms"


def seconds(value: float) -> str:
    return f"{value:.2f} s" if value < 1 else f"{value:.1f} s"


def load(name: str, results: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((results / name).read_text())
    return data


def headline(results: Path = RESULTS) -> str:
    noisy = load("noisy_neighbour.json", results)
    targets = noisy["targets"]
    shells = noisy["shells"]
    fair = targets[f"frontend fair, {shells} shells"]["after"]
    direct = targets["triton direct"]["after"]["b_max_ms"]
    fifo = targets["frontend fifo"]["after"]["b_max_ms"]
    engine = load("engine.json", results)
    runs = engine["noisy"]
    args = engine["args"]
    return (
        "**The noisy neighbour, measured here** (`benchmarks/bench_noisy_neighbour.py`, one run\n"
        "in `benchmarks/results/noisy_neighbour.json`, one Triton, the `embed` model, B's\n"
        f"latency at its own client process): tenant A bursts {noisy['burst']:,} requests, "
        f"tenant B sends\n{B_REQUESTS} once A's burst has arrived. B's worst: straight to "
        f"Triton {ms(direct)}; through the\nfrontend in `fifo` mode (one queue, as Triton) "
        f"{ms(fifo)}; in `fair` mode with {shells} shell processes\n{ms(fair['b_max_ms'])}, "
        f"{direct / fair['b_max_ms']:.0f}x less than straight to Triton (B alone: "
        f"{ms(statistics.median(fair['b_solo_ms']))}; A's batches\ntake "
        f"{ms(fair['a_batch_s'] * 1000)}). For streamed generation "
        "(`benchmarks/bench_engine.py`, `results/engine.json`,\n"
        f"the `llm` engine with {ENGINE_SLOTS} slots): A holds every slot with "
        f"{args['hog']} streams of {args['hog_tokens']} tokens, B\nasks for {B_TOKENS} "
        f"tokens {B_REQUESTS} times at once; B's first token comes after "
        f"{seconds(runs['triton']['worst_ttft_s'])} straight to\nTriton, "
        f"{seconds(runs['fifo']['worst_ttft_s'])} in `fifo` mode, "
        f"{seconds(runs['fair']['worst_ttft_s'])} in `fair` mode (one slot's turnover: "
        f"{seconds(runs['fair']['bound_s'])}),\n"
        f"{seconds(runs['fair_reserved']['worst_ttft_s'])} with `reserved_slots: "
        f"{ENGINE_RESERVED}`, the shipped config (B alone: "
        f"{seconds(statistics.median(runs['fair_reserved']['solo_ttft_s']))}). "
        "More in\n[Benchmarks](#benchmarks)."
    )


def embedded(text: str) -> str:
    """What ``text`` (a README) has between the markers."""
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def rewrite(text: str, paragraph: str) -> str:
    before, rest = text.split(START, 1)
    return f"{before}{START}\n{paragraph}\n{END}{rest.split(END, 1)[1]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--write", action="store_true", help="put it into README.md")
    args = parser.parse_args(argv)
    paragraph = headline()
    if args.write:
        README.write_text(rewrite(README.read_text(), paragraph))
    else:
        sys.stdout.write(paragraph + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
