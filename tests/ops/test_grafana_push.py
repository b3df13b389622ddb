"""``conflux dashboards push`` against a stand-in Grafana (stdlib HTTP server on a free port) that checks
the calls Grafana's HTTP API expects: Bearer token, JSON bodies, ``POST /api/dashboards/db`` with the
dashboard (``id`` null, its ``uid``), ``overwrite``, ``folderUid``; folders looked up and created."""

from __future__ import annotations

import json
import threading
from http.server import ThreadingHTTPServer

import pytest

from tests.json_http import JSONHandler

from conflux_cluster.cli import main
from conflux_cluster.dashboards import dashboard_files

TOKEN = "glsa_test_token"


class FakeGrafana:
    """Grafana's dashboard and folder API, in memory, strict about what a real server rejects."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict | None]] = []
        self.dashboards: dict[str, dict] = {}  # uid -> {"dashboard": ..., "folderUid": ..., "version": n}
        self.folders: dict[str, str] = {}  # uid -> title
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        fake = self

        class H(JSONHandler):

            def _body(self) -> dict | None:
                n = int(self.headers.get("Content-Length") or 0)
                if not n:
                    return None
                assert self.headers["Content-Type"] == "application/json"
                return json.loads(self.rfile.read(n))

            def _handle(self, method: str) -> None:
                body = self._body()
                fake.calls.append((method, self.path, body))
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self.send_json(401, {"message": "invalid API key"})
                if method == "POST" and self.path == "/api/dashboards/db":
                    return self._save(body)
                if method == "GET" and self.path.startswith("/api/folders/"):
                    uid = self.path.rsplit("/", 1)[1]
                    if uid in fake.folders:
                        return self.send_json(200, {"uid": uid, "title": fake.folders[uid]})
                    return self.send_json(404, {"message": "folder not found"})
                if method == "POST" and self.path == "/api/folders":
                    fake.folders[body["uid"]] = body["title"]
                    return self.send_json(200, {"uid": body["uid"], "title": body["title"]})
                self.send_json(404, {"message": "not found"})

            def _save(self, body: dict) -> None:
                dash = body["dashboard"]
                if dash.get("id") is not None:
                    return self.send_json(404, {"message": "Dashboard not found"})  # an id from another Grafana
                if body.get("folderUid") and body["folderUid"] not in fake.folders:
                    return self.send_json(400, {"message": "folder not found"})
                old = fake.dashboards.get(dash["uid"])
                if old and not body.get("overwrite"):
                    return self.send_json(412, {"message": "A dashboard with the same uid already exists",
                                             "status": "name-exists"})
                version = (old["version"] + 1) if old else 1
                fake.dashboards[dash["uid"]] = {"dashboard": dash, "folderUid": body.get("folderUid"),
                                                "version": version, "message": body.get("message")}
                self.send_json(200, {"id": 1, "uid": dash["uid"], "url": f"/d/{dash['uid']}/confluxserve",
                                  "status": "success", "version": version, "slug": "confluxserve"})

            def do_GET(self):  # noqa: N802
                self._handle("GET")

            def do_POST(self):  # noqa: N802
                self._handle("POST")

        return H


@pytest.fixture
def grafana():
    g = FakeGrafana()
    yield g
    g.close()


def test_push_saves_every_shipped_dashboard_into_a_created_folder(grafana, capsys):
    shipped = {json.loads(p.read_text())["uid"]: json.loads(p.read_text()) for p in dashboard_files()}
    assert "confluxServeDashboard" in shipped
    rc = main(["dashboards", "push", "--url", grafana.url + "/", "--token", TOKEN, "--folder-uid", "confluxserve",
               "--folder-title", "ConfluxServe"])
    assert rc == 0
    assert grafana.folders == {"confluxserve": "ConfluxServe"}
    assert [(m, p) for m, p, _ in grafana.calls] == [("GET", "/api/folders/confluxserve"), ("POST", "/api/folders")] \
        + [("POST", "/api/dashboards/db")] * len(shipped)
    for uid, dash in shipped.items():
        saved = grafana.dashboards[uid]
        assert saved["folderUid"] == "confluxserve" and saved["version"] == 1
        assert saved["dashboard"]["panels"] == dash["panels"] and saved["dashboard"]["id"] is None
    assert f"{grafana.url}/d/confluxServeDashboard/confluxserve (version 1)" in capsys.readouterr().out

    # again: the folder exists (not re-created), the dashboard is overwritten (version 2)
    grafana.calls.clear()
    assert main(["dashboards", "push", "--url", grafana.url, "--token", TOKEN, "--folder-uid", "confluxserve",
                 "--folder-title", "ConfluxServe"]) == 0
    assert ("POST", "/api/folders") not in [(m, p) for m, p, _ in grafana.calls]
    assert grafana.dashboards["confluxServeDashboard"]["version"] == 2


def test_push_errors_are_one_line(grafana, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
    cases = [
        (["--token", "wrong"], "HTTP 401: invalid API key"),
        ([], "no Grafana token"),
        (["--token", TOKEN, "--folder-uid", "missing"], "HTTP 400: folder not found"),
    ]
    for extra, message in cases:
        assert main(["dashboards", "push", "--url", grafana.url, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("conflux dashboards: error:") and message in err and "Traceback" not in err, err
    # --no-overwrite on an existing dashboard: Grafana's 412; the token from GRAFANA_TOKEN
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)
    custom = tmp_path / "d.json"
    custom.write_text(json.dumps({"uid": "mine", "title": "Mine", "panels": [], "id": 7}))
    assert main(["dashboards", "push", "--url", grafana.url, "--file", str(custom)]) == 0
    assert grafana.dashboards["mine"]["dashboard"]["id"] is None  # Grafana's id from elsewhere is dropped
    assert main(["dashboards", "push", "--url", grafana.url, "--file", str(custom), "--no-overwrite"]) == 2
    assert "HTTP 412" in capsys.readouterr().err
    closed = FakeGrafana()
    closed.close()
    assert main(["dashboards", "push", "--url", closed.url, "--file", str(custom)]) == 2
    assert "cannot reach Grafana" in capsys.readouterr().err
