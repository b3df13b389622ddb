"""A serving backend for in-process tests: every request goes to one ``XPInstanceServer`` (no router, no Ray)."""

from __future__ import annotations

from conflux_cluster.actors.instance import XPInstanceServer


class DirectBackend:
    """Backend: every request to the one in-process instance server."""

    def __init__(self, server: XPInstanceServer) -> None:
        self.server = server

    async def generate(self, requests):
        return [self.server.generate(r) for r in requests]
