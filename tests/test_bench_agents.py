"""The agents benchmark, short: four tenants' chats beside their agents' fan-outs, through
a real frontend and Triton, programs on and off, then the chats alone.

``benchmarks/bench_agents.py`` measures for minutes; this runs it with windows of a few
seconds and small fan-outs, as a process of its own (the tests do not import the
benchmarks), and checks what it wrote: every configuration measured, chat calls timed in
each, every call answered, output tokens counted for every tenant beside agents, the
verdict's ratios computed. No timing or share is asserted.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT

# About 50 s here; the deadline leaves room for a loaded machine.
RUN_TIMEOUT_S = 240
TENANTS = ("a", "b", "c", "d")


def test_the_benchmark_measures_chats_beside_agents_with_and_without_programs(
    tmp_path: Path,
) -> None:
    out = tmp_path / "agents.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_agents", "--quick", "--warmup-s", "1",
           "--window-s", "3", "--alone-s", "2", "--fanout", "4", "8", "--agent-tokens", "8",
           "--chat-tokens", "8", "--think-s", "0.1", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    r = json.loads(out.read_text())
    assert out.with_suffix(".png").exists()
    # What a window of a few seconds must hold on a loaded machine: something of each
    # kind, not every tenant's (a chat call queued behind a step's fan-out can take
    # longer than the window; the full run's p99 was 2.5 s).
    for name in ("programs", "light", "no_programs", "alone"):
        (run,) = r["runs"][name]
        assert all(t > 0 for t in run["chat_ttft_s"]), name
        assert set(run["share"]) == set(TENANTS), name
        assert sum(run["errors"].values()) == 0, (name, run["error_samples"])
        if name == "alone":
            assert run["chat_calls"] > 0, name
        else:
            assert sum(run["output_tokens"].values()) > 0, (name, run)
            assert sum(run["agent_steps"].values()) > 0, name
            assert math.isclose(sum(run["share"].values()), 1.0), name
    v = r["verdict"]
    assert {"p99_programs_over_no_programs", "p99_programs_over_alone"} <= set(v)
    assert {"p99_light_over_no_programs", "p99_light_over_alone"} <= set(v)
    assert set(v["met"]) == {
        "p99_vs_no_programs_le_0.5",
        "p99_vs_alone_le_2",
        "shares_within_5pct",
        "light_p99_vs_no_programs_le_0.5",
        "light_p99_vs_alone_le_2",
        "light_shares_within_5pct",
    }
