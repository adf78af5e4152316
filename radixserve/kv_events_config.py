"""`--kv-events-config`: vLLM's `KVEventsConfig`, field for field, parsed from its JSON.

The same JSON means what it means to vLLM: `enable_kv_cache_events` turns the events on;
`publisher` is "zmq" (the default when enabled) or "null"; `endpoint` is the ZMQ PUB address,
bound when it is a wildcard (`tcp://*:5557`), IPv6 (`::`), `ipc://` or `inproc://`, else
connected to (the router binds a SUB socket there); `replay_endpoint` a ROUTER address that is
always bound. One default differs from vLLM's, on purpose: without an `endpoint` the PUB socket is
bound on loopback, `tcp://127.0.0.1:5557` (vLLM binds `tcp://*:5557`, every interface, and the
events carry prompts' token ids; the replay socket hands anyone who connects all it buffered); `buffer_steps` how many past batches a replay can return; `hwm` the PUB socket's
high-water mark; `topic` the first frame of every message; `max_queue_size` is accepted for vLLM
configs and has nothing to bound here (the engine loop publishes each step's batch itself, with
no queue in between). With `--dp-size`, worker i adds i to both ports, as vLLM's ranks do.

Two fields are ours. `event_layout`, how an event is encoded in the batch. "array" (default):
vLLM's original layout, every event a msgpack array whose first element is its class name
(`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`);
"map": the layout of recent vLLM releases, every event a map with its name under "type".
Consumers written for either exist; most current ones read both. `unsalted_token_ids` (default
true): whether the blocks of the shared cache carry their token ids (gateways that re-hash tokens
need them); a salted namespace's blocks (`cache_salt`, per-key caches) never do, whatever it says.
Any other field is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Optional

PUBLISHERS = ("null", "zmq")
EVENT_LAYOUTS = ("array", "map")
# Where the PUB socket is bound when the config names no endpoint: this host only.
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
# Hosts of a tcp:// address that listen on every interface.
WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "[*]")


@dataclass(frozen=True)
class KvEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: Optional[str] = None  # None: "zmq" when enabled, else "null" (vLLM's rule)
    endpoint: Optional[str] = None  # None: bound on DEFAULT_ENDPOINT
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    event_layout: str = "array"
    unsalted_token_ids: bool = True

    @property
    def resolved_endpoint(self) -> str:
        return self.endpoint if self.endpoint is not None else DEFAULT_ENDPOINT

    @property
    def endpoint_binds(self) -> bool:
        """Whether the PUB socket binds its address (vLLM's rule, and the loopback default), else connects."""
        return self.endpoint is None or binds(self.endpoint)

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.resolved_publisher == "zmq"

    @property
    def resolved_publisher(self) -> str:
        if self.publisher is not None:
            return self.publisher
        return "zmq" if self.enable_kv_cache_events else "null"


_TYPE_NAMES = {bool: "boolean", int: "integer", str: "string"}
_TYPES = {"enable_kv_cache_events": bool, "publisher": str, "endpoint": str, "replay_endpoint": str,
          "buffer_steps": int, "hwm": int, "max_queue_size": int, "topic": str, "event_layout": str,
          "unsalted_token_ids": bool}


def parse_kv_events_config(text: str) -> KvEventsConfig:
    """The config a `--kv-events-config` JSON object gives; ValueError naming the field at fault."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"kv_events_config is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError("kv_events_config must be a JSON object")
    known = {f.name for f in fields(KvEventsConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"kv_events_config: unknown field(s) {', '.join(unknown)}; "
                         f"the fields are {', '.join(sorted(known))}")
    for name, value in raw.items():
        kind = _TYPES[name]
        nullable = name in ("publisher", "endpoint", "replay_endpoint")
        if value is None and nullable:
            continue
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        if not ok:
            raise ValueError(f"kv_events_config.{name} must be a {_TYPE_NAMES[kind]}, got {value!r}")
    config = KvEventsConfig(**raw)
    if config.publisher is not None and config.publisher not in PUBLISHERS:
        raise ValueError(f"kv_events_config.publisher must be one of {', '.join(PUBLISHERS)}, got {config.publisher!r}")
    if config.event_layout not in EVENT_LAYOUTS:
        raise ValueError(f"kv_events_config.event_layout must be one of {', '.join(EVENT_LAYOUTS)}, "
                         f"got {config.event_layout!r}")
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(config, name) < 1:
            raise ValueError(f"kv_events_config.{name} must be >= 1, got {getattr(config, name)}")
    for name in ("endpoint", "replay_endpoint"):
        value = getattr(config, name)
        if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"kv_events_config.{name} must be a tcp://, ipc:// or inproc:// address, got {value!r}")
        if value is not None and value.startswith("tcp://") and not value.rpartition(":")[2].isdigit():
            raise ValueError(f"kv_events_config.{name} needs a port, e.g. tcp://127.0.0.1:5557; got {value!r}")
    if config.resolved_endpoint == config.replay_endpoint:
        raise ValueError("kv_events_config.replay_endpoint must differ from endpoint")
    return config


def offset_endpoint(endpoint: Optional[str], dp_rank: int) -> Optional[str]:
    """Data-parallel worker dp_rank's address: the port plus dp_rank for tcp, `_dp<rank>` appended
    otherwise (vLLM's rule for tcp and inproc; vLLM refuses ipc with data parallelism)."""
    if not endpoint or dp_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + dp_rank}"
    return f"{endpoint}_dp{dp_rank}"


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, IPv6, ipc or inproc address; connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def listens_everywhere(endpoint: str) -> bool:
    """Whether binding this address listens on every interface (a tcp:// wildcard host)."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rpartition(":")[0]
    return host in WILDCARD_HOSTS


def exposed_endpoints(config: KvEventsConfig, dp_rank: int = 0) -> list[str]:
    """The addresses this config binds on every interface (data-parallel rank dp_rank's)."""
    bound = [offset_endpoint(config.resolved_endpoint, dp_rank)] if config.endpoint_binds else []
    if config.replay_endpoint is not None:
        bound.append(offset_endpoint(config.replay_endpoint, dp_rank))
    return [e for e in bound if listens_everywhere(e)]
