"""``ServeConfig``: everything ``conflux serve`` needs, validated (pydantic, unknown fields rejected).

Built from command-line flags or a YAML file (``ServeConfig.from_yaml``); the defaults are the
embedded default: local Ray, one XP instance of 2 CPU ranks serving SmolLM2-135M-Instruct on
127.0.0.1:8000.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.router.policies import RoutingPolicy

DEFAULT_MODEL = "smollm2-135m-instruct"


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_enum_values=False)

    model: str = Field(DEFAULT_MODEL, description=(
        f"'{DEFAULT_MODEL}' (the bundled GGUF), a random-weight preset, or a local HF directory / .gguf file"))
    served_model_name: str | None = Field(
        None, description="name clients pass as 'model' (default: the model's name)")
    host: str = Field("127.0.0.1", description="HTTP bind address")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0: ask the OS for a free one)")
    address: str | None = Field(
        None, description="Ray cluster to join ('auto' or host:port); None starts a local Ray")
    instances: int | None = Field(
        None, ge=1, description="XP instances; default 1 locally, one per node with --address")
    ranks: int | None = Field(
        None, ge=1, description="logical ranks per instance; default 2 on CPU, the node's GPUs on GPU")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where ranks run; auto: cuda when the cluster has GPUs")
    cpus_per_rank: float = Field(1.0, gt=0, description="CPU reserved per rank actor (placement bundle)")
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per CPU rank")
    max_model_len: int | None = Field(None, ge=16, description="context cap (default: the model's)")
    num_kv_blocks: int | None = Field(None, ge=1, description="KV blocks per rank (default: engine's)")
    block_size: int | None = Field(None, ge=1, description="tokens per KV block (default: engine's)")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig,
                                       description="per-instance scheduler (policy, SLOs, budgets)")
    router_policy: RoutingPolicy = Field(
        RoutingPolicy.LOWEST_LOAD, description="global router: lowest_load | round_robin | power_of_two | random")
    ingress_replicas: int = Field(1, ge=1, description="HTTP ingress replicas (share one router)")
    api_key: str | None = Field(None, description="if set, /v1 requires 'Authorization: Bearer <key>'")
    load_report_interval_s: float = Field(0.02, gt=0, description="how often instances report load")
    control_plane: Literal["auto", "compiled_graph", "actor_calls"] = Field(
        "auto", description="per-iteration rank calls: Ray Compiled Graph or plain actor calls")
    warmup: bool = Field(True, description="before an instance reports ready, run synthetic requests through "
                         "every path a real one takes (engine/warmup.py: kernel compilation, NCCL set-up, first "
                         "allocations), so the first requests do not pay for them")
    app_name: str = Field("conflux", description="Ray Serve application name")
    seed: int = Field(0, description="seed of the router's random policies")

    @field_validator("model")
    @classmethod
    def _model_exists(cls, v: str) -> str:
        from conflux_cluster.engine.loader import builtin_names

        names = builtin_names()
        if v not in names and not Path(v).expanduser().exists():
            raise ValueError(f"model {v!r} is neither a built-in model ({', '.join(names)}) "
                             "nor an existing local path")
        return v

    @property
    def model_name(self) -> str:
        """The name served on /v1/models."""
        if self.served_model_name:
            return self.served_model_name
        return self.model if not Path(self.model).expanduser().exists() else Path(self.model).name

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: object) -> "ServeConfig":
        """Read a YAML mapping of these fields; ``overrides`` (non-None) win over the file."""
        text = Path(path).read_text()
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of ServeConfig fields, got {type(data).__name__}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(data)


def format_validation_error(err: ValidationError) -> str:
    """One line per bad field: 'field.path: message'."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(config)"
        lines.append(f"{loc}: {e['msg']}")
    return "; ".join(lines)
