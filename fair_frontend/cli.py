"""``fair-frontend``: run the frontend, alone or with an embedded Triton.

fair-frontend up    [--config F] [--http-port N] [--grpc-port N] [--metrics-port N]
fair-frontend serve --config F --triton-url HOST:PORT [ports as above]
fair-frontend check-config F
fair-frontend hash-key KEY
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import uvloop

from fair_frontend.config import Config, ConfigError, load_config
from fair_frontend.server import FrontendServer, Listen, default_workers

log = logging.getLogger("fair_frontend")

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "examples" / "config.yaml"


def _add_listen_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=None, help="address to listen on (default: config, 0.0.0.0)")
    p.add_argument("--http-port", type=int, default=None, help="HTTP port (default 8000)")
    p.add_argument("--grpc-port", type=int, default=None, help="gRPC port (default 8001)")
    p.add_argument("--metrics-port", type=int, default=None, help="metrics port (default 8002)")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="shell processes serving HTTP and gRPC (default: server.workers, else the "
        "cores this process may use less one, at most 8); 1 keeps the whole frontend in one "
        "process",
    )
    p.add_argument("--log-level", default="INFO")


def _listen(args: argparse.Namespace, config: Config) -> Listen:
    s = config.server
    return Listen(
        host=args.host or s.host,
        http_port=s.http_port if args.http_port is None else args.http_port,
        grpc_port=s.grpc_port if args.grpc_port is None else args.grpc_port,
        metrics_port=s.metrics_port if args.metrics_port is None else args.metrics_port,
        metrics_host=s.metrics_host,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fair-frontend", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start an embedded Triton and the frontend in front of it")
    up.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config")
    up.add_argument("--model-repository", default=None, help="Triton model repository")
    up.add_argument("--triton-log", default=None, help="file for Triton's log")
    up.add_argument(
        "--model-config-name",
        default=None,
        help="Triton's --model-config-name: e.g. 'gpu' picks each model's configs/gpu.pbtxt",
    )
    _add_listen_flags(up)

    serve = sub.add_parser("serve", help="run the frontend against a Triton elsewhere")
    serve.add_argument("--config", required=True, help="YAML config")
    serve.add_argument("--triton-url", required=True, help="Triton's gRPC address, HOST:PORT")
    _add_listen_flags(serve)

    check = sub.add_parser("check-config", help="validate a config file and exit")
    check.add_argument("config")

    hk = sub.add_parser("hash-key", help='print the "sha256:<hex>" form of an API key')
    hk.add_argument("key")

    sub.add_parser("config-reference", help="print every config field, as Markdown")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "config-reference":
        from fair_frontend.config import reference

        print(reference())
        return 0
    if args.command == "hash-key":
        from fair_frontend.auth import hash_key

        print(hash_key(args.key))
        return 0
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = load_config(args.config)
    except ConfigError as err:
        print(f"fair-frontend: {err}", file=sys.stderr)
        return 2
    from fair_frontend.logs import configure_logging

    configure_logging(config.observability.log_format, getattr(args, "log_level", "INFO"))
    if args.command == "check-config":
        print(
            f"{args.config}: OK ({len(config.tenants)} tenants, {len(config.endpoints)} endpoints)"
        )
        return 0
    try:
        if args.command == "serve":
            uvloop.run(
                _serve(
                    config,
                    args.triton_url,
                    _listen(args, config),
                    _workers(args, config),
                    args.config,
                )
            )
        else:
            uvloop.run(_up(config, args))
    except ConfigError as err:
        print(f"fair-frontend: {err}", file=sys.stderr)
        return 2
    except StartupError as err:
        print(f"fair-frontend: {err}", file=sys.stderr)
        return 1
    return 0


class StartupError(RuntimeError):
    pass


def _workers(args: argparse.Namespace, config: Config) -> int:
    workers: int | None = args.workers if args.workers is not None else config.server.workers
    if workers is None:
        workers = default_workers()
    if workers < 1:
        raise ConfigError("--workers", [f"must be at least 1, got {workers}"])
    return workers


async def _serve(
    config: Config,
    triton_url: str,
    listen: Listen,
    workers: int,
    config_path: str | None = None,
) -> None:
    server = FrontendServer(config, triton_url, listen, workers=workers)
    loop = asyncio.get_running_loop()
    # Signals are handled from the start: shells may answer readiness probes before this
    # process has finished starting, and a signal's default action would kill it (its
    # shells with it) without the drain.
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    started = False
    reloads: list[str] = []  # SIGHUPs before the start finished: applied right after it

    def on_sighup() -> None:
        if config_path is not None:
            if started:
                _reload(server, config_path)
            else:
                reloads.append(config_path)

    loop.add_signal_handler(signal.SIGHUP, on_sighup)
    try:
        await server.start()
    except OSError as err:
        await server.stop()
        raise StartupError(f"cannot listen: {err}") from err
    started = True
    if reloads:
        _reload(server, reloads[-1])
    _announce(server, listen, triton_url)
    try:
        await stop.wait()
    finally:
        log.info("stopping: finishing queued and in-flight requests")
        await server.stop()


def _reload(server: FrontendServer, path: str) -> None:
    """SIGHUP: read the config file again and apply what can change live (see
    ``Core.reload``); the rest is kept, named in an ERROR log line."""
    try:
        server.reload(load_config(path))
    except ConfigError as err:
        log.error("reload refused, keeping the running config: %s", err)


async def _up(config: Config, args: argparse.Namespace) -> None:
    from fair_frontend.embedded import EmbeddedTriton, TritonStartError, default_model_repository

    repo = Path(args.model_repository) if args.model_repository else default_model_repository()
    triton = EmbeddedTriton(
        repo,
        log_path=Path(args.triton_log) if args.triton_log else None,
        model_config_name=args.model_config_name,
    )
    print(f"starting Triton on {repo} (log: {triton.log_path}) ...", flush=True)
    try:
        await asyncio.to_thread(triton.start)
    except TritonStartError as err:
        raise StartupError(str(err)) from err
    # The feedback loop reads the embedded Triton's own metrics; batches go over its HTTP.
    own = {"metrics_url": triton.metrics_url, "http_url": triton.http_url}
    update = {k: v for k, v in own.items() if getattr(config.triton, k) is None}
    if update:
        config = config.model_copy(update={"triton": config.triton.model_copy(update=update)})
    watchdog = asyncio.get_running_loop().create_task(_keep_alive(triton))
    try:
        await _serve(
            config, triton.grpc_url, _listen(args, config), _workers(args, config), args.config
        )
    finally:
        watchdog.cancel()
        print("stopping Triton ...", flush=True)
        await asyncio.to_thread(triton.stop)


async def _keep_alive(triton: Any, interval_s: float = 0.5) -> None:
    """up mode: restart the embedded Triton if it dies (same ports; the frontend holds
    queued requests meanwhile and resumes when Triton is ready again)."""
    from fair_frontend.embedded import TritonStartError

    backoff = interval_s
    while True:
        await asyncio.sleep(backoff)
        if triton.is_running():
            backoff = interval_s
            continue
        log.error("Triton exited; restarting it (log: %s)", triton.log_path)
        try:
            await asyncio.to_thread(triton.restart)
            log.info("Triton restarted and ready")
            backoff = interval_s
        except TritonStartError as err:
            log.error("Triton restart failed, retrying: %s", err)
            backoff = min(backoff * 2, 30.0)


def _announce(server: FrontendServer, listen: Listen, triton_url: str) -> None:
    host = "localhost" if listen.host in ("0.0.0.0", "::", "") else listen.host
    key = "acme-demo-key"
    print(
        f"""
fair_frontend is serving (Triton at {triton_url})
  HTTP    http://{host}:{server.http_port}
  gRPC    {host}:{server.grpc_port}
  metrics http://{host}:{server.metrics_port}/metrics

Try it (the example config's demo key for tenant 'acme'):
  curl -s -H 'authorization: Bearer {key}' http://{host}:{server.http_port}/v2/models/embed/infer \\
       -d '{{"inputs":[{{"name":"INPUT_IDS","shape":[1,4],"datatype":"INT32","data":[1,2,3,4]}}]}}'

Ctrl-C stops it.
""",
        flush=True,
    )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
