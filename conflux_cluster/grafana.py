"""A small client of Grafana's HTTP API: what ``conflux dashboards push`` needs, on the standard library.

    POST /api/dashboards/db   {"dashboard": {..., "id": null}, "overwrite": true, "folderUid": "...",
                               "message": "..."}      create or update a dashboard by its uid
    GET  /api/folders/<uid>                           does the folder exist (404: no)
    POST /api/folders         {"uid": ..., "title": ...}   create it

Every call carries ``Authorization: Bearer <service-account token or API key>``. Errors Grafana answers
(bad token, no permission, version conflict) become a ``GrafanaError`` with its status and message.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any


class GrafanaError(ValueError):
    """Grafana refused a call (a user-fixable problem: URL, token, permissions, a conflicting version)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status  # Grafana's HTTP status (None: it was not reached)


@dataclass(frozen=True)
class PushResult:
    """Grafana's answer to a dashboard save."""

    uid: str
    url: str  # path of the dashboard in Grafana's UI, e.g. /d/confluxServeDashboard/confluxserve
    version: int
    status: str  # "success"


@dataclass(frozen=True)
class GrafanaClient:
    base_url: str  # e.g. http://grafana:3000 (a sub-path install: http://host/grafana)
    token: str  # service-account token or API key
    timeout_s: float = 30.0

    def push_dashboard(self, dashboard: dict[str, Any], folder_uid: str | None = None, overwrite: bool = True,
                       message: str = "") -> PushResult:
        """Create or update ``dashboard`` (matched by its ``uid``; its ``id`` is dropped, as Grafana wants
        for an import)."""
        body: dict[str, Any] = {"dashboard": {**dashboard, "id": None}, "overwrite": overwrite,
                                "message": message}
        if folder_uid:
            body["folderUid"] = folder_uid
        doc = self._call("POST", "/api/dashboards/db", body)
        return PushResult(doc.get("uid", dashboard.get("uid", "")), doc.get("url", ""), int(doc.get("version", 0)),
                          doc.get("status", ""))

    def ensure_folder(self, uid: str, title: str) -> bool:
        """Create the folder ``uid`` unless it exists; True if it was created."""
        try:
            self._call("GET", f"/api/folders/{uid}")
            return False
        except GrafanaError as e:
            if e.status != 404:
                raise
        self._call("POST", "/api/folders", {"uid": uid, "title": title})
        return True

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url.rstrip("/") + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Accept": "application/json",
            **({"Content-Type": "application/json"} if data is not None else {})})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            raise GrafanaError(f"Grafana {method} {path}: HTTP {e.code}: {_message(e.read())}", e.code) from None
        except (urllib.error.URLError, OSError) as e:
            raise GrafanaError(f"cannot reach Grafana at {self.base_url}: {getattr(e, 'reason', e)}") from None


def _message(raw: bytes) -> str:
    try:
        doc = json.loads(raw)
        return str(doc.get("message") or doc)
    except (ValueError, AttributeError):
        return raw.decode(errors="replace")[:200]
