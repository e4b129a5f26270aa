"""Programs inside tenants (issue 33, "Targets": "Agents"): a tenant's chat beside its
own agent's fan-outs, on the engine-mode ``llm`` endpoint behind the frontend.

Four tenants, weights 2:1:1:1 in one tier; each tenant's client is a process of its own
(as on its own machine) and runs two programs over HTTP (``generate_stream``, the
program named in ``x-program-id``):

- a chat program: one streamed call at a time (``--chat-tokens`` output tokens, a short
  prompt), a little think time between calls; its time to first token (TTFT) is timed at
  the client;
- an agent program: steps that fan out ``--fanout`` calls at once (between its two
  bounds, ``--agent-tokens`` output tokens each, all with the same program id), waiting
  for every one of them before the next step.

Configurations, in one Triton, one invocation, alternated over ``--rounds`` rounds:
``programs`` (the default config: a tenant's programs share its turns by least attained
service), ``light`` (the same with ``light_slots: 4``: the last 4 free slots go only to a
program holding none, the fairest first) and ``no_programs``
(``queues.programs_per_tenant: 1``: one queue per tenant, as before programs), then
``alone``: the chat programs with no agent running. ``--configs`` picks them, and may
add ``lifted`` and ``light_lifted``: ``programs`` and ``light`` with ``debt_carried: 0``
(VTC's own lift, as before the debt was carried: a tenant whose queue empties between an
agent's steps comes back at the least counter, owed nothing). Measured over a
window after a warm-up: each tenant's share of the output tokens the frontend counted
(``fair_output_tokens_total``) against its weight's share, and the chat calls' TTFT
(p50 / p99, every tenant's calls together and per tenant).

Targets (issue 33): chat p99 TTFT with programs / without <= 0.5x; with programs / alone
<= 2x; every tenant's token share within 5 % of its weight's share. Each is judged for
``programs`` and for ``light``.

``--slo-ttft-ms MS`` runs another configuration alone, ``slo``: programs, the throttle
on, and every chat call of an interactive SLO class with that TTFT target (the
``x-slo-class`` header): how many of the chat calls the throttle refuses beside the
agents' fan-outs (each refusal a 503 the chat would retry), and their TTFT (how many
within the target). ``--slo-light-slots N`` gives that configuration N light slots.
Results in ``results/agents_slo.json``.

    .venv/bin/python -m benchmarks.bench_agents [--rounds 2] [--window-s 40] [--quick]
        [--json PATH] [--slo-ttft-ms 2000] [--slo-light-slots 4] [--source DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.harness import (
    frontend,
    load_example_config,
    progress,
    triton,
    write_result,
)
from fair_frontend.kit import testing

MODEL = "llm"
TENANTS = {  # name: (API key, weight)
    "a": ("tenant-a-agents-key", 2.0),
    "b": ("tenant-b-agents-key", 1.0),
    "c": ("tenant-c-agents-key", 1.0),
    "d": ("tenant-d-agents-key", 1.0),
}
CONFIGS = ("programs", "light", "no_programs")
# --configs may add: programs and light with debt_carried 0 (VTC's own lift).
ALL_CONFIGS = (*CONFIGS, "lifted", "light_lifted")
LIGHT_SLOTS = 4  # ``light``: one per tenant's chat
CHAT_PROMPT = "hello, how are you"
SCRAPE_S = 0.5
AGENT_PROMPT = "step {step} of the plan: look up item {i} and summarise what it says"


def bench_config(
    programs: bool, light: int = 0, slo_ttft_ms: float = 0.0, debt_carried: float | None = None
) -> dict[str, Any]:
    """The example config's ``llm`` endpoint as shipped (64 slots, 8 reserved, token cost),
    the four tenants in one tier; ``programs`` False: one queue per tenant; ``light``: its
    ``light_slots``; ``slo_ttft_ms``: the throttle on, and an interactive class ``chat``
    with that TTFT target; ``debt_carried``: the endpoint's (None: the default)."""
    cfg = load_example_config()
    cfg.pop("tier_limits", None)
    cfg["scheduling"] = "fair"
    # The agents keep 4 x 32-64 calls queued, more than a 5 s latency target's worth of
    # the engine's tokens on these CPUs: the throttle would refuse some (a 503 the agent
    # would retry); off, every call waits its turn and the shares are the scheduler's.
    cfg["endpoints"][MODEL]["throttle"] = False
    if slo_ttft_ms:
        # The agents' calls name no class: the endpoint's own target, a minute, so that
        # their fan-outs queue (with the shipped 5 s the throttle refuses their surplus
        # first, and no chat call finds its agent's backlog ahead of it).
        cfg["endpoints"][MODEL]["throttle"] = True
        cfg["endpoints"][MODEL]["latency_target_ms"] = 60_000
        cfg["slo_classes"] = {"chat": {"kind": "interactive", "ttft_ms": slo_ttft_ms}}
    if light:
        cfg["endpoints"][MODEL]["light_slots"] = light
    if debt_carried is not None:
        cfg["endpoints"][MODEL]["debt_carried"] = debt_carried
    cfg["queues"] = {"max_queued": 100_000}
    if not programs:
        cfg["queues"]["programs_per_tenant"] = 1
    cfg["tenants"] = {
        name: {"tier": "standard", "api_keys": [key], "weight": w, "max_queued": 100_000}
        for name, (key, w) in TENANTS.items()
    }
    return cfg


# ---- the client (a process per tenant) ---------------------------------------------------


async def stream_call(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    prompt: str,
    max_tokens: int,
) -> tuple[float, float, int]:
    """One generate_stream call: (sent, first event, events), monotonic seconds (one
    clock for every process of the machine)."""
    body = {
        "text_input": prompt,
        "stream": True,
        "sampling_parameters": json.dumps({"max_tokens": max_tokens, "temperature": 0}),
    }
    sent = time.monotonic()
    first = 0.0
    events = 0
    async with session.post(
        f"{url}/v2/models/{MODEL}/generate_stream", json=body, headers=headers
    ) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status} {await resp.text()}")
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            if b'"error"' in line:
                raise RuntimeError(line.decode(errors="replace"))
            if not events:
                first = time.monotonic()
            events += 1
    return sent, first, events


async def _drive(cmd: dict[str, Any]) -> dict[str, Any]:
    url, tenant, stop = cmd["url"], cmd["tenant"], cmd["stop"]
    key = TENANTS[tenant][0]
    rng = random.Random(cmd["seed"])
    base = {"authorization": f"Bearer {key}"}
    chats: list[list[float]] = []  # [sent, ttft, events, end]
    steps: list[list[float]] = []  # [start, end, calls]
    errors: list[str] = []

    async def chat(session: aiohttp.ClientSession) -> None:
        headers = {**base, "x-program-id": f"{tenant}-chat"}
        if cmd.get("slo"):
            headers["x-slo-class"] = "chat"
        n = 0
        while time.monotonic() < stop:
            try:
                sent, first, events = await stream_call(
                    session, url, headers, f"{CHAT_PROMPT} {n}", cmd["chat_tokens"]
                )
                chats.append([sent, first - sent, events, time.monotonic()])
            except Exception as e:  # counted and reported, not fatal
                errors.append(f"chat: {e}"[:300])
            n += 1
            await asyncio.sleep(rng.uniform(0.5, 1.5) * cmd["think_s"])

    async def agent(session: aiohttp.ClientSession) -> None:
        headers = {**base, "x-program-id": f"{tenant}-agent"}
        step = 0
        while time.monotonic() < stop:
            calls = rng.randint(*cmd["fanout"])
            start = time.monotonic()
            done = await asyncio.gather(
                *(
                    stream_call(
                        session,
                        url,
                        headers,
                        AGENT_PROMPT.format(step=step, i=i),
                        cmd["agent_tokens"],
                    )
                    for i in range(calls)
                ),
                return_exceptions=True,
            )
            errors.extend(f"agent: {e}"[:300] for e in done if isinstance(e, BaseException))
            steps.append([start, time.monotonic(), calls])
            step += 1
            await asyncio.sleep(cmd["agent_think_s"])

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [asyncio.ensure_future(chat(session))]
        if cmd["agents"]:
            tasks.append(asyncio.ensure_future(agent(session)))
        # At ``stop`` the chat ends after its call; an agent's step in flight is cut
        # (its calls cancelled: the window is over).
        await asyncio.wait(
            tasks, timeout=max(0.0, stop - time.monotonic()) + 0.5 + 2 * cmd["think_s"]
        )
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"chats": chats, "steps": steps, "errors": errors}


def _client(cmd: dict[str, Any], out: Any, ready: Any, go: Any) -> None:
    """One tenant's client process: up (its imports done), then told the window's end,
    then driving until it."""
    ready.put(cmd["tenant"])
    cmd["stop"] = go.get(True, 300)
    out.put((cmd["tenant"], asyncio.run(_drive(cmd))))


# ---- one configuration ------------------------------------------------------------------


def output_tokens(url: str) -> tuple[dict[str, float], set[str]]:
    """Each tenant's output tokens so far on ``llm``, and the tenants with queued work
    (a VTC counter)."""
    page = testing.scrape(url)
    tokens = page.by_label("fair_output_tokens_total", "tenant", endpoint=MODEL)
    return tokens, page.label_values("fair_vtc_counter", "tenant", endpoint=MODEL)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


async def run_config(server: Any, name: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    agents = name != "alone"
    slo_ms = args.slo_ttft_ms if name == "slo" else 0.0
    light = LIGHT_SLOTS if name.startswith("light") else 0
    if name == "slo":
        light = args.slo_light_slots
    debt = 0.0 if name.endswith("lifted") else args.debt_carried
    cfg = bench_config(
        programs=name != "no_programs", light=light, slo_ttft_ms=slo_ms, debt_carried=debt
    )
    window_s = args.window_s if agents else args.alone_s
    source = Path(args.source) if args.source else None
    with frontend(cfg, server.grpc_url, http_url=server.http_url, source=source) as fe:
        metrics = f"http://127.0.0.1:{fe.metrics_port}/metrics"
        ctx = multiprocessing.get_context("spawn")
        queue: Any = ctx.Queue()
        ready: Any = ctx.Queue()
        go: Any = ctx.Queue()
        procs = []
        for i, tenant in enumerate(TENANTS):
            cmd = {
                "url": f"http://127.0.0.1:{fe.http_port}",
                "tenant": tenant,
                "seed": seed * 100 + i,
                "agents": agents,
                "chat_tokens": args.chat_tokens,
                "think_s": args.think_s,
                "fanout": tuple(args.fanout),
                "agent_tokens": args.agent_tokens,
                "agent_think_s": args.agent_think_s,
                "slo": bool(slo_ms),
            }
            p = ctx.Process(target=_client, args=(cmd, queue, ready, go))
            p.start()
            procs.append(p)
        # The clients start together once every one is up (a spawn takes seconds on a
        # loaded machine: a window fixed from here could end before they drove); the
        # window follows the warm-up.
        for _ in procs:
            await asyncio.to_thread(ready.get, True, 120)
        begin = time.monotonic()
        t0, t1 = begin + args.warmup_s, begin + args.warmup_s + window_s
        for _ in procs:
            go.put(t1)
        await asyncio.sleep(max(0.0, t0 - time.monotonic()))
        start, queued = await asyncio.to_thread(output_tokens, metrics)
        # Between two scrapes (every SCRAPE_S) where every tenant had queued work at both,
        # the tokens count towards the shares while all were backlogged too.
        backlogged = dict.fromkeys(TENANTS, 0)
        both = dict.fromkeys(TENANTS, 0.0)
        both_s = 0.0
        scrapes = 0
        prev, prev_queued, prev_t = start, queued, time.monotonic()
        while time.monotonic() < t1 - SCRAPE_S:
            await asyncio.sleep(SCRAPE_S)
            now, queued = await asyncio.to_thread(output_tokens, metrics)
            now_t = time.monotonic()
            scrapes += 1
            for t in queued & set(TENANTS):
                backlogged[t] += 1
            if set(TENANTS) <= queued and set(TENANTS) <= prev_queued:
                for t in TENANTS:
                    both[t] += now.get(t, 0.0) - prev.get(t, 0.0)
                both_s += now_t - prev_t
            prev, prev_queued, prev_t = now, queued, now_t
        await asyncio.sleep(max(0.0, t1 - time.monotonic()))
        end, _ = await asyncio.to_thread(output_tokens, metrics)
        got = {}
        for _ in procs:
            tenant, answer = await asyncio.to_thread(queue.get, True, 120)
            got[tenant] = answer
        for p in procs:
            p.join(10)
    tokens = {t: end.get(t, 0.0) - start.get(t, 0.0) for t in TENANTS}
    total = sum(tokens.values()) or 1.0
    weights = sum(w for _, w in TENANTS.values())
    ttft = {t: [c[1] for c in got[t]["chats"] if t0 <= c[0] <= t1 and c[2] > 0] for t in TENANTS}
    every = [x for t in TENANTS for x in ttft[t]]
    out: dict[str, Any] = {
        "window_s": window_s,
        "output_tokens": tokens,
        "tokens_per_s": sum(tokens.values()) / window_s,
        "share": {t: tokens[t] / total for t in TENANTS},
        "target_share": {t: w / weights for t, (_, w) in TENANTS.items()},
        "backlogged_fraction": {t: backlogged[t] / max(1, scrapes) for t in TENANTS},
        "all_backlogged_s": both_s,
        "all_backlogged_share": {t: both[t] / (sum(both.values()) or 1.0) for t in TENANTS},
        "chat_ttft_s": every,
        "chat_p50_s": pct(every, 50),
        "chat_p99_s": pct(every, 99),
        "chat_calls": len(every),
        "chat_per_tenant": {
            t: {"calls": len(v), "p50_s": pct(v, 50), "p99_s": pct(v, 99)} for t, v in ttft.items()
        },
        "agent_steps": {t: len(got[t]["steps"]) for t in TENANTS},
        "agent_step_s_median": {
            t: statistics.median([s[1] - s[0] for s in got[t]["steps"]] or [float("nan")])
            for t in TENANTS
        },
        # Timelines, seconds from the window's start: each agent step's [start, duration,
        # calls] and each chat call's [sent, TTFT, duration].
        "agent_step_timeline": {
            t: [[s[0] - t0, s[1] - s[0], s[2]] for s in got[t]["steps"]] for t in TENANTS
        },
        "chat_timeline": {
            t: [[c[0] - t0, c[1], c[3] - c[0]] for c in got[t]["chats"]] for t in TENANTS
        },
        "errors": {t: len(got[t]["errors"]) for t in TENANTS},
        # Chat calls the frontend refused (the throttle's 503), per tenant.
        "chat_refused": {
            t: sum(1 for e in got[t]["errors"] if e.startswith("chat: 503")) for t in TENANTS
        },
        "error_samples": [e for t in TENANTS for e in got[t]["errors"][:2]],
    }
    out["share_error"] = (
        {t: out["share"][t] / out["target_share"][t] - 1 for t in TENANTS} if agents else {}
    )
    out["all_backlogged_share_error"] = (
        {t: out["all_backlogged_share"][t] / out["target_share"][t] - 1 for t in TENANTS}
        if agents and both_s > 0
        else {}
    )
    return out


def summary(name: str, r: dict[str, Any]) -> str:
    shares = " ".join(f"{t} {r['share'][t]:.3f}" for t in TENANTS)
    busy = " ".join(f"{t} {r['all_backlogged_share'][t]:.3f}" for t in TENANTS)
    return (
        f"  {name}: chat TTFT p50 {r['chat_p50_s'] * 1000:.0f} ms, p99 "
        f"{r['chat_p99_s'] * 1000:.0f} ms ({r['chat_calls']} calls); {r['tokens_per_s']:.0f} "
        f"tokens/s, shares {shares} (all backlogged {r['all_backlogged_s']:.1f} s: {busy}); "
        f"errors {sum(r['errors'].values())}"
    )


def verdict(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The targets, on every round's chat calls pooled per configuration (and per round),
    for the configurations that ran: each one's worst token share error, and the chat's
    p99 ratios where both sides ran."""
    ran = {name: rs for name, rs in runs.items() if rs}
    pooled = {name: [x for r in rs for x in r["chat_ttft_s"]] for name, rs in ran.items()}
    p99 = {name: pct(v, 99) for name, v in pooled.items()}
    p50 = {name: pct(v, 50) for name, v in pooled.items()}
    out: dict[str, Any] = {"chat_p50_s": p50, "chat_p99_s": p99}
    for name, rs in ran.items():
        if name != "alone":
            errors = [abs(e) for r in rs for e in r["share_error"].values()]
            out[f"worst_share_error_{name}"] = max(errors, default=float("nan"))
    met: dict[str, bool] = {}
    for name, key in (("programs", ""), ("light", "light_")):
        if name not in ran:
            continue
        if "no_programs" in ran:
            ratio = out[f"p99_{name}_over_no_programs"] = p99[name] / p99["no_programs"]
            met[f"{key}p99_vs_no_programs_le_0.5"] = ratio <= 0.5
        if "alone" in ran:
            ratio = out[f"p99_{name}_over_alone"] = p99[name] / p99["alone"]
            met[f"{key}p99_vs_alone_le_2"] = ratio <= 2.0
        met[f"{key}shares_within_5pct"] = out[f"worst_share_error_{name}"] <= 0.05
    if "programs" in ran and "no_programs" in ran:
        out["p99_ratio_per_round"] = [
            on["chat_p99_s"] / off["chat_p99_s"]
            for on, off in zip(ran["programs"], ran["no_programs"], strict=True)
        ]
    if "programs" in ran:
        out["worst_all_backlogged_share_error_programs"] = max(
            (abs(e) for r in ran["programs"] for e in r["all_backlogged_share_error"].values()),
            default=float("nan"),
        )
        if "light" in ran:
            out["p99_light_over_programs"] = p99["light"] / p99["programs"]
    out["met"] = met
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    names = [n for n in ("alone", *ALL_CONFIGS) if runs.get(n)]
    configs = [n for n in names if n != "alone"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = {"alone": "#55a868", "light": "#8172b2", "programs": "#4c72b0",
              "lifted": "#dd8452", "light_lifted": "#937860",
              "no_programs": "#c44e52"}  # fmt: skip
    for name in names:
        values = sorted(x for r in runs[name] for x in r["chat_ttft_s"])
        if not values:
            continue
        ys = [(i + 1) / len(values) for i in range(len(values))]
        left.step([v * 1000 for v in values], ys, where="post", color=colors[name], label=name)
    left.set_xscale("log")
    left.set_xlabel("chat call's time to first token (ms)")
    left.set_ylabel("fraction of chat calls")
    left.axhline(0.99, ls=":", color="gray")
    left.set_title("a tenant's chat beside its own agent's fan-outs")
    left.legend()
    tenants = list(TENANTS)
    width = 0.75 / len(configs)
    for j, name in enumerate(configs):
        shares = [statistics.mean(r["share"][t] for r in runs[name]) for t in tenants]
        xs = [i + (j - (len(configs) - 1) / 2) * width for i in range(len(tenants))]
        right.bar(xs, shares, width, color=colors[name], label=name)
    target = runs[configs[0]][0]["target_share"]
    right.scatter(
        range(len(tenants)), [target[t] for t in tenants], color="k", zorder=3, label="weights"
    )
    right.set_xticks(range(len(tenants)))
    right.set_xticklabels([f"{t} (w{TENANTS[t][1]:g})" for t in tenants])
    right.set_ylabel("share of output tokens in the window")
    right.set_title("token shares, weights 2:1:1:1")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    progress(f"plot written to {path}")


async def main_slo(args: argparse.Namespace) -> dict[str, Any]:
    """``--slo-ttft-ms``: the ``slo`` configuration alone, ``--rounds`` times."""
    runs: list[dict[str, Any]] = []
    with triton() as server:
        for rnd in range(args.rounds):
            progress(
                f"round {rnd + 1}/{args.rounds}: slo (chat TTFT target "
                f"{args.slo_ttft_ms:g} ms), {args.warmup_s:g} + {args.window_s:g} s"
            )
            r = await run_config(server, "slo", args, seed=rnd)
            runs.append(r)
            refused = sum(r["chat_refused"].values())
            progress(summary("slo", r) + f"; chat calls refused {refused}")
    refused = sum(sum(r["chat_refused"].values()) for r in runs)
    calls = sum(r["chat_calls"] for r in runs)
    pooled = [x for r in runs for x in r["chat_ttft_s"]]
    within = sum(1 for x in pooled if x * 1000 <= args.slo_ttft_ms)
    return {
        "runs": {"slo": runs},
        "verdict": {
            "chat_refused": refused,
            "chat_served": calls,
            "chat_refused_fraction": refused / max(1, refused + calls),
            "chat_within_target": within,
            "chat_within_target_fraction": within / max(1, len(pooled)),
            "chat_p50_s": pct(pooled, 50),
            "chat_p99_s": pct(pooled, 99),
            "slo_ttft_ms": args.slo_ttft_ms,
        },
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    configs = tuple(args.configs)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in (*configs, "alone")}
    with triton() as server:
        for rnd in range(args.rounds):
            order = configs if rnd % 2 == 0 else tuple(reversed(configs))
            for name in order:
                progress(
                    f"round {rnd + 1}/{args.rounds}: {name}, {args.warmup_s:g} s warm-up + "
                    f"{args.window_s:g} s window"
                )
                r = await run_config(server, name, args, seed=rnd)
                runs[name].append(r)
                progress(summary(name, r))
        progress(f"alone: the chats with no agent, {args.warmup_s:g} + {args.alone_s:g} s")
        r = await run_config(server, "alone", args, seed=99)
        runs["alone"].append(r)
        progress(summary("alone", r))
    return {"runs": runs, "verdict": verdict(runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every configuration")
    parser.add_argument("--warmup-s", type=float, default=6.0)
    parser.add_argument("--window-s", type=float, default=40.0)
    parser.add_argument("--alone-s", type=float, default=20.0, help="window of 'alone'")
    parser.add_argument("--chat-tokens", type=int, default=32)
    parser.add_argument("--think-s", type=float, default=0.3, help="chat's mean think time")
    parser.add_argument("--fanout", type=int, nargs=2, default=[32, 64], metavar=("MIN", "MAX"))
    parser.add_argument("--agent-tokens", type=int, default=32)
    parser.add_argument("--agent-think-s", type=float, default=0.05)
    parser.add_argument("--quick", action="store_true", help="one round, short windows")
    parser.add_argument(
        "--debt-carried",
        type=float,
        default=None,
        help="the endpoint's debt_carried in every configuration but the lifted ones "
        "(default: its default)",
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=ALL_CONFIGS,
        default=list(CONFIGS),
        help="the configurations, in this order (reversed every other round); lifted, "
        "light_lifted: programs, light with debt_carried 0 (VTC's own lift)",
    )
    parser.add_argument("--json", default=None, help="where the results go")
    parser.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=0.0,
        help="run the slo configuration alone, the chats' TTFT target this many ms",
    )
    parser.add_argument(
        "--slo-light-slots",
        type=int,
        default=0,
        help="the slo configuration's light slots (the last N free go to chats)",
    )
    parser.add_argument(
        "--source",
        default=None,
        help="the frontend of another checkout (a folder holding its fair_frontend, e.g. "
        "`git archive REV fair_frontend | tar -x -C DIR`): a before to compare with",
    )
    if parser.parse_args().quick:  # its sizes; a size given on the command line wins
        parser.set_defaults(rounds=1, warmup_s=4.0, window_s=15.0, alone_s=10.0)
    args = parser.parse_args()
    if args.slo_ttft_ms:
        results = asyncio.run(main_slo(args))
        results["args"] = vars(args)
        v = results["verdict"]
        progress(
            f"slo: chat calls refused {v['chat_refused']} of {v['chat_refused'] + v['chat_served']}"
            f" ({v['chat_refused_fraction']:.1%}); served chat TTFT p50 "
            f"{v['chat_p50_s'] * 1000:.0f} ms, p99 {v['chat_p99_s'] * 1000:.0f} ms, "
            f"{v['chat_within_target']} within the target"
        )
        save(results, args.json, "agents_slo")
        return
    results = asyncio.run(main_async(args))
    results["args"] = vars(args)
    v = results["verdict"]
    for name in args.configs:
        line = f"{name}: worst token share error {v[f'worst_share_error_{name}'] * 100:.1f} %"
        for other in ("no_programs", "alone"):
            if f"p99_{name}_over_{other}" in v:
                line += f"; chat p99 TTFT / {other} {v[f'p99_{name}_over_{other}']:.3f}"
        progress(line)
    progress(f"targets (issue 33): {v['met']}")
    plot(results, save(results, args.json, "agents").with_suffix(".png"))


def save(results: dict[str, Any], json_path: str | None, name: str) -> Path:
    """``results`` written where ``--json`` says, else to ``results/<name>.json``."""
    if json_path:
        path = Path(json_path)
        path.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
        return path
    return write_result(name, results)


if __name__ == "__main__":
    main()
