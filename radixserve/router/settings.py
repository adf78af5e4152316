"""The router's settings, one typed dataclass; `launch_router`'s command line and --help are
generated from it as the server's are from `ServerSettings` (`radixserve.settings.option`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from radixserve.router.policies import POLICIES
from radixserve.router.trust import WorkerAllowlist
from radixserve.settings import option

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass
class RouterSettings:
    worker_urls: tuple[str, ...] = option(
        (), "Workers at start, the operator's: they get --worker-admin-api-key (more can be added with POST "
        "/workers and --admin-api-key).", metavar="URL", show_default=False)
    policy: str = option("cache_aware", "Routing policy", choices=POLICIES)
    host: str = option("127.0.0.1", "Address to bind")
    port: int = option(30000, "Port")
    # The keys clients may send (the workers'), with those of api_key_file.
    api_key: tuple[str, ...] = option(
        (), "The workers' API key: the router requires it from clients (except /health and its admin "
        "endpoints), passes the client's Authorization header through, and uses the first for its own calls "
        "to workers. Repeat it for each of the workers' keys; or --api-key-file. It never manages workers or "
        "flushes caches.", show_default=False, repeat=True)
    api_key_file: Optional[str] = option(
        None, "The workers' --api-key-file (one key a line, KEY or KEY NAME), read the same way.",
        show_default=False)
    # The router's own key for worker management and /flush_cache (access.py); None: those are off.
    admin_api_key: Optional[str] = option(
        None, "The router's own admin key, other than --api-key: POST /workers, DELETE /workers/{id} and POST "
        "/flush_cache take it and only it; GET /workers and /metrics take it beside --api-key; every other "
        "endpoint refuses it, so it never reaches a worker. Without it those admin endpoints are off (403, "
        "said at start-up); not loopback-only, since a proxy on this host connects from loopback for any "
        "client.", metavar="KEY", show_default=False)
    # The workers isolate each API key's cache (their --cache-salt-per-api-key, or their default with
    # several keys unless shared_cache_across_keys): so do the prefix keys.
    cache_salt_per_api_key: bool = option(
        False, "The workers run with --cache-salt-per-api-key: prefixes are matched within each API key's "
        "requests only, as the workers cache them. The default with more than one key.")
    shared_cache_across_keys: bool = option(
        False, "The workers run with --shared-cache-across-keys: with several keys, prefixes are matched "
        "across all of them.")
    # Sent only to the workers of worker_urls and run-time workers matching worker_url_allowlist (trust.py).
    worker_admin_api_key: Optional[str] = option(
        None, "The workers' --admin-api-key, which kv_aware needs to follow their /kv_events and POST "
        "/flush_cache to flush them (default: the first of the keys). Sent only to the workers of "
        "--worker-urls and to run-time workers matching --worker-url-allowlist, never to a URL a client sent: "
        "other run-time workers are not followed (kv_aware routes them on the prompts in flight there) and "
        "/flush_cache skips them.", show_default=False)
    worker_admin_api_key_file: Optional[str] = option(
        None, "A file holding --worker-admin-api-key (one line), which keeps it off the command line.",
        show_default=False)
    worker_url_allowlist: tuple[str, ...] = option(
        (), "Workers added at run time (POST /workers) that get --worker-admin-api-key: exact URLs "
        "(http://10.0.0.5:30000), host names (any port), IP addresses or CIDR blocks (10.0.0.0/24; matched "
        "against URLs whose host is an IP literal, never by resolving a name). Default: none.",
        metavar="ENTRY", show_default=False)
    cache_threshold: float = option(
        0.3, "Route to the best-matching worker when its match covers at least this fraction of the prompt, "
        "else to the least-loaded one")
    balance_abs_threshold: int = option(64, "Balance first when max load - min load exceeds this ...")
    balance_rel_threshold: float = option(1.5, "... and max load > min load x this")
    max_tree_size: int = option(
        2 ** 24, "Symbols per worker's approximate tree; least-recently-used leaves are trimmed")
    health_check_interval: float = option(5.0, "Seconds between health checks of each worker")
    health_check_timeout: float = option(10.0, "Seconds a health check may take")
    health_failure_threshold: int = option(3, "Consecutive failures that take a worker out of rotation")
    health_success_threshold: int = option(2, "Consecutive successes that bring it back")
    max_retries: int = option(3, "Other workers tried when one fails before any byte is sent")
    connect_timeout: float = option(5.0, "Seconds to connect to a worker.", cli=False)
    request_timeout: Optional[float] = option(
        None, "Seconds a worker may take to answer a request (None: as long as it takes).", cli=False)
    tokenizer_path: Optional[str] = option(
        None, "Tokenizer for kv_aware (default: fetched from a worker's /tokenizer).")
    log_level: str = option("info", "Logging level", choices=LOG_LEVELS)
    seed: Optional[int] = option(None, "Seed for the random and power_of_two policies.", show_default=False)
    # Client connections held at once (None: the open-file limit less a reserve); see http_common.open_files.
    max_connections: Optional[int] = option(
        None, "Most client connections held at once; one more is answered 503 as it opens. A request's "
        "headers must arrive within 10 s and its body within 60 s. The router raises its soft open-file "
        "limit to the hard one (up to 65,536). Default: that limit less 256.", show_default=False)

    def validate(self) -> None:
        if isinstance(self.api_key, str):  # one key, as callers wrote it before keys could repeat
            self.api_key = (self.api_key,)
        if self.cache_salt_per_api_key and self.shared_cache_across_keys:
            raise ValueError("cache_salt_per_api_key and shared_cache_across_keys contradict each other: give one")
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} is not one of {', '.join(POLICIES)}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        if self.max_tree_size < 1:
            raise ValueError(f"max_tree_size must be >= 1, got {self.max_tree_size}")
        if self.health_check_interval <= 0 or self.health_check_timeout <= 0:
            raise ValueError("health check interval and timeout must be > 0")
        if self.health_failure_threshold < 1 or self.health_success_threshold < 1:
            raise ValueError("health thresholds must be >= 1")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.admin_api_key is not None and not self.admin_api_key.strip():
            raise ValueError("admin_api_key must not be empty")
        if self.admin_api_key and self.admin_api_key in self.api_key:
            raise ValueError("--admin-api-key must differ from --api-key: every client holds the API key, and "
                             "the admin key decides where their requests go")
        WorkerAllowlist.parse(self.worker_url_allowlist)
