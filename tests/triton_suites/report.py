"""Triton's client examples and QA tests, Triton direct vs through the frontend (issue 12).

Run from the repository root: ``python -m tests.triton_suites.report``. Starts one
Triton (the test model repositories) and one frontend in front of it (the test tenants),
runs every vendored item on both sides (``tests/triton_suites/runner.py``), prints the pass
counts per suite and every difference with its reason, and writes
``benchmarks/results/triton_suites.json``. The pytest module
``tests/triton_suites/test_triton_suites.py`` asserts on the same run. (It lives with the
suites it runs, not in ``benchmarks/``: the benchmarks do not import the tests.)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from fair_frontend.backends.triton.embedded import EmbeddedTriton, default_model_repository
from tests.support import KEYS, TEST_MODEL_REPOSITORY, make_config, running_frontend
from tests.triton_suites.runner import DIRECT, FRONTEND, SIDES, Results, Target, run_all, summary

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "triton_suites.json"
TENANT = "acme"


def run(jobs: int, workers: int) -> tuple[Results, float]:
    """Both sides against one Triton; returns the results and the wall time."""
    triton = EmbeddedTriton([default_model_repository(), TEST_MODEL_REPOSITORY])
    triton.start()
    try:
        with running_frontend(make_config(), triton, workers=workers) as front:
            targets = {
                DIRECT: Target(triton.http_url.removeprefix("http://"), triton.grpc_url),
                FRONTEND: Target(front.http_url, front.grpc_url, KEYS[TENANT]),
            }
            started = time.monotonic()
            results = run_all(targets, jobs=jobs)
            return results, time.monotonic() - started
    finally:
        triton.stop()


def render(report: dict[str, object]) -> str:
    lines = [f"{'suite':22} {'items':>5} {'direct':>7} {'frontend':>9}"]
    counts = report["counts"]
    assert isinstance(counts, dict)
    for suite, row in counts.items():
        lines.append(f"{suite:22} {row['items']:>5} {row[DIRECT]:>7} {row[FRONTEND]:>9}")
    lines.append("")
    differences = report["differences"]
    assert isinstance(differences, list)
    lines.append(f"differences ({len(differences)}):")
    for diff in differences:
        why = diff["named_exception"] or diff["known"] or "UNEXPLAINED (neither named nor known)"
        lines.append(f"- {diff['item']}: direct {diff['direct']}, frontend {diff['frontend']}")
        lines.append(f"    reason: {why}")
        answer = diff["frontend_output"].strip().splitlines()
        if answer:
            lines.append(f"    frontend's client said: {answer[-1][:200]}")
    not_run = report["not_run"]
    assert isinstance(not_run, dict)
    lines.append("")
    lines.append("not run:")
    lines += [f"- {item}: {why}" for item, why in not_run.items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=6, help="client subprocesses at once")
    parser.add_argument("--workers", type=int, default=1, help="the frontend's shell processes")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    results, seconds = run(args.jobs, args.workers)
    report = summary(results)
    report["wall_seconds"] = round(seconds, 1)
    report["outcomes"] = {
        side: {
            item: {"passed": o.passed, "output": o.output}
            for item, o in sorted(results.outcomes[side].items())
        }
        for side in SIDES
    }
    print(render(report))
    print(f"\n{seconds:.0f} s; written to {args.out}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
