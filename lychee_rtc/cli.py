"""The ``lychee-rtc`` command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
from typing import Any, Sequence

from lychee_rtc import __version__
from lychee_rtc.config import ConfigError, Settings, load_settings


def _serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from lychee_rtc.server.app import create_app

    # Flags win over the environment and the profile, so only the flags actually given count.
    overrides: dict[str, Any] = {}
    if args.host is not None:
        overrides.setdefault("server", {})["host"] = args.host
    if args.port is not None:
        overrides.setdefault("server", {})["port"] = args.port
    try:
        settings = load_settings(args.config, overrides=overrides)
    except ConfigError as exc:
        print(f"lychee-rtc: {exc}", file=sys.stderr)
        return 2
    try:
        app = create_app(settings)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"lychee-rtc: cannot start engine {settings.engine.name!r}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a damaged model file and the like: say what, keep the trace for --log-level DEBUG
        logging.getLogger("lychee_rtc").debug("engine start-up failed", exc_info=True)
        print(f"lychee-rtc: cannot start engine {settings.engine.name!r}: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 2
    host, port = settings.server.host, settings.server.port
    try:
        # Bind before announcing, so a busy port is one line, not a banner and a traceback.
        sock = bind_socket(host, port)
    except OSError as exc:
        print(f"lychee-rtc: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"lychee-rtc {__version__}: engine {settings.engine.name!r} on http://{_url_host(host)}:{port}", flush=True)
    try:
        from lychee_rtc.server.logs import RedactingAccessLogger

        web.run_app(app, sock=sock, print=None, access_log_class=RedactingAccessLogger)
    except Exception as exc:  # engine start-up runs inside run_app; report it like the failures above
        logging.getLogger("lychee_rtc").debug("server failed", exc_info=True)
        print(f"lychee-rtc: server stopped: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 0


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket for ``host:port`` (IPv4 or IPv6 literal, or a name)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _check_config(args: argparse.Namespace) -> int:
    try:
        settings: Settings = load_settings(args.config)
    except ConfigError as exc:
        print(f"lychee-rtc: {exc}", file=sys.stderr)
        return 2
    print(settings.model_dump_json(indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lychee-rtc",
        description="WebRTC media server and streaming pipeline for full-duplex spoken language models.",
    )
    parser.add_argument("--version", action="version", version=f"lychee-rtc {__version__}")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the server (echo engine unless the config says otherwise)",
                           description="Serve WebRTC sessions: JSON offer/answer at /v1/rtc/offer, WHIP at /whip, "
                                       "the web client at /.")
    serve.add_argument("--config", help="profile YAML (default: configs/echo.yaml, or $LYCHEE_RTC_CONFIG)")
    serve.add_argument("--host", help="address to listen on (overrides server.host)")
    serve.add_argument("--port", type=int, help="port to listen on (overrides server.port)")
    serve.set_defaults(func=_serve)

    check = sub.add_parser("config", help="print the effective settings after files, environment and defaults",
                           description="Load and validate a profile; print the effective settings as JSON.")
    check.add_argument("--config", help="profile YAML")
    check.set_defaults(func=_check_config)

    # add_help=False: its options, "--help" included, belong to the model code's own parser.
    tiny = sub.add_parser("tiny-checkpoint", add_help=False,
                          help="write a tiny random Lychee-FD checkpoint (with a tiny token2wav/) for CPU runs",
                          description="Write a tiny random checkpoint in the released layout: config.json, sharded "
                                      "safetensors with index, tokenizer files, a token2wav/ folder and a default "
                                      "voice, so the lychee engine runs end to end on a CPU.")
    tiny.set_defaults(func=_tiny_checkpoint, passes_extra_args=True)

    from lychee_rtc.bench.cli import add_bench_parser
    from lychee_rtc.cluster.cli import add_cluster_parser

    add_bench_parser(sub)
    add_cluster_parser(sub)
    return parser


def _tiny_checkpoint(args: argparse.Namespace) -> int:
    """Parsed by the model code's own parser, imported only now (it needs the [model] extra)."""
    try:
        from lychee_rtc.engine.lychee.tiny import add_arguments, run
    except ImportError as exc:
        print(f"lychee-rtc: tiny-checkpoint needs the model extra (pip install 'lychee-rtc[model]', "
              f"or 'make tiny'): {exc}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="lychee-rtc tiny-checkpoint")
    add_arguments(parser)
    return run(parser.parse_args(args.extra_args))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Commands that hand their options to a parser of their own (benches, tiny-checkpoint) take the
    # rest of the line; every other command refuses what it does not know.
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passes_extra_args", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra_args = extra
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aioice").setLevel(logging.WARNING)
    result = args.func(args)
    if asyncio.iscoroutine(result):
        result = asyncio.run(result)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
