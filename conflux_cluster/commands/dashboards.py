"""``conflux dashboards``: the Grafana dashboards ConfluxServe ships.

    conflux dashboards list
    conflux dashboards push --url http://grafana:3000 --token $GRAFANA_TOKEN [--folder-uid confluxserve]

``push`` saves every shipped dashboard (or ``--file``) through Grafana's HTTP API (``POST
/api/dashboards/db``, overwriting the same uid), creating the folder first when ``--folder-title`` is
given. The token is a Grafana service-account token (Editor role) or API key; ``GRAFANA_TOKEN`` is read
when ``--token`` is not given. No extra package is needed (the standard library's HTTP client).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    from ._formatting import HelpFormatter

    p = subparsers.add_parser("dashboards", help="list or push the Grafana dashboards to a Grafana server",
                              description=__doc__, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    ls = sub.add_parser("list", help="the shipped dashboard files", formatter_class=HelpFormatter)
    ls.set_defaults(func=run_list)
    push = sub.add_parser("push", help="create or update the dashboards in Grafana", description=__doc__,
                          formatter_class=HelpFormatter)
    push.add_argument("--url", required=True, help="Grafana's base URL, e.g. http://grafana:3000")
    push.add_argument("--token", default=None,
                      help="service-account token or API key (unset: the GRAFANA_TOKEN variable)")
    push.add_argument("--folder-uid", default=None, help="folder to save into (unset: Grafana's General folder)")
    push.add_argument("--folder-title", default=None,
                      help="create the --folder-uid folder with this title if it does not exist (unset: it must exist)")
    push.add_argument("--file", action="append", default=None, type=Path,
                      help="dashboard JSON to push, repeatable (unset: every dashboard ConfluxServe ships)")
    push.add_argument("--no-overwrite", dest="overwrite", action="store_false",
                      help="fail instead of replacing a dashboard with the same uid")
    push.add_argument("--message", default="conflux dashboards push", help="version note stored in Grafana")
    push.set_defaults(func=run_push)


def _files(args: argparse.Namespace) -> list[Path]:
    if args.file:
        return list(args.file)
    from conflux_cluster.dashboards import dashboard_files

    files = dashboard_files()
    if not files:
        raise ValueError("no dashboard JSON found in the installed package; pass --file")
    return files


def run_list(args: argparse.Namespace) -> int:
    for path in _files(argparse.Namespace(file=None)):
        doc = json.loads(path.read_text())
        print(f"{doc.get('uid')}\t{doc.get('title')}\t{path}")
    return 0


def run_push(args: argparse.Namespace) -> int:
    from conflux_cluster.grafana import GrafanaClient

    token = args.token or os.environ.get("GRAFANA_TOKEN")
    if not token:
        raise ValueError("no Grafana token: pass --token or set GRAFANA_TOKEN")
    if args.folder_title and not args.folder_uid:
        raise ValueError("--folder-title needs --folder-uid")
    dashboards = []
    for path in _files(args):
        try:
            dashboards.append(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a dashboard JSON file ({e})") from None
    client = GrafanaClient(args.url, token)
    if args.folder_title and client.ensure_folder(args.folder_uid, args.folder_title):
        print(f"created folder {args.folder_uid!r} ({args.folder_title})")
    for dash in dashboards:
        res = client.push_dashboard(dash, args.folder_uid, args.overwrite, args.message)
        print(f"pushed {dash.get('title')!r}: {args.url.rstrip('/')}{res.url} (version {res.version})")
    return 0
