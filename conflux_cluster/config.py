"""``ServeConfig``: everything ``conflux serve`` needs, validated (pydantic, unknown fields rejected).

Built from command-line flags or a YAML file (``ServeConfig.from_yaml``); the defaults are the
embedded default: local Ray, one XP instance of 2 CPU ranks serving SmolLM2-135M-Instruct on
127.0.0.1:8000. Engine fields are ``EngineConfig``'s own (same default, bounds and description);
scheduler fields live under ``scheduler:`` and may also be written at the top level of the YAML file
(``policy: slo``), as their flags are (``--policy slo``).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from conflux_cluster.engine.config import Device, EngineConfig
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.engine.xp.modes import XPMode
from conflux_cluster.router.policies import RoutingPolicy
from conflux_cluster.router.prefix_aware import PrefixRouting

DEFAULT_MODEL = "smollm2-135m-instruct"
# ServeConfig fields that are EngineConfig fields of the same name and meaning
ENGINE_FIELDS = ("dtype", "gpu_memory_utilization", "kv_cache_memory_gb", "num_kv_blocks", "block_size",
                 "max_model_len", "xp_mode", "cuda_graphs", "cuda_graph_max_tokens", "async_scheduling",
                 "step_log", "scheduler")


def _engine_field(name: str) -> Any:
    """``EngineConfig``'s field ``name``: its default, bounds and description are written once, there."""
    return copy.copy(EngineConfig.model_fields[name])


class ServeConfig(BaseModel):
    # allow_inf_nan=False: every float field is finite ('inf' / 'nan' are errors naming the field); each also has
    # an upper bound (a finite 1e308 would overflow timers and resource sizes as inf did)
    model_config = ConfigDict(extra="forbid", use_enum_values=False, allow_inf_nan=False)

    model: str = Field(DEFAULT_MODEL, description=(
        f"'{DEFAULT_MODEL}' (the bundled GGUF), a random-weight preset, or a local HF directory / .gguf file"))
    served_model_name: str | None = Field(
        None, description="name clients pass as 'model' (default: the model's name)")
    host: str = Field("127.0.0.1", description="HTTP bind address")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0: ask the OS for a free one)")
    address: str | None = Field(
        None, description="Ray cluster to join ('auto' or host:port); None starts a local Ray")
    instances: int | None = Field(
        None, ge=1, description="XP instances; default 1 locally; with --address the most instances, which "
        "follow the nodes joining and leaving (default: as many as the nodes up at start host)")
    ranks: int | None = Field(
        None, ge=1, description="logical ranks per instance; default 2 on CPU, the node's GPUs on GPU")
    device: Device = Field(
        Device.AUTO, description="where ranks run; auto: cuda when the cluster has GPUs")
    cpus_per_rank: float = Field(1.0, gt=0, le=1024, description="CPU reserved per rank actor (placement bundle)")
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per CPU rank")
    max_model_len: int | None = Field(
        None, ge=16, description="context cap in tokens (default: the model's, lowered to what one rank's KV "
        "pool holds)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _engine_field("dtype")
    gpu_memory_utilization: float = _engine_field("gpu_memory_utilization")
    kv_cache_memory_gb: float | None = _engine_field("kv_cache_memory_gb")
    num_kv_blocks: int | None = _engine_field("num_kv_blocks")
    block_size: int = _engine_field("block_size")
    xp_mode: XPMode = _engine_field("xp_mode")
    cuda_graphs: bool | None = _engine_field("cuda_graphs")
    cuda_graph_max_tokens: int | None = _engine_field("cuda_graph_max_tokens")
    async_scheduling: bool = _engine_field("async_scheduling")
    step_log: str | None = _engine_field("step_log")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig,
                                       description="per-instance scheduler (policy, SLOs, budgets)")
    router_policy: RoutingPolicy = Field(
        RoutingPolicy.LOWEST_LOAD, description="global router: lowest_load | round_robin | power_of_two | random | "
        "prefix_aware (lowest_load minus the prefill a request's cached prefix saves; router/prefix_aware.py)")
    router_prefix_weight: float = Field(PrefixRouting.prefix_weight, ge=0, le=1e6, description="prefix_aware: weight of "
                                        "the prefill seconds a cached prefix saves on an instance (docs/prefix-caching.md)")
    router_load_weight: float = Field(PrefixRouting.load_weight, ge=0, le=1e6, description="prefix_aware: weight of the normalized queued "
                                      "workload (seconds of prefill backlog)")
    router_prefix_block_tokens: int = Field(PrefixRouting.block_tokens, ge=1, description="prefix_aware: tokens per prefix block the "
                                            "ingress hashes for the router")
    router_prefix_cache_tokens: int = Field(PrefixRouting.capacity_tokens, ge=0, description="prefix_aware: prefix tokens the router "
                                            "remembers per instance (its estimate of the instance's cache)")
    ingress_replicas: int = Field(1, ge=1, description="HTTP ingress replicas (share one router)")
    api_key: str | None = Field(None, description="if set, /v1 requires 'Authorization: Bearer <key>'")
    api_keys_file: Path | None = Field(
        None, description="file of further accepted API keys, one per line ('#' starts a comment), read where the "
        "ingress runs; keys in the env var CONFLUX_API_KEYS (comma-separated) are accepted as well")
    max_request_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="largest request body in bytes; "
                                   "a larger one gets 413 before it is read")
    body_timeout_s: float = Field(60.0, gt=0, le=3600, description="seconds a request body may take to arrive "
                                  "once its headers did: a slower one gets 408 (a stalled client holds no "
                                  "connection forever)")
    request_timeout_s: float | None = Field(
        None, gt=0, le=7 * 86400, description="per-request deadline from arrival: a non-streamed request past it gets 408 and is "
        "aborted (KV freed), a stream ends with an in-band error; unset: no deadline")
    max_tokens_limit: int | None = Field(
        None, ge=1, description="largest max_tokens a request may ask for (400 beyond it), also the output cap of "
        "a request that sets none; unset: the rest of the context")
    max_logprobs: int = Field(20, ge=0, description="most alternatives per token a request may ask for "
                              "(chat top_logprobs, completions logprobs), as vLLM's max_logprobs; more is a 400")
    generation_config: str = Field(
        "auto", description="sampling defaults a request does not set: 'auto' reads the model directory's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens; a GGUF "
        "file has none), 'vllm' the built-in defaults only, or a folder holding a generation_config.json")
    chat_template: str | None = Field(
        None, description="a Jinja chat template over the model's own: a file path, or the template itself")
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = Field(
        None, description="split a thinking model's output at <think>...</think> into the message's "
        "reasoning_content and content (deepseek_r1: output starts in the thinking; qwen3: only after <think>)")
    allowed_origins: list[str] = Field(
        default_factory=list, description="CORS: browser origins allowed to call the API ('*': any); empty: no "
        "CORS headers and a preflight OPTIONS gets 405")
    load_report_interval_s: float = Field(0.02, gt=0, le=60, description="how often instances report load")
    max_queued_requests_per_instance: int | None = Field(
        None, ge=0, description="admission bound: requests an instance may hold waiting for prefill (reported, "
        "plus routed and not yet reported) before the router answers new ones 503 with Retry-After once every "
        "instance is full; default scheduler.max_num_seqs (one full decode batch waiting); 0: no bound")
    rate_limit_requests_per_minute: float | None = Field(
        None, gt=0, le=1e9, description="per API key (all keyless requests together): average requests per minute before "
        "the router answers 429 with Retry-After; unset: no rate limit")
    rate_limit_burst: int | None = Field(
        None, ge=1, description="requests an API key may send at once under the rate limit (default: ten seconds' "
        "worth of rate_limit_requests_per_minute, at least 1)")
    log_stats_interval_s: float = Field(
        10.0, ge=0, le=86400, description="seconds between an instance's throughput lines in its replica log (output tok/s, "
        "running/waiting, KV use, step time, how busy the ranks were); 0: none")
    rank_watch_interval_s: float = Field(
        0.5, gt=0, le=3600, description="how often an instance probes its rank actors: a dead one makes the instance stop "
        "admitting, end its streams with a 503 error and rebuild its ranks in place (an iteration in flight sees "
        "the death at once)")
    control_plane: Literal["auto", "compiled_graph", "actor_calls"] = Field(
        "auto", description="per-iteration rank calls: Ray Compiled Graph or plain actor calls")
    warmup: bool = Field(True, description="before an instance reports ready, run synthetic requests through "
                         "every path a real one takes (engine/runtime/warmup.py: kernel compilation, NCCL set-up, first "
                         "allocations), so the first requests do not pay for them")
    freeze_gc: bool = Field(True, description="after warm-up, freeze each serving process's start-up heap so that "
                            "Python's full garbage collections skip it (engine/util/gc_heap.py: a full collection of "
                            "~400K start-up objects stalls the process ~0.1-0.25 s)")
    drain_grace_s: float = Field(
        30.0, ge=0, le=3600, description="graceful drain on SIGTERM (and the KubeRay preStop hook): new requests get "
        "503 server_draining at once and /health 503, requests in flight may finish for this many seconds, then "
        "the server stops (serve/drain.py)")
    app_name: str = Field("conflux", description="Ray Serve application name")
    seed: int = Field(0, description="seed of the router's random policies")

    @model_validator(mode="before")
    @classmethod
    def _nest_scheduler_fields(cls, data: Any) -> Any:
        return nest_scheduler_fields(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _engine_rules(self) -> "ServeConfig":
        """The engine's own rules across fields (e.g. no prefix caching with xp_mode='uniform-sp'), checked
        here so that they fail at start-up, not in each instance replica. Rules that depend on the ranks
        and the model are checked before deploying (``serve/preflight.py``)."""
        try:
            engine_config(self, 1, "cpu")
        except ValidationError as e:
            raise ValueError(format_validation_error(e)) from None
        return self

    def prefix_routing(self) -> PrefixRouting:
        """The prefix_aware policy's settings."""
        return PrefixRouting(self.router_prefix_weight, self.router_load_weight, self.router_prefix_block_tokens,
                             self.router_prefix_cache_tokens)

    @field_validator("step_log")
    @classmethod
    def _absolute_step_log(cls, v: str | None) -> str | None:
        """Relative to where the config is built; each replica writes on its own node's disk (checked
        here for this node: a directory that cannot be made or written is a config error)."""
        if not v:
            return None
        p = Path(v).expanduser().absolute()
        if p.is_dir():
            raise ValueError(f"{p} is a directory; give a file name (instance i writes <stem>.<i>.jsonl)")
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot create {p.parent}: {e.strerror}") from None
        if not os.access(p.parent, os.W_OK):
            raise ValueError(f"{p.parent} is not writable")
        return str(p)

    @field_validator("api_key")
    @classmethod
    def _sendable_key(cls, v: str | None) -> str | None:
        """A key a client can send in ``Authorization: Bearer <key>``. An empty one (``--api-key "$KEY"`` with
        the variable unset) would serve /v1 without a key; one with whitespace at either end (HTTP drops it from
        a header) or a character outside printable ASCII (headers are read as Latin-1) could never match."""
        if v is None:
            return v
        if not v.strip():
            raise ValueError("empty: leave api_key unset for a server without keys")
        problem = unsendable_key(v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("api_keys_file")
    @classmethod
    def _absolute_keys_file(cls, v: Path | None) -> Path | None:
        """Relative to where the config is built, not to the ingress replica's working directory."""
        return None if v is None else v.expanduser().absolute()

    @field_validator("model")
    @classmethod
    def _model_exists(cls, v: str) -> str:
        from conflux_cluster.engine.loader import builtin_names

        names = builtin_names()
        if v not in names and not Path(v).expanduser().exists():
            raise ValueError(f"model {v!r} is neither a built-in model ({', '.join(names)}) "
                             "nor an existing local path")
        return v

    @field_validator("chat_template")
    @classmethod
    def _chat_template_readable(cls, v: str | None) -> str | None:
        if v is not None and "{" not in v and not Path(v).expanduser().is_file():
            raise ValueError(f"chat_template {v!r} is neither a Jinja template nor an existing file")
        return v

    @field_validator("generation_config")
    @classmethod
    def _generation_config_exists(cls, v: str) -> str:
        if v not in ("auto", "vllm") and not (Path(v).expanduser() / "generation_config.json").is_file():
            raise ValueError(f"generation_config {v!r}: expected 'auto', 'vllm' or a folder holding a "
                             "generation_config.json")
        return v

    @property
    def model_name(self) -> str:
        """The name served on /v1/models."""
        if self.served_model_name:
            return self.served_model_name
        return self.model if not Path(self.model).expanduser().exists() else Path(self.model).name

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: object) -> "ServeConfig":
        """Read a YAML mapping of these fields; ``overrides`` (non-None) win over the file. A file that is
        not YAML is a ValueError naming the file and the line."""
        data = read_yaml_mapping(path)
        data = nest_scheduler_fields(data)
        for k, v in nest_scheduler_fields({k: v for k, v in overrides.items() if v is not None}).items():
            if k == "scheduler" and isinstance(data.get(k), dict) and isinstance(v, dict):
                v = {**data[k], **v}  # a flag overrides one scheduler field, not the file's whole section
            data[k] = v
        return cls.model_validate(data)


def unsendable_key(key: str) -> str | None:
    """Why no client can send ``key`` in an ``Authorization`` header (None: it can): HTTP drops whitespace at
    either end of a header value, and the server reads header bytes as Latin-1, so a character outside
    printable ASCII never arrives as the key's own UTF-8."""
    if key != key.strip():
        return "starts or ends with whitespace, which no Authorization header can carry"
    if not (key.isascii() and key.isprintable()):
        return "must be printable ASCII, as an Authorization header carries it"
    return None


def engine_config(config: ServeConfig, num_ranks: int, device: Device) -> EngineConfig:
    """The per-instance engine configuration a ``ServeConfig`` implies (before ``xp_topology``)."""
    same = {f: getattr(config, f) for f in ENGINE_FIELDS}
    return EngineConfig(model=config.model, device=device, num_ranks=num_ranks,
                        num_threads=config.torch_threads, load_progress=False, **same)


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """The YAML mapping in file ``path`` ({} for an empty file); a ValueError names the file (and the line
    of a syntax error), and one that is not a regular file (a FIFO or a device would be read without end).
    OSError (missing, unreadable) is left to the caller."""
    p = Path(path)
    if p.exists() and not p.is_file() and not p.is_dir():  # a folder: read_text's own IsADirectoryError
        raise ValueError(f"config file {path}: not a regular file")
    try:
        data = yaml.safe_load(p.read_text())
    except UnicodeDecodeError:
        raise ValueError(f"config file {path}: not UTF-8 text") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(p) for p in (getattr(e, "context", None), getattr(e, "problem", None)) if p)
        raise ValueError(f"config file {path}: invalid YAML{where}: {problem or e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: expected a mapping of ServeConfig fields, got {type(data).__name__}")
    return data


def scheduler_only_fields() -> list[str]:
    """``SchedulerConfig`` fields that are not also ``ServeConfig`` fields (they may be written flat)."""
    return [f for f in SchedulerConfig.model_fields if f not in ServeConfig.model_fields]


def nest_scheduler_fields(data: dict[str, Any]) -> dict[str, Any]:
    """Move top-level scheduler fields (``policy: slo``) under ``scheduler``; a field written both
    ways is an error naming it."""
    flat = {k: data[k] for k in scheduler_only_fields() if k in data}
    if not flat:
        return data
    out = {k: v for k, v in data.items() if k not in flat}
    nested = out.get("scheduler")
    if nested is None:
        nested = {}
    elif isinstance(nested, SchedulerConfig):
        nested = nested.model_dump(exclude_unset=True)
    elif not isinstance(nested, dict):
        return data  # let validation report the bad 'scheduler' value
    both = sorted(set(flat) & set(nested))
    if both:
        raise ValueError(f"{', '.join(both)}: given both at the top level and under 'scheduler'")
    out["scheduler"] = {**nested, **flat}
    return out


def format_validation_error(err: ValidationError) -> str:
    """One line per bad field: 'field.path: message'."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")  # pydantic's prefix of a validator's ValueError
        lines.append(f"{loc}: {msg}" if loc else msg)  # a rule across fields names them in its message
    return "; ".join(lines)
