"""The ``lychee-rtc`` command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Sequence

from lychee_rtc import __version__
from lychee_rtc.config import ConfigError, Settings, load_settings


def _serve(args: argparse.Namespace) -> int:
    from lychee_rtc.server import serve
    from lychee_rtc.server.app import create_app

    try:
        settings = load_settings(args.config, overrides=serve.flag_overrides(args.host, args.port))
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
    return serve.run(app, host, port, f"lychee-rtc {__version__}: engine {settings.engine.name!r} on "
                                      f"http://{serve.url_host(host)}:{port}")


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

    # add_help=False: their options, "--help" included, belong to the model code's own parsers, which
    # are imported only when the command runs (they need the [model] extra).
    for name, (_, summary, description) in MODEL_COMMANDS.items():
        p = sub.add_parser(name, add_help=False, help=summary, description=description)
        p.set_defaults(func=_model_command, passes_extra_args=True)

    from lychee_rtc.bench.cli import add_bench_parser
    from lychee_rtc.cluster.cli import add_cluster_parser

    add_bench_parser(sub)
    add_cluster_parser(sub)
    return parser


# name -> (module with add_arguments() and run(), one-line summary, description)
MODEL_COMMANDS: dict[str, tuple[str, str, str]] = {
    "download": ("lychee_rtc.engine.lychee.download",
                 "fetch Lychee-FD and Token2Wav from the Hugging Face Hub and check them",
                 "Download the released Lychee-FD folder and Step-Audio-2-mini's token2wav/ folder into the "
                 "Hugging Face cache (or --dir), resuming what an earlier run left, then check every file and "
                 "tensor against the released inventory."),
    "check": ("lychee_rtc.engine.lychee.check",
              "check a model folder from its headers and plan its GPU memory per session count",
              "Validate the Lychee-FD and Token2Wav folders a profile names (or --dir) from their headers, "
              "without reading the weights; print the memory plan for 1, 2, 4 and 8 sessions against a GPU; "
              "with --step, run one full-size window step on the CPU, one layer at a time."),
    "tiny-checkpoint": ("lychee_rtc.engine.lychee.tiny",
                        "write a tiny random Lychee-FD checkpoint (with a tiny token2wav/) for CPU runs",
                        "Write a tiny random checkpoint in the released layout: config.json, sharded "
                        "safetensors with index, tokenizer files, a token2wav/ folder and a default voice, so "
                        "the lychee engine runs end to end on a CPU."),
    "random-checkpoint": ("lychee_rtc.engine.lychee.random_checkpoint",
                          "write a full-size Lychee-FD + Token2Wav checkpoint with random values (released layout)",
                          "Write lychee_full_duplex/ and token2wav/ in the released layout and sizes with "
                          "random values, shard by shard in bounded memory, deterministic from a seed: what "
                          "a GPU measurement loads when the real weights are not at hand."),
}


def _model_command(args: argparse.Namespace) -> int:
    """Parsed by the model code's own parser, imported only now (it needs the [model] extra)."""
    import importlib

    module_name = MODEL_COMMANDS[args.command][0]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        print(f"lychee-rtc: {args.command} needs the model extra (pip install 'lychee-rtc[model]', "
              f"or 'make install-model'): {exc}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=f"lychee-rtc {args.command}", description=MODEL_COMMANDS[args.command][2])
    module.add_arguments(parser)
    return module.run(parser.parse_args(args.extra_args))


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
