"""The core-capacity benchmark, short: it drives a real core through the link and reads
its figures back.

``benchmarks/bench_core_capacity.py`` ramps the load for minutes; this runs it with two
steps of each workload, as a process of its own (the tests do not import the
benchmarks), and checks what it wrote: every workload measured, every call answered,
and the weights held while both tenants were backlogged. No timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT

# About 30 s here; the deadline leaves room for a loaded machine.
RUN_TIMEOUT_S = 240
WORKLOADS = ("unary", "streams", "tokens")


def test_the_benchmark_measures_one_core_under_each_workload(tmp_path: Path) -> None:
    out = tmp_path / "capacity.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_core_capacity", "--quick", "--max-steps",
           "2", "--shells", "16", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    r = json.loads(out.read_text())
    for workload in WORKLOADS:
        steps = r[workload]["steps"]
        assert len(steps) >= 1, workload
        for step in steps:
            assert step["faults"] == 0, (workload, step)
            assert step["done_per_s"] > 0 and step["core_cpu_us"] > 0, (workload, step)
        assert r[workload]["saturation_per_s"] > 0
    # The core's sockets carried the unary calls (link and Triton both).
    split = r["unary"]["steps"][0]["socket_bytes_split"]
    assert split["link"] > 0 and split["triton"] > 0, split
    # Both tenants backlogged: what the core answered and granted follows the weights 2:1.
    for workload in ("unary", "streams"):
        share = r[workload]["backlogged"]["acme_share"]
        assert abs(share - 2 / 3) < 0.05, (workload, share)
    assert r["gpus_served"]["embed_h200"]["gpus"]["measured"] > 0
