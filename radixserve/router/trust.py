"""Which workers the router sends the workers' admin key (`--worker-admin-api-key`) to.

The router sends that key with its own admin calls to a worker: `GET /kv_events` (kv_aware) and
`POST /flush_cache`. It goes to the workers the operator named at start (`--worker-urls`) and to
workers added at run time (`POST /workers`) whose URL matches `--worker-url-allowlist`; never to
any other URL. Nothing a worker answers can earn it: a health check, or any exchange in which the
router sends the key to see whether the worker accepts it, hands the key to whoever got the URL
added. The allowlist is the operator's decision, made before any URL is known.

Allowlist entries:
- an exact worker URL (`http://10.0.0.5:30000`), compared after normalising;
- a host name (`worker-3.internal`): any port and scheme on that name;
- an IP address or a CIDR block (`10.0.0.0/24`): matched against a URL whose host is an IP
  literal only. A name is never resolved to check it against a block: what the name resolves to
  when the router connects need not be what it resolved to when it was checked.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Iterable, Union
from urllib.parse import urlsplit

from radixserve.router.workers import normalize_url

IPNetwork = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]

_HOST_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_HOST_NAME = re.compile(rf"^{_HOST_LABEL}(?:\.{_HOST_LABEL})*$")


@dataclass(frozen=True)
class WorkerAllowlist:
    urls: frozenset[str] = frozenset()
    hosts: frozenset[str] = frozenset()
    networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> "WorkerAllowlist":
        """ValueError names an entry that is none of a URL, a host name, an IP address or a block."""
        urls: set[str] = set()
        hosts: set[str] = set()
        networks: list[IPNetwork] = []
        for raw in entries:
            entry = raw.strip() if isinstance(raw, str) else ""
            if "://" in entry:
                urls.add(normalize_url(entry))
                continue
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=True))
                continue
            except ValueError as e:
                if "/" in entry:  # a block with host bits set is a typo for a wider or narrower one
                    raise ValueError(f"--worker-url-allowlist entry {raw!r} is not a CIDR block: {e}") from None
            if _HOST_NAME.match(entry.lower()):
                hosts.add(entry.lower())
                continue
            raise ValueError(f"--worker-url-allowlist entry {raw!r} is not a URL (http://host:port), a host "
                             f"name, an IP address or a CIDR block (10.0.0.0/24); wildcards are not supported")
        return cls(frozenset(urls), frozenset(hosts), tuple(networks))

    def __bool__(self) -> bool:
        return bool(self.urls or self.hosts or self.networks)

    def allows(self, url: str) -> bool:
        """Whether a worker at `url` (already normalised) may receive the workers' admin key."""
        if url in self.urls:
            return True
        host = urlsplit(url).hostname  # lower case, IPv6 without its brackets
        if not host:
            return False
        if host in self.hosts:
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False  # a name: never resolved here (see the module's docstring)
        return any(address.version == net.version and address in net for net in self.networks)

    def describe(self) -> str:
        parts = sorted(self.urls) + sorted(self.hosts) + [str(n) for n in self.networks]
        return ", ".join(parts) if parts else "none"


@dataclass(frozen=True)
class WorkerTrust:
    """The operator's workers (`--worker-urls`) and the run-time URLs it allowlisted."""

    configured: frozenset[str]
    allowlist: WorkerAllowlist

    @classmethod
    def from_settings(cls, worker_urls: Iterable[str], allowlist: Iterable[str]) -> "WorkerTrust":
        return cls(frozenset(normalize_url(u) for u in worker_urls), WorkerAllowlist.parse(allowlist))

    def trusts(self, url: str) -> bool:
        """`url` normalised; a configured worker removed and added again is still the operator's URL."""
        return url in self.configured or self.allowlist.allows(url)
