"""``fair-frontend``: run the frontend, alone or with an embedded Triton.

fair-frontend up    [--config F | --demo] [--http-port N] [--grpc-port N] [--metrics-port N]
fair-frontend serve --config F [--triton-url HOST:PORT ...] [ports as above]
fair-frontend core  --config F --triton-url HOST:PORT ... --secret-file S [--election redis]
                    [--link grpc|tcp]
fair-frontend shell --core HOST:PORT ... --secret-file S [--http-port N] [--grpc-port N]
                    [--link grpc|tcp]
fair-frontend check-config F      (0: OK, 1: starts with warnings, 2: refused)
fair-frontend hash-key KEY
fair-frontend config-reference | metrics-reference     (Markdown, as the README has them)

Keys. ``serve``, and ``up`` with an operator's config, refuse to start when no request
could ever be admitted: no tenant has a key (inline, file, variable) and no trusted gateway
is configured (``key_set_problem``). ``up``'s demo mode (``--demo``, or the example config,
which ``up`` defaults to and ``make run`` passes) runs the example config's published demo
keys, and says so loudly at start; outside it, a config that accepts a demo key gets a
warning naming its tenants.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop

from fair_frontend.auth import GatewayTrust, KeyRing, ModelAccess, hash_key
from fair_frontend.backends.triton.embedded import (
    EmbeddedTriton,
    TritonStartError,
    default_model_repository,
)
from fair_frontend.config import (
    DEFAULT_GRPC_PORT,
    DEFAULT_HTTP_PORT,
    Config,
    ConfigError,
    load_config,
    model_name_warnings,
    reference,
)
from fair_frontend.core.metrics import reference as metrics_reference
from fair_frontend.fleet import (
    DEFAULT_CORE_PORT,
    DEFAULT_KUBERNETES_LEASE_S,
    DEFAULT_LEASE_S,
)
from fair_frontend.fleet.run import run_core, run_shells
from fair_frontend.observability.logs import configure_logging
from fair_frontend.server import FrontendServer, Listen, default_workers
from fair_frontend.shell import tls as tenant_tls
from fair_frontend.shell.router import parse_core_sets
from fair_frontend.wire.remote import SECRET_ENV, SecretError, load_secret
from fair_frontend.wire.tcp import LINKS

log = logging.getLogger("fair_frontend")

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "examples" / "config.yaml"
# The example config's keys, published in it and in the README: anyone may send them.
DEMO_KEYS = ("acme-demo-key", "globex-demo-key", "initech-demo-key", "umbrella-demo-key")
LOOPBACK = ("127.0.0.1", "::1", "localhost")


def _add_listen_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=None, help="address to listen on (default: config, 0.0.0.0)")
    p.add_argument("--http-port", type=int, default=None, help="HTTP port (default 8000)")
    p.add_argument("--grpc-port", type=int, default=None, help="gRPC port (default 8001)")
    p.add_argument("--metrics-port", type=int, default=None, help="metrics port (default 8002)")
    p.add_argument(
        "--metrics-host",
        default=None,
        help="address of the operator's listener: /metrics and the operator's statistics "
        "(default: config, 127.0.0.1)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="shell processes serving HTTP and gRPC (default: server.workers, else the "
        "cores this process may use less one, at most 8); 1 keeps the whole frontend in one "
        "process",
    )
    p.add_argument("--log-level", default="INFO")


def _add_secret_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--secret-file",
        default=None,
        help=f"file holding the secret shared by the cores and shells (default: the "
        f"{SECRET_ENV} variable); required",
    )


def _listen(args: argparse.Namespace, config: Config) -> Listen:
    s = config.server
    return Listen(
        host=args.host or s.host,
        http_port=s.http_port if args.http_port is None else args.http_port,
        grpc_port=s.grpc_port if args.grpc_port is None else args.grpc_port,
        metrics_port=s.metrics_port if args.metrics_port is None else args.metrics_port,
        metrics_host=args.metrics_host or s.metrics_host,
        metrics_grpc_port=s.metrics_grpc_port,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fair-frontend", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start an embedded Triton and the frontend in front of it")
    up.add_argument(
        "--config", default=None, help="YAML config (default: the example config, in demo mode)"
    )
    up.add_argument(
        "--demo",
        action="store_true",
        help="demo mode: the example config (unless --config names another) with its "
        "published demo keys, said loudly at start; also on when --config is the example",
    )
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
    serve.add_argument(
        "--triton-url",
        action="append",
        default=[],
        help="a Triton's gRPC address, HOST:PORT; repeat it for a pool of Tritons (replaces "
        "triton.backends; required unless the config lists them)",
    )
    _add_listen_flags(serve)

    core = sub.add_parser(
        "core",
        help="run the core alone (admission, scheduling, dispatch) for shells on other hosts",
    )
    core.add_argument("--config", required=True, help="YAML config")
    core.add_argument(
        "--triton-url",
        action="append",
        default=[],
        help="a Triton's gRPC address, HOST:PORT; repeat it for a pool (as serve's)",
    )
    core.add_argument(
        "--listen",
        default=f"0.0.0.0:{DEFAULT_CORE_PORT}",
        help=f"HOST:PORT the shells connect to (default 0.0.0.0:{DEFAULT_CORE_PORT})",
    )
    core.add_argument(
        "--link",
        choices=LINKS,
        default="grpc",
        help="how the shells connect: grpc (default: one gRPC stream per shell) or tcp (the "
        "frames on a plain TCP connection: less of the core's CPU per request); the shells "
        "need the same --link",
    )
    _add_secret_flags(core)
    core.add_argument(
        "--election",
        choices=("none", "redis", "kubernetes"),
        default="none",
        help="leader election among cores: none (this core leads), redis (on the Redis of "
        "the config's rate_limiting.storage), kubernetes (a coordination.k8s.io Lease in the "
        "pod's namespace)",
    )
    core.add_argument(
        "--advertise",
        default=None,
        help="HOST:PORT the shells reach this core at, in its lease identity and logs "
        "(default: --listen's, with this host's name for 0.0.0.0)",
    )
    core.add_argument(
        "--identity",
        default=None,
        help="this core's name in the lease; each core needs its own (default: the "
        "--advertise address, this host's name, the process id and a random part: unique "
        "per process)",
    )
    core.add_argument(
        "--lease-s",
        type=float,
        default=None,
        help=f"leader lease: a leader that cannot renew it for this long is replaced "
        f"(default {DEFAULT_LEASE_S} with redis, {DEFAULT_KUBERNETES_LEASE_S} with kubernetes)",
    )
    core.add_argument(
        "--lease-name", default="fair-frontend-core", help="the Redis key or Kubernetes Lease"
    )
    core.add_argument("--tls-cert", default=None, help="PEM certificate: the shells' link over TLS")
    core.add_argument("--tls-key", default=None, help="its PEM private key")
    core.add_argument(
        "--tls-client-ca",
        default=None,
        help="PEM CA: shells must present a certificate it signed (mutual TLS)",
    )
    core.add_argument(
        "--metrics-port", type=int, default=None, help="operator's port: /metrics, health"
    )
    core.add_argument("--metrics-host", default=None, help="operator's address")
    core.add_argument("--log-level", default="INFO")

    shell = sub.add_parser(
        "shell", help="run shells only (HTTP and gRPC for tenants), fed by cores elsewhere"
    )
    shell.add_argument(
        "--core",
        action="append",
        required=True,
        help="a core's HOST:PORT; repeat it for every core (the shells find the leader); "
        "MODEL[,MODEL...]=HOST:PORT for cores that own those endpoints (the others go to "
        "the cores given without models)",
    )
    _add_secret_flags(shell)
    shell.add_argument(
        "--link",
        choices=LINKS,
        default="grpc",
        help="how to connect to the cores: grpc (default) or tcp; as the cores' --link",
    )
    shell.add_argument(
        "--tls-ca", default=None, help="PEM CA the cores' certificates are checked by (TLS)"
    )
    shell.add_argument("--tls-cert", default=None, help="this shell's PEM certificate (mutual TLS)")
    shell.add_argument("--tls-key", default=None, help="its PEM private key")
    shell.add_argument("--host", default="0.0.0.0", help="address to listen on")
    shell.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT, help="HTTP port")
    shell.add_argument("--grpc-port", type=int, default=DEFAULT_GRPC_PORT, help="gRPC port")
    shell.add_argument(
        "--workers", type=int, default=1, help="shell processes on these ports (default 1)"
    )
    shell.add_argument("--log-level", default="INFO")
    shell.add_argument("--log-format", default="json", choices=("json", "text"))

    check = sub.add_parser(
        "check-config",
        help="run every check serve runs on a config before it starts (in this "
        "environment: its key files and variables) and exit: 0 OK, 1 it starts with "
        "warnings (printed), 2 serve would refuse it",
    )
    check.add_argument("config")

    hk = sub.add_parser("hash-key", help='print the "sha256:<hex>" form of an API key')
    hk.add_argument("key")

    sub.add_parser("config-reference", help="print every config field, as Markdown")
    sub.add_parser("metrics-reference", help="print every metric /metrics exports, as Markdown")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "config-reference":
        print(reference())
        return 0
    if args.command == "metrics-reference":
        print(metrics_reference(), end="")
        return 0
    if args.command == "hash-key":
        print(hash_key(args.key))
        return 0
    if args.command == "shell":
        return _fleet_shells(args)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    demo = False
    if args.command == "up":
        demo = args.demo or args.config is None or is_example_config(args.config)
        args.config = args.config or str(DEFAULT_CONFIG)
    try:
        config = load_config(args.config)
    except ConfigError as err:
        print(f"fair-frontend: {err}", file=sys.stderr)
        return 2
    configure_logging(config.observability.log_format, getattr(args, "log_level", "INFO"))
    if args.command == "check-config":
        return _check_config(args.config, config)
    try:
        checked = check_start(config, demo=demo)
    except StartRefused as err:
        print(f"fair-frontend: {err}", file=sys.stderr)
        return 2
    if demo:
        log.warning("%s", demo_banner(_listen(args, config).host))
    for warning in checked.warnings:
        log.warning("%s", warning)
    if args.command in ("serve", "core") and not (args.triton_url or config.triton.backends):
        print(
            f"fair-frontend: {args.command} needs a Triton: --triton-url HOST:PORT (repeat it "
            "for a pool), or triton.backends in the config",
            file=sys.stderr,
        )
        return 2
    if args.command == "core":
        return _fleet_core(config, args)
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
            uvloop.run(_up(config, args, demo))
    except ConfigError as err:
        print(f"fair-frontend: {err}", file=sys.stderr)
        return 2
    except StartupError as err:
        print(f"fair-frontend: {err}", file=sys.stderr)
        return 1
    return 0


class StartupError(RuntimeError):
    pass


class StartRefused(ValueError):
    """A config a frontend does not start with (exit 2), said as the start says it."""


@dataclass(frozen=True)
class StartCheck:
    """What ``check_start`` found: the keys read, and what to warn of."""

    keyring: KeyRing
    warnings: list[str]


def check_start(config: Config, *, demo: bool = False) -> StartCheck:
    """Every check ``serve``, ``up`` and ``core`` run on a config before they start with
    it (and on SIGHUP before they apply it), and ``check-config`` runs: one function, so
    that check-config's OK means the frontend starts.

    Refused (``StartRefused``): a key file that cannot be read, a key variable not set,
    a tenant-port certificate and key that do not load,
    the gateway's secret or Redis's password not to be had, a key set that admits nobody
    (outside ``up``'s demo mode). Warned of: tenants that accept a published demo key,
    tenants that may call no model, model names no endpoint carries (with the closest)."""
    try:
        keyring = KeyRing.from_config(config)
        GatewayTrust.from_config(config.auth)
        config.rate_limiting.storage_url()
        tenant_tls.http_context(config.server)  # the tenant ports' certificate and key load
    except ConfigError as err:
        raise StartRefused(str(err)) from None
    warnings = []
    if not demo:
        problem = key_set_problem(config, keyring)
        if problem is not None:
            raise StartRefused(problem)
        demo_tenants = tenants_with_demo_keys(keyring)
        if demo_tenants:
            warnings.append(
                f"tenants {', '.join(demo_tenants)} accept the example config's published "
                "demo keys: anyone may send them; replace them (fair-frontend hash-key KEY)"
            )
    closed = model_access_problem(config)
    if closed is not None:
        warnings.append(closed)
    warnings += model_name_warnings(config)
    return StartCheck(keyring, warnings)


def _check_config(path: str, config: Config) -> int:
    """``check-config``: ``check_start`` on the file, in this environment (its key files
    and variables): 0 and OK when serve starts with nothing to say, 1 when it starts with
    warnings (printed), 2 when it refuses (said as serve says it)."""
    try:
        checked = check_start(config)
    except StartRefused as err:
        print(f"fair-frontend: {err}", file=sys.stderr)
        return 2
    counts = f"{len(config.tenants)} tenants, {len(config.endpoints)} endpoints"
    if checked.warnings:
        for warning in checked.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        print(f"{path}: starts, with {len(checked.warnings)} warning(s) above ({counts})")
        return 1
    print(f"{path}: OK ({counts})")
    return 0


def is_example_config(path: str) -> bool:
    """Is ``path`` the example config (``make run``'s): the one with the demo keys?"""
    try:
        return Path(path).resolve() == DEFAULT_CONFIG
    except OSError:
        return False


def key_set_problem(config: Config, keyring: KeyRing) -> str | None:
    """Why a frontend with this config and these keys would refuse every request (no
    tenant has a key, and no trusted gateway names tenants), or None."""
    if keyring.size or config.auth.trusted_gateway:
        return None
    sources = []
    for name, tenant in config.tenants.items():
        where = [
            f"api_keys_file {tenant.api_keys_file}" if tenant.api_keys_file else "",
            f"api_keys_env {tenant.api_keys_env}" if tenant.api_keys_env else "",
        ]
        found = " and ".join(w for w in where if w) or "no api_keys"
        sources.append(f"{name} ({found}: empty)")
    tenants = "; ".join(sources) or "no tenants are configured"
    return (
        "no API keys: no tenant has one and auth.trusted_gateway is off, so every request "
        f"would be refused (401). Tenants: {tenants}. Set tenants.<name>.api_keys "
        '("sha256:<hex>", printed by `fair-frontend hash-key KEY`), api_keys_file (one key '
        "per line) or api_keys_env (a variable of comma-separated keys), or "
        "auth.trusted_gateway with its proof; `fair-frontend up --demo` runs the example "
        "config's demo keys"
    )


def model_access_problem(config: Config) -> str | None:
    """Which tenants would be refused every model (403), or None: worth saying at start,
    since model access is closed by default and a config written before it has no
    ``tier_models``. A warning, not a refusal: a tenant may be closed on purpose."""
    closed = ModelAccess.from_config(config).closed_tenants()
    if not closed:
        return None
    return (
        f"tenants {', '.join(closed)} may call no model: every request of theirs will be "
        "refused 403 (PERMISSION_DENIED). Models are closed unless opened: list each tier's "
        "in tier_models, or a tenant's own in tenants.<name>.models / extra_models"
    )


def tenants_with_demo_keys(keyring: KeyRing) -> list[str]:
    """The tenants that accept one of the example config's published demo keys."""
    return sorted({t for key in DEMO_KEYS if (t := keyring.tenant_for(key)) is not None})


def _workers(args: argparse.Namespace, config: Config) -> int:
    workers: int | None = args.workers if args.workers is not None else config.server.workers
    if workers is None:
        workers = default_workers()
    if workers < 1:
        raise ConfigError("--workers", [f"must be at least 1, got {workers}"])
    return workers


async def _serve(
    config: Config,
    triton_url: str | Sequence[str],
    listen: Listen,
    workers: int,
    config_path: str | None = None,
    demo: bool = False,
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
    _announce(server, listen, triton_url, config, demo)
    try:
        await stop.wait()
    finally:
        log.info("stopping: finishing queued and in-flight requests")
        await server.stop()


def _reload(server: FrontendServer, path: str) -> None:
    """SIGHUP: read the config file again and apply what can change live (see
    ``Core.reload``); the rest is kept, named in an ERROR log line."""
    try:
        config = load_config(path)
        checked = check_start(config)  # the keys read once: checked here, applied below
        server.reload(config, checked.keyring)
    except (ConfigError, StartRefused) as err:  # refused at start too (exit 2)
        log.error("reload refused, keeping the running config: %s", err)
        return
    for warning in checked.warnings:
        log.warning("%s", warning)


def _secret(args: argparse.Namespace) -> bytes | None:
    try:
        return load_secret(args.secret_file, SECRET_ENV)
    except SecretError as err:
        print(f"fair-frontend: {err}", file=sys.stderr)
        return None


def _fleet_core(config: Config, args: argparse.Namespace) -> int:
    secret = _secret(args)
    if secret is None:
        return 2
    listen = Listen(
        host=args.metrics_host or config.server.metrics_host or config.server.host,
        metrics_port=config.server.metrics_port if args.metrics_port is None else args.metrics_port,
        metrics_host=args.metrics_host or config.server.metrics_host,
        metrics_grpc_port=config.server.metrics_grpc_port,
    )

    async def main() -> int:
        stop = _stop_on_signals()
        return await run_core(
            config,
            args.triton_url,
            listen,
            args,
            secret,
            stop,
            reload=lambda server: _reload(server, args.config),
        )

    try:
        return uvloop.run(main())
    except ConfigError as err:
        print(f"fair-frontend: {err}", file=sys.stderr)
        return 2
    except (OSError, ValueError, RuntimeError) as err:
        print(f"fair-frontend: {err}", file=sys.stderr)
        return 1


def _fleet_shells(args: argparse.Namespace) -> int:
    configure_logging(args.log_format, args.log_level)
    try:
        parse_core_sets(args.core)
    except ValueError as err:
        print(f"fair-frontend: {err}", file=sys.stderr)
        return 2
    secret = _secret(args)
    if secret is None:
        return 2
    if args.workers < 1:
        print(f"fair-frontend: --workers must be at least 1, got {args.workers}", file=sys.stderr)
        return 2

    async def main() -> int:
        return await run_shells(args, secret, _stop_on_signals())

    try:
        return uvloop.run(main())
    except OSError as err:
        print(f"fair-frontend: cannot listen: {err}", file=sys.stderr)
        return 1


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _up(config: Config, args: argparse.Namespace, demo: bool = False) -> None:
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
    # up serves its own Triton alone (a pool is serve's: triton.backends is left aside).
    own = {"metrics_url": triton.metrics_url, "http_url": triton.http_url}
    update: dict[str, Any] = {k: v for k, v in own.items() if getattr(config.triton, k) is None}
    if config.triton.backends:
        log.warning("up serves its own Triton: triton.backends is not used")
        update = {"backends": [], **own}
    if update:
        config = config.model_copy(update={"triton": config.triton.model_copy(update=update)})
    watchdog = asyncio.get_running_loop().create_task(_keep_alive(triton))
    try:
        await _serve(
            config,
            triton.grpc_url,
            _listen(args, config),
            _workers(args, config),
            args.config,
            demo,
        )
    finally:
        watchdog.cancel()
        print("stopping Triton ...", flush=True)
        await asyncio.to_thread(triton.stop)


async def _keep_alive(triton: Any, interval_s: float = 0.5) -> None:
    """up mode: restart the embedded Triton if it dies (same ports; the frontend holds
    queued requests meanwhile and resumes when Triton is ready again)."""
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


def _announce(
    server: FrontendServer,
    listen: Listen,
    triton_url: str | Sequence[str],
    config: Config,
    demo: bool,
) -> None:
    host = _shown(listen.host)
    mhost = _shown(listen.metrics_host or listen.host)
    lines = [
        "",
        f"fair_frontend is serving (Triton at {', '.join(server.triton_urls)})",
        f"  HTTP    http://{host}:{server.http_port}",
        f"  gRPC    {host}:{server.grpc_port}",
        f"  metrics http://{mhost}:{server.metrics_port}/metrics   (operator-only)",
    ]
    if config.server.statistics == "operator":
        lines.append(
            f"  stats   http://{mhost}:{server.metrics_port}/v2/models/stats   (operator-only; "
            "not on the tenant ports)"
        )
    if demo:
        key = DEMO_KEYS[0]
        lines += [
            "",
            "*" * 78,
            *textwrap.wrap(
                demo_banner(listen.host), 76, initial_indent="* ", subsequent_indent="* "
            ),
            "*" * 78,
            "",
            "Try it (the demo key for tenant 'acme'):",
            f"  curl -s -H 'authorization: Bearer {key}' "
            f"http://{host}:{server.http_port}/v2/models/embed/infer \\",
            """       -d '{"inputs":[{"name":"INPUT_IDS","shape":[1,4],"datatype":"INT32","""
            """"data":[1,2,3,4]}]}'""",
        ]
    lines += ["", "Ctrl-C stops it.", ""]
    print("\n".join(lines), flush=True)


def demo_banner(host: str) -> str:
    """What demo mode says, at start (a log line) and once serving (framed)."""
    exposed = host not in LOOPBACK
    return (
        "DEMO MODE: the example config's demo keys are accepted ("
        + ", ".join(DEMO_KEYS)
        + "). They are published: anyone who reaches these ports may use them"
        + (f", and the ports listen on {host}, beyond this machine" if exposed else "")
        + ". For real tenants: fair-frontend up --config YOUR.yaml (or serve)."
    )


def _shown(host: str) -> str:
    return "localhost" if host in ("0.0.0.0", "::", "") else host


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
