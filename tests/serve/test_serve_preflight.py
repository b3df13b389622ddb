"""``conflux serve`` under hostile flags and config files (serve/preflight.py and what it calls): every
mistake a replica would meet only after Ray and Serve are up fails first, in the driver, with an error
naming the flag; a plan the Ray cluster cannot host fails before deploying instead of waiting forever; a
deployment that fails anyway prints the replica's own error; a Serve handle call with a body that is not
a JSON object is the 400 the HTTP path gives. No Ray cluster here (``ray`` is monkeypatched)."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import pytest

from conflux_cluster.cli import build_parser, main
from conflux_cluster.commands.serve import config_from_args
from conflux_cluster.config import ServeConfig
from conflux_cluster.engine.config import Device
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.serve import app as app_module
from conflux_cluster.serve import preflight
from conflux_cluster.serve.app import InstancePlan, check_plans, instance_bundles, plan_instances
from conflux_cluster.serve.elastic import instance_need

TINY = "tiny-llama"  # 4 query / 2 KV heads; resolved from its preset, no file to read


def _cfg(*argv: str) -> ServeConfig:
    return config_from_args(build_parser().parse_args(["serve", *argv]))


def _node(gpus: float = 0, cpus: float = 16, alive: bool = True) -> dict:
    return {"NodeID": f"n{gpus}-{cpus}", "Alive": alive, "Resources": {"CPU": cpus, "GPU": gpus}}


@pytest.fixture
def no_ray(monkeypatch):
    """``conflux serve`` must fail before it starts Ray: starting it is a test failure."""
    def started(*_a, **_k):
        raise AssertionError("conflux serve went on to start Ray")

    monkeypatch.setattr(app_module, "run", started)


# ---- 3. floats are finite and bounded ------------------------------------------------------------------

FLOAT_FLAGS = [("--cpus-per-rank", "cpus_per_rank"),  # inf was an OverflowError sizing the local Ray
               ("--rate-limit-requests-per-minute", "rate_limit_requests_per_minute"),
               ("--tbt-slo", "scheduler.tbt_slo"), ("--ttft-slo", "scheduler.ttft_slo"),
               ("--slo-margin", "scheduler.slo_margin"), ("--request-timeout-s", "request_timeout_s"),
               ("--router-load-weight", "router_load_weight"), ("--kv-cache-memory-gb", "kv_cache_memory_gb"),
               ("--log-stats-interval-s", "log_stats_interval_s")]


@pytest.mark.parametrize("flag, field", FLOAT_FLAGS)
@pytest.mark.parametrize("value, error", [("inf", "a finite number"), ("nan", "a finite number"),
                                          ("1e308", "less than or equal to")])  # 1e308 overflowed timers as inf did
def test_inf_nan_and_huge_floats_are_rejected_naming_the_field(flag: str, field: str, value: str, error: str) -> None:
    with pytest.raises(ValueError, match=rf"{field}: Input should be {error}"):
        _cfg(flag, value)


def test_inf_in_yaml_and_in_the_scheduler_config_is_rejected(tmp_path) -> None:
    f = tmp_path / "serve.yaml"
    f.write_text("tbt_slo: .inf\n")
    with pytest.raises(ValueError, match="scheduler.tbt_slo: Input should be a finite number"):
        _cfg("--config", str(f))
    with pytest.raises(ValueError, match="ttft_slo"):
        SchedulerConfig(ttft_slo=float("nan"))


# ---- 4. YAML syntax ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, line", [("policy: [slo\n", 2), ("port: 8000\nhost: a: b\n", 2),
                                        ("ranks: 2\n\tinstances: 1\n", 2)])
def test_invalid_yaml_names_the_file_and_the_line(tmp_path, capsys, text: str, line: int) -> None:
    f = tmp_path / "serve.yaml"
    f.write_text(text)
    with pytest.raises(ValueError, match=rf"config file {f}: invalid YAML at line {line}\b"):
        ServeConfig.from_yaml(f)
    assert main(["serve", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"config file {f}: invalid YAML at line {line}" in err and "Traceback" not in err


def test_a_yaml_file_that_is_not_a_mapping_or_not_text_names_the_file(tmp_path) -> None:
    f = tmp_path / "serve.yaml"
    f.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match=rf"config file {f}: expected a mapping"):
        ServeConfig.from_yaml(f)
    f.write_bytes(b"ranks: \xff\xfe\n")
    with pytest.raises(ValueError, match=rf"config file {f}: not UTF-8"):
        ServeConfig.from_yaml(f)


# ---- 1. what only a replica used to see ------------------------------------------------------------------


def test_prefix_caching_is_on_by_default_except_uniform_sp() -> None:
    """Unset, the engine turns the cache on (as vLLM and SGLang do) and off under uniform-sp; the unset
    value survives a config's round trip to the replicas (a dump does not turn it into an explicit one)."""
    from conflux_cluster.config import engine_config

    for mode, on in (("xp", True), ("uniform-tp", True), ("uniform-sp", False)):
        sent = ServeConfig.model_validate(ServeConfig(xp_mode=mode).model_dump())
        assert engine_config(sent, 2, "cpu").scheduler.enable_prefix_caching is on, mode
    assert not engine_config(_cfg("--no-enable-prefix-caching"), 2, "cpu").scheduler.enable_prefix_caching


def test_uniform_sp_with_prefix_caching_fails_at_parse_time() -> None:
    with pytest.raises(ValueError, match="enable_prefix_caching.*uniform-sp"):
        _cfg("--xp-mode", "uniform-sp", "--enable-prefix-caching")
    with pytest.raises(ValueError, match="enable_prefix_caching"):  # also when it comes from the YAML file
        ServeConfig(xp_mode="uniform-sp", scheduler={"enable_prefix_caching": True})


@pytest.mark.parametrize("argv, message", [
    (["--ranks", "5"], r"--ranks 5 .*4 attention heads.*at most 4"),  # the ranks split the heads
    (["--ranks", "5", "--xp-mode", "uniform-tp"], r"--ranks 5 .*4 attention heads"),  # TP over all 5
    (["--estimator-profile", "{tmp}/no-such-profile.json"], r"estimator_profile: no such file"),
    (["--estimator-profile", "{tmp}/not-json.json"], r"estimator_profile: .*not-json.json"),
    (["--api-keys-file", "{tmp}/no-such-keys.txt"], r"api_keys_file: cannot read"),
    (["--num-kv-blocks", "4", "--max-model-len", "1024"], r"max_model_len=1024: one rank's KV pool"),
    (["--max-model-len", "1000000"], r"max_model_len=1000000 is longer than the model's context"),  # pool unsized
    # files the ingress reads at start: they failed the deployment after Ray and the instances had started
    (["--generation-config", "{tmp}/gc-not-json"], r"generation_config: cannot read .*generation_config.json"),
    (["--generation-config", "{tmp}/gc-list"], r"generation_config: .* is not a JSON object"),
    (["--chat-template", "{tmp}/template.bin"], r"chat_template: .*template.bin' is not UTF-8 text"),
    # keys no Authorization header can carry (headers are read as Latin-1): every request with them got 401
    (["--api-keys-file", "{tmp}/keys-accented.txt"], r"api_keys_file: .*keys-accented.txt line 2: the key must be "
                                                     r"printable ASCII"),
    (["--api-keys-file", "{tmp}/template.bin"], r"api_keys_file: .*template.bin is not UTF-8 text"),
    # a template that does not compile passed, and every chat request got a 400 blaming chat_template_kwargs
    (["--chat-template", "{{% for m in messages %}}{{{{ m.content }}"], r"chat_template: not a valid Jinja .*line 1"),
    (["--chat-template", "{tmp}/broken.jinja"], r"chat_template: not a valid Jinja template: .*line 2"),
])
def test_instance_config_errors_fail_before_ray(tmp_path, capsys, no_ray, argv: list[str], message: str) -> None:
    (tmp_path / "not-json.json").write_text("{ranks: 2")
    for folder, text in (("gc-not-json", "{"), ("gc-list", "[1]")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "generation_config.json").write_text(text)
    (tmp_path / "template.bin").write_bytes(b"\xff\xfe{{ messages }}")
    (tmp_path / "keys-accented.txt").write_text("sk-fine  # ok\nsk-caf\u00e9\n")
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}\n{{ m.content }}{% endif %}\n")
    argv = [a.format(tmp=tmp_path) for a in argv]
    config = _cfg("--model", TINY, "--port", "0", *argv)
    with pytest.raises(ValueError, match=message):
        preflight.check_before_ray(config)
    assert main(["serve", "--model", TINY, "--port", "0", *argv]) == 2  # one line, no traceback, no Ray
    err = capsys.readouterr().err
    assert err.startswith("conflux serve: error: ") and "Traceback" not in err


def test_a_good_config_passes_every_check_before_ray(tmp_path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-1\n")
    preflight.check_before_ray(_cfg("--model", TINY, "--port", "0", "--ranks", "4", "--api-keys-file", str(keys),
                                    "--estimator-profile", "budget"))


# ---- 5. --host / --port ----------------------------------------------------------------------------------


def test_host_and_port_are_checked_before_ray() -> None:
    with pytest.raises(ValueError, match="--host 'no-such-host.invalid': cannot be resolved"):
        preflight.check_http_endpoint("no-such-host.invalid", 8000)
    with pytest.raises(ValueError, match="--host '192.0.2.1': not an address of this machine"):
        preflight.check_http_endpoint("192.0.2.1", 0)  # TEST-NET-1: never a local address
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=rf"--port {port}: already in use on 127.0.0.1"):
            preflight.check_http_endpoint("127.0.0.1", port)
        preflight.check_http_endpoint("127.0.0.1", port, bind=False)  # cluster mode: the proxy binds on the head
    preflight.check_http_endpoint("127.0.0.1", 0)  # 0: a free port is picked later
    preflight.check_http_endpoint("localhost", port)  # free again


def test_cli_reports_a_busy_port_without_starting_ray(capsys, no_ray) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--model", TINY, "--port", str(port)]) == 2
    assert f"--port {port}: already in use" in capsys.readouterr().err


# ---- 2. a plan the cluster cannot host -------------------------------------------------------------------


def test_cuda_instances_need_the_cluster_to_have_their_gpus() -> None:
    plan = InstancePlan(0, 2, Device.CUDA)
    need = instance_need(instance_bundles(plan, 1.0))
    with pytest.raises(ValueError, match=r"--device cuda needs 2 GPUs per instance .*--ranks 2.*has 0 GPUs"):
        preflight.check_room([plan], need, [_node(gpus=0)])
    preflight.check_room([plan], need, [_node(gpus=2)])
    two = [plan, InstancePlan(1, 2, Device.CUDA)]
    with pytest.raises(ValueError, match=r"2 instance\(s\) \(--instances\); the Ray cluster has 3 GPUs \(per node: 2, 1\)"):
        preflight.check_room(two, need, [_node(gpus=2), _node(gpus=1), _node(gpus=4, alive=False)])
    preflight.check_room(two, need, [_node(gpus=4)])
    preflight.check_room([InstancePlan(0, 8, Device.CUDA, elastic=True)], need, [_node(0)])  # slots wait for nodes


def test_cpu_instances_that_no_node_can_host_name_the_flags() -> None:
    plan = InstancePlan(0, 2, Device.CPU)
    need = instance_need(instance_bundles(plan, 4.0))
    with pytest.raises(ValueError, match=r"--ranks, --cpus-per-rank.*CPU=8.1.*CPU=4"):
        preflight.check_room([plan], need, [_node(cpus=4), _node(cpus=4)])  # STRICT_PACK: one node each


def test_local_cuda_on_a_cluster_without_gpus_fails_before_deploying(monkeypatch) -> None:
    monkeypatch.setattr(app_module.ray, "cluster_resources", lambda: {"CPU": 16.0})
    monkeypatch.setattr(app_module.ray, "nodes", lambda: [_node(gpus=0)])
    config = ServeConfig(model=TINY, device="cuda")
    plans = plan_instances(config)
    assert [(p.num_ranks, p.device, p.elastic) for p in plans] == [(1, "cuda", False)]
    with pytest.raises(ValueError, match="--device cuda needs 1 GPUs per instance.*has 0 GPUs; use --device cpu"):
        check_plans(config, plans)


# ---- 1. a deployment that fails anyway -------------------------------------------------------------------

# the tail of what Serve kept for a replica whose constructor raised (Ray 2.60, ``serve.status()``)
REPLICA_TRACEBACK = (
    'RuntimeError: Traceback (most recent call last):\n  File "/x/ray/serve/_private/replica.py", line 1867, in '
    "initialize\n    await self._user_callable_wrapper.initialize_callable()\n"
    "ray.exceptions.RayTaskError(ValueError): \x1b[36mray::RankActorImpl.setup()\x1b[39m (pid=11181, ip=127.0.0.1)\n"
    '  File "/x/engine/kv_layout.py", line 50, in partition_head_range\n'
    '    raise ValueError(f"cannot split {shard.num_q} query heads over {parts} ranks")\n'
    "ValueError: cannot split 4 query heads over 5 ranks")


def _status(**deployments: tuple[str, str]) -> SimpleNamespace:
    deps = {n: SimpleNamespace(status=SimpleNamespace(value=s), message=m) for n, (s, m) in deployments.items()}
    return SimpleNamespace(applications={"conflux": SimpleNamespace(deployments=deps)})


def test_the_replicas_own_error_is_found_in_serve_status(monkeypatch) -> None:
    assert preflight.exception_line(REPLICA_TRACEBACK) == "ValueError: cannot split 4 query heads over 5 ranks"
    status = _status(router=("HEALTHY", ""), ingress=("HEALTHY", ""),
                     **{"xp-0": ("DEPLOY_FAILED", "The deployment failed to start 3 times in a row. Error:\n"
                                                  + REPLICA_TRACEBACK)})
    monkeypatch.setattr(app_module.serve, "status", lambda: status)
    msg = app_module.deploy_failure("conflux", RuntimeError("Deploying application conflux failed: ..."))
    assert msg == "deploying failed: xp-0: ValueError: cannot split 4 query heads over 5 ranks"

    def gone():
        raise ConnectionError("no controller")

    monkeypatch.setattr(app_module.serve, "status", gone)
    msg = app_module.deploy_failure("conflux", RuntimeError("Deploying application conflux failed"))
    assert "Ray logs" in msg and "logs/serve" in msg


def test_a_failed_deployment_exits_non_zero_with_one_line(monkeypatch, capsys) -> None:
    def failed(config, blocking=False):
        raise app_module.DeployFailed("deploying failed: xp-0: ValueError: cannot split 4 query heads over 5 ranks")

    monkeypatch.setattr(app_module, "run", failed)
    monkeypatch.setattr(preflight, "check_before_ray", lambda config: None)  # as if only the replica could tell
    assert main(["serve", "--model", TINY, "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "conflux serve: error: deploying failed: xp-0: ValueError: cannot split" in err
    assert "Traceback" not in err


# ---- 6. Serve handle calls with a body that is not a JSON object -----------------------------------------


@pytest.fixture(scope="module")
def ingress():
    from conflux_cluster.serve.ingress import OpenAIIngress

    class NoBackend:
        async def generate(self, requests):
            raise AssertionError("a bad body must not reach an instance")

    return OpenAIIngress(ServeConfig(model=TINY), router=None, instances=[], backend=NoBackend())


async def _first_delta(ingress, body):
    async for text in ingress.chat_stream(body):
        return text


@pytest.mark.parametrize("body", [["model", TINY], "hello", None, 42, {1: "x"}])
@pytest.mark.parametrize("method", ["chat", "completions", "chat_stream"])
def test_handle_calls_with_a_non_object_body_are_400(ingress, method: str, body: object) -> None:
    from conflux_cluster.serve.errors import APIError

    call = _first_delta(ingress, body) if method == "chat_stream" else getattr(ingress, method)(body)
    with pytest.raises(APIError) as e:
        asyncio.run(call)
    assert e.value.status == 400 and e.value.body()["error"]["type"] == "invalid_request_error"
    if not isinstance(body, dict):
        assert e.value.info.code == "invalid_json" and "JSON object" in e.value.info.message


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _cycle() -> dict:
    schema: dict = {"type": "object"}
    schema["properties"] = {"self": schema}
    return schema


def _schema_body(where: str, schema: dict) -> dict:
    extra = {"response_format": {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
             "tools": {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]},
             "metadata": {"metadata": {"a": schema}}}[where]
    return {"model": TINY, "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.mark.parametrize("where", ["response_format", "tools", "metadata"])
@pytest.mark.parametrize("schema", [_nested_schema(300), _cycle()], ids=["300-deep", "cycle"])
@pytest.mark.parametrize("method", ["chat", "chat_stream"])
def test_handle_bodies_nested_past_the_http_limit_are_400(ingress, method: str, schema: dict, where: str) -> None:
    """An HTTP body nesting deeper than 64 is a 400 before it is parsed; a handle caller's dict had no such bound,
    and a JSON Schema 300 objects deep (or one holding itself) made the schema checks recurse until a
    RecursionError, which reached the caller as a RayTaskError instead of an APIError. The same 400 now."""
    from conflux_cluster.serve.errors import APIError

    body = _schema_body(where, schema)
    call = _first_delta(ingress, body) if method == "chat_stream" else getattr(ingress, method)(body)
    with pytest.raises(APIError) as e:
        asyncio.run(call)
    assert e.value.status == 400 and e.value.info.code == "invalid_json" and "deeper than 64" in e.value.info.message
    if where != "metadata":  # a schema within the bound is checked and passed on as before
        with pytest.raises(APIError) as e:
            asyncio.run(ingress.chat(_schema_body(where, _nested_schema(20))))
        assert e.value.status == 500  # the fixture's backend refuses every request that reaches it


class FailingBackend:
    """A backend whose ``generate`` raises ``error``, as a router or instance call does through Ray."""

    error: Exception = RuntimeError("unset")

    async def generate(self, requests):
        raise self.error


@pytest.fixture(scope="module")
def failing():
    from conflux_cluster.serve.ingress import OpenAIIngress

    backend = FailingBackend()
    return OpenAIIngress(ServeConfig(model=TINY), router=None, instances=[], backend=backend), backend


@pytest.mark.parametrize("method", ["chat", "completions", "chat_stream"])
def test_handle_callers_get_api_errors_as_http_clients_do(failing, method: str, caplog) -> None:
    """docs/serving.md promises handle callers an APIError; anything but one (an instance that lost a rank, an
    engine's ValueError, a bug, a handle-only value such as a numpy array where a field's neutral values are
    compared) reached them raw, as a RayTaskError carrying the replica's traceback. Now the HTTP path's
    ``client_error``: 503 instance_failed with Retry-After, 400 with the engine's message, 500 naming an id."""
    import numpy as np

    from conflux_cluster.engine.contracts.stream import InstanceUnavailable
    from conflux_cluster.serve.errors import APIError

    ingress, backend = failing
    base = ({"model": TINY, "prompt": "hi", "max_tokens": 2} if method == "completions" else
            {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})

    def error_of(body: dict) -> APIError:
        call = _first_delta(ingress, body) if method == "chat_stream" else getattr(ingress, method)(body)
        with pytest.raises(APIError) as e:
            asyncio.run(call)
        return e.value

    backend.error = InstanceUnavailable(retry_after_s=7, in_flight=False)
    e = error_of(base)
    assert (e.status, e.info.code, e.headers["Retry-After"]) == (503, "instance_failed", "7")
    backend.error = ValueError("prompt too long for this instance")
    e = error_of(base)
    assert (e.status, e.info.message) == (400, "prompt too long for this instance")
    backend.error = RuntimeError("XP instance 0 at 10.0.0.7 failed; see /tmp/ray/session_latest")
    e = error_of(base)
    assert e.status == 500 and e.info.code == "internal_error" and "10.0.0.7" not in e.info.message
    assert "request id req-" in e.info.message and "10.0.0.7" in caplog.text  # logged in full under that id
    e = error_of({**base, "best_of": np.array([1, 2])})  # never reaches the backend
    assert e.status == 400 and e.info.type == "invalid_request_error"


def test_a_request_object_passed_to_a_handle_is_told_to_pass_a_dict(ingress) -> None:
    """Ray Serve LLM's handles take a ChatCompletionRequest; passed here it got "request body must be a JSON
    object", which says nothing to a Python caller. The 400 now names the type and what to pass."""
    from conflux_cluster.serve.errors import APIError
    from conflux_cluster.serve.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(model=TINY, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(APIError) as e:
        asyncio.run(ingress.chat(req))
    message = e.value.info.message
    assert e.value.status == 400 and e.value.info.code == "invalid_json"
    assert "not a ChatCompletionRequest" in message and "model_dump(exclude_unset=True)" in message, message
    with pytest.raises(APIError, match="must be a JSON object, not an array"):
        asyncio.run(ingress.chat([req]))


def test_an_env_api_key_no_client_can_send_is_a_start_up_error() -> None:
    """$CONFLUX_API_KEYS is read in each ingress replica: a key outside printable ASCII could never match a
    header (read as Latin-1), so every request with it got 401; the replica now refuses to start, naming it."""
    from conflux_cluster.serve.ingress import API_KEYS_ENV, APIKeys

    with pytest.raises(ValueError, match=f"{API_KEYS_ENV}: a key must be printable ASCII"):
        APIKeys.from_config(ServeConfig(model=TINY), environ={API_KEYS_ENV: "sk-ok, sk-\u00fcber"})
    keys = APIKeys.from_config(ServeConfig(model=TINY), environ={API_KEYS_ENV: " sk-ok ,, sk-two"})
    assert keys.check("Bearer sk-two") and keys.check("bearer sk-ok")
