"""The ingress answers /health and /v1/models with 503 (OpenAI error shape, Retry-After) until
every XP instance replica answers, i.e. has loaded its weights and finished its warm-up; with elastic
instances (cluster mode: slots that follow the nodes), until any one answers."""

from __future__ import annotations

import asyncio

from fastapi.testclient import TestClient

from conflux_cluster.serve.gate import AdmissionGate
from conflux_cluster.serve.ingress import APIKeys, OpenAIIngress, build_api


class _Call:
    def __init__(self, warming_up: bool, value: int) -> None:
        self.warming_up, self.value = warming_up, value

    def remote(self):
        async def answer() -> int:
            if self.warming_up:  # a replica still in __init__: the handle call waits for it
                await asyncio.sleep(3600)
            return self.value
        return answer()


class _Router:
    """The router deployment's ``live_instances`` (the instances up now)."""

    def __init__(self, live: list[int]) -> None:
        self.live = live
        self.live_instances = self

    def remote(self):
        async def answer() -> list[int]:
            return list(self.live)
        return answer()


class _Instance:
    def __init__(self, warming_up: bool, max_model_len: int = 96) -> None:
        self.max_model_len = _Call(warming_up, max_model_len)


def _ingress(instances, elastic: bool = False) -> OpenAIIngress:
    ing = object.__new__(OpenAIIngress)  # the routes under test read only these attributes
    ing.instances, ing._ready, ing.metrics, ing.created = instances, False, None, 0
    ing._transport = None  # an injected backend: nothing to warm
    ing.elastic, ing.router = elastic, None
    ing.keys = APIKeys(())
    ing.gate = AdmissionGate(None)  # not draining: /health asks it first

    class _Cfg:
        api_key, model_name, allowed_origins = None, "m", []
    ing.config = _Cfg()
    ing.max_model_len = 128

    class _Serving:
        max_model_len = 128
    ing.serving = _Serving()
    return ing


def test_not_ready_until_every_instance_answers():
    ing = _ingress([_Instance(False), _Instance(True)])
    client = TestClient(build_api(ing))
    for path in ("/health", "/v1/models"):
        r = client.get(path)
        assert r.status_code == 503 and r.headers["retry-after"]
        assert r.json()["error"]["code"] == "server_starting"
    ing.instances[1] = _Instance(False)  # now it answers
    assert client.get("/health").status_code == 200
    card = client.get("/v1/models").json()["data"][0]
    assert card["id"] == "m" and card["max_model_len"] == 96  # the instances' (KV-capped) context
    assert ing._ready and ing.serving.max_model_len == 96


def test_elastic_instances_are_ready_when_any_answers():
    """Cluster mode: the first instance up (reporting to the router) makes the ingress ready (its context
    is the shape every instance has). Slots the router does not list as up are never called: a call to a
    deployment without a replica would make Serve start one against the node-following policy."""
    class _Never:
        def remote(self):
            raise AssertionError("called a slot that is not up")

    class _Slot:
        max_model_len = _Never()

    ing = _ingress([_Slot(), _Instance(False, max_model_len=80)], elastic=True)
    ing.router = _Router([])
    client = TestClient(build_api(ing))
    assert client.get("/health").status_code == 503  # no instance up yet
    ing.router.live = [1]  # a node joined: xp-1 reports, xp-0 has no replica
    assert client.get("/health").status_code == 200
    assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 80


def test_health_is_503_while_no_instance_is_up_after_ready():
    """Ready once, then every instance loses a worker (the router lists none up while they are
    rebuilt): /health says so with 503 no_healthy_instance, and 200 again once one is back."""
    ing = _ingress([_Instance(False)])
    ing.router = _Router([0])
    client = TestClient(build_api(ing))
    assert client.get("/health").status_code == 200
    ing.router.live = []
    r = client.get("/health")
    assert r.status_code == 503 and r.headers["retry-after"]
    assert r.json()["error"]["code"] == "no_healthy_instance"
    ing.router.live = [0]
    assert client.get("/health").status_code == 200
