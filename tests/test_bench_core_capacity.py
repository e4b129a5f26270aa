"""The core-capacity benchmark, short: it drives a real core through the link and reads
its figures back.

``benchmarks/bench_core_capacity.py`` ramps the load for minutes; this runs it with two
steps of each workload, unary requests both ways (relayed whole through the core, then in
one hop: facts to the core, rows granted back), as a process of its own (the tests do not
import the benchmarks), and checks what it wrote: every workload measured, every call
answered, the tensors kept off the core in one hop, and the weights held while both
tenants were backlogged. No timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT

# About 30 s here; the deadline leaves room for a loaded machine.
RUN_TIMEOUT_S = 240
WORKLOADS = ("unary_relay", "unary", "streams", "tokens")


def test_the_benchmark_measures_one_core_under_each_workload(tmp_path: Path) -> None:
    out = tmp_path / "capacity.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_core_capacity", "--quick", "--max-steps",
           "2", "--shells", "16", "--unary", "both", "--json", str(out)]  # fmt: skip
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
    assert (r["unary_relay"]["mode"], r["unary"]["mode"]) == ("relay", "one_hop")
    # Relayed, the core's sockets carry the unary calls' tensors (link and Triton both); in
    # one hop the shells send them to Triton: the core's Triton side carries none of them,
    # and its link less than the relay's (facts and grants, no tensors).
    for step in r["unary_relay"]["steps"]:
        split = step["socket_bytes_split"]
        assert split["link"] > 0 and split["triton"] > 0, split
    for relayed, step in zip(r["unary_relay"]["steps"], r["unary"]["steps"], strict=False):
        split, before = step["socket_bytes_split"], relayed["socket_bytes_split"]
        assert split["triton"] < 0.1 * before["triton"], (split, before)
        assert 0 < split["link"] < before["link"], (split, before)
    # Both tenants backlogged: what the core answered and granted follows the weights 2:1.
    for workload in ("unary_relay", "unary", "streams"):
        share = r[workload]["backlogged"]["acme_share"]
        assert abs(share - 2 / 3) < 0.05, (workload, share)
    assert r["gpus_served"]["embed_h200"]["gpus"]["measured"] > 0
