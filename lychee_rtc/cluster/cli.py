"""``lychee-rtc cluster serve|workers|drain``: run the entry, and operate a running one over HTTP.

Building this parser imports neither Ray nor the server; ``serve`` imports them when it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8080"


def add_cluster_parser(sub: Any) -> None:
    cluster = sub.add_parser("cluster", help="one signaling entry in front of Ray-placed workers (needs [cluster])",
                             description="Serve through a cluster entry, or operate a running entry.")
    commands = cluster.add_subparsers(dest="cluster_command", required=True, metavar="ACTION")

    serve = commands.add_parser("serve", help="start or join a Ray cluster, place the workers, serve the entry",
                                description="The entry listens on server.host:server.port; the profile's cluster "
                                            "section says where Ray is and how workers are placed; every other "
                                            "section is what each worker serves with.")
    serve.add_argument("--config", help="profile YAML (default: configs/echo.yaml, or $LYCHEE_RTC_CONFIG)")
    serve.add_argument("--host", help="address the entry listens on (overrides server.host)")
    serve.add_argument("--port", type=int, help="port the entry listens on (overrides server.port)")
    serve.add_argument("--address", help="Ray cluster to join: auto or host:port (overrides cluster.address)")
    serve.set_defaults(func=_serve)

    for name, helptext in (("workers", "list the workers of a running entry"),
                           ("drain", "rolling restart of one worker: no new calls, ends after its calls")):
        command = commands.add_parser(name, help=helptext, description=helptext)
        command.add_argument("--url", default=DEFAULT_URL, help=f"the entry (default {DEFAULT_URL})")
        command.add_argument("--token", default=os.environ.get("LYCHEE_RTC_SERVER__AUTH_TOKEN"),
                             help="server key, when the entry requires one (default: $LYCHEE_RTC_SERVER__AUTH_TOKEN)")
        if name == "drain":
            command.add_argument("worker", help="worker id, e.g. w0")
            command.add_argument("--deadline", type=float, help="seconds before its last calls are closed "
                                                                 "(default: cluster.drain_timeout_s)")
            command.add_argument("--no-restart", action="store_true", help="stop the worker instead of restarting it")
        command.set_defaults(func=_workers if name == "workers" else _drain)


def _serve(args: argparse.Namespace) -> int:
    from lychee_rtc.cluster.entry import create_entry_app
    from lychee_rtc.cluster.placement import import_ray
    from lychee_rtc.config import ConfigError, load_settings
    from lychee_rtc.server import serve

    overrides = serve.flag_overrides(args.host, args.port)
    if args.address is not None:
        overrides["cluster"] = {"address": args.address}
    try:
        settings = load_settings(args.config, overrides=overrides)
        import_ray()
    except (ConfigError, RuntimeError) as exc:
        print(f"lychee-rtc: {exc}", file=sys.stderr)
        return 2
    host, port = settings.server.host, settings.server.port
    where = settings.cluster.address or "a local Ray"
    return serve.run(create_entry_app(settings), host, port,
                     f"lychee-rtc cluster entry on http://{serve.url_host(host)}:{port} (Ray: {where}, "
                     f"engine {settings.engine.name!r})")


def _request(url: str, token: str | None, method: str = "GET", body: dict[str, Any] | None = None) -> int:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            print(json.dumps(json.loads(response.read()), indent=2))
            return 0
    except urllib.error.HTTPError as exc:
        print(f"lychee-rtc: {exc.code}: {exc.read().decode(errors='replace')}", file=sys.stderr)
    except (urllib.error.URLError, OSError) as exc:
        print(f"lychee-rtc: cannot reach {url}: {exc}", file=sys.stderr)
    return 1


def _workers(args: argparse.Namespace) -> int:
    return _request(args.url.rstrip("/") + "/v1/cluster/workers", args.token)


def _drain(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"restart": not args.no_restart}
    if args.deadline is not None:
        body["deadline_s"] = args.deadline
    return _request(f"{args.url.rstrip('/')}/v1/cluster/workers/{args.worker}/drain", args.token, "POST", body)
