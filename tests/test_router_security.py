"""Who may manage the router's workers, and which worker gets which key.

A real router process over fake workers: real HTTP servers on loopback that answer like workers
and record every request's Authorization header. The router's admin endpoints take its own
--admin-api-key (never --api-key), and the workers' admin key goes only to the workers the
operator named (--worker-urls, --worker-url-allowlist), never to a URL a client sent.

No test sleeps for a fixed time: each waits for what it needs (polling with generous deadlines),
and what must never happen is checked after events that prove the router had every chance to do it.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Iterator, Optional

import httpx
import pytest

from conftest import ServerProcess
from radixserve.router.access import endpoint_class
from radixserve.router.app import RouterSettings, create_router_app
from radixserve.router.trust import WorkerAllowlist, WorkerTrust
from radixserve.router.workers import normalize_url

# The probe's keys: clients hold `userkey`; `adminkey` is the workers' admin key.
USER_KEY = "userkey"
WORKERS_ADMIN_KEY = "adminkey"
ROUTER_ADMIN_KEY = "router-admin-secret"
DEADLINE_S = 90.0
CREDENTIALS = {"none": None, "user": USER_KEY, "admin": ROUTER_ADMIN_KEY}


# ============================================================================ fake workers
class FakeWorker:
    """A worker's HTTP surface on a loopback port, recording (method, path, Authorization)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, Optional[str]]] = []
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, method: str) -> None:
                length = int(self.headers.get("content-length") or 0)
                if length:
                    self.rfile.read(length)
                with fake._lock:
                    fake.requests.append((method, self.path, self.headers.get("authorization")))
                status, content_type, body = fake.answer(method, self.path)
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._answer("GET")

            def do_POST(self) -> None:
                self._answer("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name=f"fake-worker-{self.url}", daemon=True)
        self._thread.start()

    @staticmethod
    def answer(method: str, path: str) -> tuple[int, str, bytes]:
        as_json = "application/json"
        if path == "/kv_events":  # a snapshot of an empty cache; the stream then ends (the router reconnects)
            snapshot = json.dumps({"block_size": 16, "blocks": [], "seq": 0})
            return 200, "text/event-stream", f"event: snapshot\ndata: {snapshot}\n\n".encode()
        bodies = {
            ("GET", "/health"): {"status": "ok"},
            ("POST", "/flush_cache"): {"status": "ok"},
            ("GET", "/v1/models"): {"object": "list", "data": [{"id": "fake", "object": "model"}]},
            ("GET", "/get_model_info"): {"model_path": "fake"},
            ("GET", "/server_info"): {"pool_size": 64, "in_flight_requests": 0},
            ("POST", "/generate"): {"text": "ok", "meta_info": {}},
            ("POST", "/v1/completions"): {"object": "text_completion", "choices": [{"index": 0, "text": "ok"}]},
            ("POST", "/v1/chat/completions"): {"object": "chat.completion", "choices": [{"index": 0}]},
            ("POST", "/v1/tokenize"): {"tokens": [1], "count": 1},
            ("POST", "/tokenize"): {"tokens": [1], "count": 1},
            ("POST", "/v1/detokenize"): {"prompt": "x"},
            ("POST", "/detokenize"): {"text": "x"},
        }
        if (method, path) in bodies:
            return 200, as_json, json.dumps(bodies[(method, path)]).encode()
        # /tokenizer among them: a worker serving token ids only (the kv_aware router is then ready)
        return 404, as_json, json.dumps({"error": {"message": "not found", "code": "not_found"}}).encode()

    def seen(self) -> list[tuple[str, str, Optional[str]]]:
        with self._lock:
            return list(self.requests)

    def count(self, path: str, authorization: Optional[str] = None) -> int:
        return sum(1 for _, p, a in self.seen() if p == path and (authorization is None or a == authorization))

    def authorizations(self) -> set[Optional[str]]:
        return {a for _, _, a in self.seen()}

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_workers() -> Iterator[Callable[[], FakeWorker]]:
    started: list[FakeWorker] = []

    def start() -> FakeWorker:
        started.append(FakeWorker())
        return started[-1]

    try:
        yield start
    finally:
        for w in started:
            w.stop()


@pytest.fixture
def routers(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    started: list[ServerProcess] = []

    def start(urls: list[str], *extra: str) -> ServerProcess:
        proc = ServerProcess(["--worker-urls", *urls, "--policy", "kv_aware", "--api-key", USER_KEY,
                              "--worker-admin-api-key", WORKERS_ADMIN_KEY, "--health-check-interval", "0.2",
                              *extra], tmp_path, module="radixserve.launch_router", api_key=USER_KEY)
        started.append(proc)
        return proc.wait_ready(120)

    try:
        yield start
    finally:
        for p in started:
            p.stop()


def bearer(key: Optional[str]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def wait_for(condition: Callable[[], bool], what: str, router: Optional[ServerProcess] = None) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}" + (f"\n{router.output()[-3000:]}" if router else ""))
        time.sleep(0.05)


def workers_of(router: ServerProcess) -> dict[str, dict]:
    answer = httpx.get(router.base_url + "/workers", headers=bearer(ROUTER_ADMIN_KEY), timeout=10)
    assert answer.status_code == 200, answer.text
    return {w["url"]: w for w in answer.json()["workers"]}


def workers_of_user(router: ServerProcess) -> dict[str, dict]:
    answer = httpx.get(router.base_url + "/workers", headers=bearer(USER_KEY), timeout=10)
    assert answer.status_code == 200, answer.text
    return {w["url"]: w for w in answer.json()["workers"]}


def kv_resyncs(router: ServerProcess, worker_id: str) -> float:
    """Snapshots of the worker's cache the router has applied (its kv_resyncs counter)."""
    text = httpx.get(router.base_url + "/metrics", headers=bearer(ROUTER_ADMIN_KEY), timeout=10).text
    prefix = f'radixserve:router_kv_resyncs_total{{worker="{worker_id}"}} '
    return sum(float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix))


def assert_keys_went_only_where_they_belong(worker: FakeWorker, gets_workers_admin_key: bool) -> None:
    """The router's admin key reaches no worker; the workers' admin key reaches only the trusted
    ones, and only on the router's own admin calls."""
    for method, path, authorization in worker.seen():
        assert authorization in (None, f"Bearer {USER_KEY}", f"Bearer {WORKERS_ADMIN_KEY}"), (method, path)
        if authorization == f"Bearer {WORKERS_ADMIN_KEY}":
            assert gets_workers_admin_key, f"{worker.url} got the workers' admin key on {method} {path}"
            assert path in ("/kv_events", "/flush_cache"), (method, path)


# ============================================================================ in-process
def test_worker_url_allowlist_entries_and_matching():
    allow = WorkerAllowlist.parse(["http://10.0.0.5:30000/", "worker-3.Internal", "10.1.0.0/16", "192.168.0.7",
                                   "fd00::/8"])
    assert allow.allows("http://10.0.0.5:30000") and not allow.allows("http://10.0.0.5:30001")
    assert allow.allows("http://worker-3.internal:1") and allow.allows("https://worker-3.internal")
    assert not allow.allows("http://worker-3.internal.attacker.example:1")
    assert allow.allows("http://10.1.200.3:8000") and not allow.allows("http://10.2.0.1:8000")
    assert allow.allows("http://192.168.0.7:1") and not allow.allows("http://192.168.0.8:1")
    assert allow.allows("http://[fd00::1]:30000") and not allow.allows("http://[fe80::1]:30000")
    # A name is never resolved to check it against a block: what it resolves to may change.
    assert not WorkerAllowlist.parse(["127.0.0.0/8"]).allows("http://localhost:30000")
    assert not WorkerAllowlist.parse([]) and not WorkerAllowlist.parse([]).allows("http://10.0.0.5:1")
    for bad in ("10.0.0.5/24", "*.internal", "http://", "not a host", "10.0.0.0/33", ""):
        with pytest.raises(ValueError):
            WorkerAllowlist.parse([bad])
    trust = WorkerTrust.from_settings(["http://10.0.0.9:1/"], ["10.1.0.0/16"])
    assert trust.trusts("http://10.0.0.9:1") and trust.trusts("http://10.1.0.1:1")
    assert not trust.trusts("http://10.0.0.9:2") and not trust.trusts("http://attacker:1")


def test_worker_urls_carry_no_credentials():
    for bad in ("http://user:pass@10.0.0.5:1", "http://user@10.0.0.5:1", "http://:pw@h:1"):
        with pytest.raises(ValueError, match="password"):
            normalize_url(bad)


def test_router_settings_refuse_the_user_key_as_admin_key():
    from radixserve.launch_router import settings_from_argv

    with pytest.raises(ValueError, match="must differ"):
        RouterSettings(api_key="k", admin_api_key="k").validate()
    with pytest.raises(SystemExit):
        settings_from_argv(["--api-key", "k", "--admin-api-key", "k"])
    with pytest.raises(SystemExit):
        settings_from_argv(["--worker-url-allowlist", "10.0.0.5/24"])
    s = settings_from_argv(["--admin-api-key", "a", "--worker-url-allowlist", "10.0.0.0/24", "http://h:1"])
    assert s.admin_api_key == "a" and s.worker_url_allowlist == ("10.0.0.0/24", "http://h:1")


# Every route of the router and the key it takes: (method, path) -> expected status with no key,
# the user key and the router's admin key (a router with both keys, over one fake worker).
# "fwd": forwarded to a worker or answered from its reply; the admin key is refused there.
ENDPOINTS: dict[tuple[str, str], tuple[str, tuple[int, int, int]]] = {
    ("GET", "/health"): ("open", (200, 200, 200)),
    ("POST", "/generate"): ("forwarded", (401, 200, 401)),
    ("POST", "/v1/completions"): ("forwarded", (401, 200, 401)),
    ("POST", "/v1/chat/completions"): ("forwarded", (401, 200, 401)),
    ("POST", "/v1/tokenize"): ("forwarded", (401, 200, 401)),
    ("POST", "/v1/detokenize"): ("forwarded", (401, 200, 401)),
    ("POST", "/tokenize"): ("forwarded", (401, 200, 401)),
    ("POST", "/detokenize"): ("forwarded", (401, 200, 401)),
    ("GET", "/v1/models"): ("forwarded", (401, 200, 401)),
    ("GET", "/get_model_info"): ("forwarded", (401, 200, 401)),
    ("GET", "/server_info"): ("forwarded", (401, 200, 401)),
    ("GET", "/tokenizer"): ("forwarded", (401, 404, 401)),  # the fake worker's own 404 comes back
    ("GET", "/openapi.json"): ("forwarded", (401, 200, 401)),
    ("GET", "/docs"): ("forwarded", (401, 200, 401)),
    ("GET", "/docs/oauth2-redirect"): ("forwarded", (401, 200, 401)),
    ("GET", "/redoc"): ("forwarded", (401, 200, 401)),
    ("GET", "/metrics"): ("router_read", (401, 200, 200)),
    ("GET", "/workers"): ("router_read", (401, 200, 200)),
    ("POST", "/workers"): ("admin", (401, 401, 201)),
    ("DELETE", "/workers/{worker_id}"): ("admin", (401, 401, 200)),
    ("POST", "/flush_cache"): ("admin", (401, 401, 200)),
}
ADMIN_ROUTES = [route for route, (kind, _) in ENDPOINTS.items() if kind == "admin"]


def test_every_route_has_a_key_class():
    """A route added to the router without a row above fails here, before it can skip a check."""
    app = create_router_app(RouterSettings(worker_urls=("http://127.0.0.1:9",), admin_api_key="a"))
    routes = {(m, r.path) for r in app.routes for m in (getattr(r, "methods", None) or ()) if m != "HEAD"}
    assert routes == set(ENDPOINTS)
    for (method, path), (kind, _) in ENDPOINTS.items():
        assert endpoint_class(method, path.replace("{worker_id}", "worker-0")) == kind, (method, path)
    # Spellings that reach no route are checked as forwarded paths, never let through as admin ones.
    assert endpoint_class("GET", "/workers/") == "admin" and endpoint_class("PUT", "/workers") == "admin"


# ============================================================================ real processes
def _call(router: ServerProcess, method: str, path: str, key: Optional[str], worker_url: str) -> httpx.Response:
    bodies = {"/generate": {"text": "hi"}, "/v1/completions": {"prompt": "hi", "max_tokens": 1},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
              "/v1/tokenize": {"prompt": "hi"}, "/tokenize": {"prompt": "hi"},
              "/v1/detokenize": {"tokens": [1]}, "/detokenize": {"tokens": [1]},
              "/workers": {"url": worker_url}}
    body = bodies.get(path) if method == "POST" else None
    return httpx.request(method, router.base_url + path, json=body, headers=bearer(key), timeout=30)


def test_every_endpoint_with_no_key_the_user_key_and_the_admin_key(fake_workers, routers):
    configured, runtime = fake_workers(), fake_workers()
    router = routers([configured.url], "--admin-api-key", ROUTER_ADMIN_KEY)
    for (method, path), (kind, expected) in ENDPOINTS.items():
        for (who, key), status in zip(CREDENTIALS.items(), expected):
            target = path
            if path == "/workers/{worker_id}":
                # the admin removes what it added (below); the others try the operator's worker
                target = "/workers/worker-1" if who == "admin" else "/workers/worker-0"
            r = _call(router, method, target, key, runtime.url)
            assert r.status_code == status, (method, path, who, r.text)
            if status in (401, 403):
                error = r.json()["error"]
                assert error["message"] and error["type"] == "authentication_error", error
            if kind == "admin" and who == "admin" and method == "POST" and path == "/workers":
                assert r.json()["id"] == "worker-1" and r.json()["trusted"] is False
    assert list(workers_of(router)) == [configured.url]  # only the admin's add and remove took effect
    # The user's key went through to the worker with its requests; the admin's flush reached it.
    assert configured.count("/v1/completions", f"Bearer {USER_KEY}") == 1
    assert configured.count("/flush_cache", f"Bearer {WORKERS_ADMIN_KEY}") == 1
    wait_for(lambda: configured.count("/kv_events", f"Bearer {WORKERS_ADMIN_KEY}") >= 1,
             "the operator's worker is followed with the workers' admin key", router)
    assert_keys_went_only_where_they_belong(configured, gets_workers_admin_key=True)
    assert_keys_went_only_where_they_belong(runtime, gets_workers_admin_key=False)
    # Two Authorization headers: which would a worker read? Neither goes anywhere.
    r = httpx.post(router.base_url + "/v1/completions", json={"prompt": "hi"}, timeout=10,
                   headers=[("Authorization", f"Bearer {USER_KEY}"), ("Authorization", f"Bearer {ROUTER_ADMIN_KEY}")])
    assert r.status_code == 400, r.text
    assert "take --admin-api-key only" in router.output()


def test_admin_endpoints_are_off_without_an_admin_key(fake_workers, routers):
    worker = fake_workers()
    router = routers([worker.url])
    for method, path in ADMIN_ROUTES:
        for who in ("none", "user"):
            r = _call(router, method, path.replace("{worker_id}", "worker-0"), CREDENTIALS[who], "http://127.0.0.1:9")
            assert r.status_code == 403, (method, path, who, r.text)
            error = r.json()["error"]
            assert error["code"] == "admin_api_disabled" and error["type"] == "permission_error"
            assert "--admin-api-key" in error["message"], error
    assert list(workers_of_user(router)) == [worker.url]
    assert worker.count("/flush_cache") == 0
    assert "are off (403) until the router is started with --admin-api-key" in router.output()


def test_the_probe_attack_is_refused_and_an_added_worker_never_gets_the_workers_admin_key(fake_workers, routers):
    """The probe: a client with only the user key added http://attacker, which then got GET /kv_events
    with the workers' admin key; removed worker-0 so every user's request went to the attacker; and
    flushed every worker with the workers' admin key."""
    good, attacker = fake_workers(), fake_workers()
    router = routers([good.url], "--admin-api-key", ROUTER_ADMIN_KEY)
    wait_for(lambda: good.count("/kv_events", f"Bearer {WORKERS_ADMIN_KEY}") >= 1,
             "the operator's worker is followed with the workers' admin key", router)

    user = bearer(USER_KEY)
    with httpx.Client(base_url=router.base_url, timeout=30) as c:
        r = c.post("/workers", json={"url": attacker.url}, headers=user)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_api_key", r.text
        r = c.delete("/workers/worker-0", headers=user)
        assert r.status_code == 401, r.text
        r = c.post("/flush_cache", headers=user)
        assert r.status_code == 401, r.text
        assert list(workers_of(router)) == [good.url]
        assert good.count("/flush_cache") == 0 and attacker.seen() == []

        # The router's admin adds it: it serves users (with their key, as any worker does) but is
        # never followed or flushed with the workers' admin key.
        r = c.post("/workers", json={"url": attacker.url}, headers=bearer(ROUTER_ADMIN_KEY))
        assert r.status_code == 201 and r.json()["trusted"] is False, r.text
        wait_for(lambda: workers_of(router)[attacker.url]["healthy"], "the added worker is healthy", router)
        # The router reconnects to the good worker's /kv_events about once a second: by the time it
        # has done so three more times, it has had every chance to follow the attacker too.
        followed = good.count("/kv_events")
        wait_for(lambda: good.count("/kv_events") >= followed + 3, "the router keeps following the good worker")
        for i in range(6):
            r = c.post("/v1/completions", json={"prompt": f"user prompt {i}", "max_tokens": 1}, headers=user)
            assert r.status_code == 200, r.text
        r = c.post("/flush_cache", headers=bearer(ROUTER_ADMIN_KEY))
        assert r.status_code == 409, r.text
        flushed = r.json()["workers"]
        assert flushed["worker-0"] == 200 and flushed["worker-1"].startswith("skipped"), flushed
        assert not workers_of(router)[attacker.url]["kv_synced"] and kv_resyncs(router, "worker-1") == 0
        assert kv_resyncs(router, "worker-0") >= 3

    assert attacker.count("/kv_events") == 0 and attacker.count("/flush_cache") == 0
    assert attacker.count("/health") >= 1
    assert_keys_went_only_where_they_belong(attacker, gets_workers_admin_key=False)
    assert_keys_went_only_where_they_belong(good, gets_workers_admin_key=True)
    assert good.count("/flush_cache", f"Bearer {WORKERS_ADMIN_KEY}") == 1
    assert "the workers' admin key is withheld from it" in router.output()


def test_allowlisted_and_reconfigured_workers_get_the_workers_admin_key(fake_workers, routers):
    good, allowed, other = fake_workers(), fake_workers(), fake_workers()
    router = routers([good.url], "--admin-api-key", ROUTER_ADMIN_KEY, "--worker-url-allowlist", allowed.url)
    admin = bearer(ROUTER_ADMIN_KEY)
    with httpx.Client(base_url=router.base_url, timeout=30) as c:
        for fake, trusted in ((allowed, True), (other, False)):
            r = c.post("/workers", json={"url": fake.url}, headers=admin)
            assert r.status_code == 201 and r.json()["trusted"] is trusted, r.text
        wait_for(lambda: allowed.count("/kv_events", f"Bearer {WORKERS_ADMIN_KEY}") >= 1,
                 "the allowlisted worker is followed with the workers' admin key", router)
        # The fake's stream ends after its snapshot, so kv_synced is true only for a moment: count the
        # snapshots the router applied instead.
        wait_for(lambda: kv_resyncs(router, "worker-1") >= 1, "the router applies the allowlisted worker's snapshot",
                 router)
        # The operator's own URL, removed and added again, is still the operator's.
        assert c.delete("/workers/worker-0", headers=admin).status_code == 200
        r = c.post("/workers", json={"url": good.url + "/"}, headers=admin)
        assert r.status_code == 201 and r.json()["trusted"] is True, r.text
        wait_for(lambda: workers_of(router)[good.url]["healthy"], "the re-added worker is healthy", router)
        r = c.post("/flush_cache", headers=admin)
        assert r.status_code == 409, r.text
        ids = {url: w["id"] for url, w in workers_of(router).items()}
        by_url = {url: r.json()["workers"][ids[url]] for url in (good.url, allowed.url, other.url)}
        assert by_url[good.url] == 200 and by_url[allowed.url] == 200 and by_url[other.url].startswith("skipped")
    followed = allowed.count("/kv_events")
    wait_for(lambda: allowed.count("/kv_events") >= followed + 2, "the router keeps following the allowlisted worker")
    assert other.count("/kv_events") == 0 and other.count("/flush_cache") == 0
    assert allowed.count("/flush_cache", f"Bearer {WORKERS_ADMIN_KEY}") == 1
    assert_keys_went_only_where_they_belong(allowed, gets_workers_admin_key=True)
    assert_keys_went_only_where_they_belong(other, gets_workers_admin_key=False)
    assert_keys_went_only_where_they_belong(good, gets_workers_admin_key=True)


def test_without_a_workers_admin_key_added_workers_are_followed_with_the_user_key(fake_workers, tmp_path):
    """No key is withheld when the router's admin calls carry --api-key, which every client holds."""
    good, added = fake_workers(), fake_workers()
    router = ServerProcess(["--worker-urls", good.url, "--policy", "kv_aware", "--api-key", USER_KEY,
                            "--admin-api-key", ROUTER_ADMIN_KEY, "--health-check-interval", "0.2"], tmp_path,
                           module="radixserve.launch_router").wait_ready(120)
    try:
        r = httpx.post(router.base_url + "/workers", json={"url": added.url}, headers=bearer(ROUTER_ADMIN_KEY),
                       timeout=30)
        assert r.status_code == 201, r.text
        wait_for(lambda: added.count("/kv_events", f"Bearer {USER_KEY}") >= 1, "the added worker is followed", router)
        assert added.authorizations() <= {None, f"Bearer {USER_KEY}"}
    finally:
        router.stop()


# ============================================================================ redirects
class RedirectingWorker(FakeWorker):
    """Healthy, but answers every other request with a 307 to elsewhere (as the soak's hostile worker does)."""

    @staticmethod
    def answer(method: str, path: str) -> tuple[int, str, bytes]:
        if path in ("/health", "/kv_events"):
            return FakeWorker.answer(method, path)
        return 307, "application/json", json.dumps({"to": "http://elsewhere.invalid"}).encode()


def test_a_workers_redirect_is_a_failure_retried_elsewhere_never_an_answer(routers, fake_workers):
    """Found by the soak: a worker's 3xx reached the client (without its Location). It is now
    retried on another worker, like a 5xx, for proxied and for any-worker endpoints."""
    redirecting = RedirectingWorker()
    try:
        good = fake_workers()
        router = routers([redirecting.url, good.url], "--policy", "round_robin")
        wait_for(lambda: all(w["healthy"] for w in workers_of_user(router).values()), "both workers healthy", router)
        calls = [("POST", "/v1/completions", {"prompt": "x"}), ("POST", "/generate", {"text": "x"}),
                 ("POST", "/v1/tokenize", {"prompt": "x"}), ("GET", "/v1/models", None)]
        for _ in range(3):
            for method, path, body in calls:
                r = httpx.request(method, router.base_url + path, json=body, headers=bearer(USER_KEY), timeout=30)
                assert r.status_code == 200, (path, r.status_code, r.text)
        assert redirecting.count("/v1/completions") + redirecting.count("/generate") >= 1
        assert redirecting.count("/v1/tokenize") >= 1 and redirecting.count("/v1/models") >= 1
    finally:
        redirecting.stop()


class FullWorker(FakeWorker):
    """Healthy, with a full waiting queue: every generation request is a 503 queue_full, as a real worker's."""

    @staticmethod
    def answer(method: str, path: str) -> tuple[int, str, bytes]:
        if method == "POST" and path == "/v1/completions":
            return 503, "application/json", json.dumps({"error": {
                "message": "the waiting queue is full (16 requests beyond what is running); retry later",
                "type": "service_unavailable_error", "param": None, "code": "queue_full"}}).encode()
        return FakeWorker.answer(method, path)


def test_every_worker_full_is_a_queue_full_503_not_no_healthy_worker(routers):
    """Found by the soak: behind the router, a burst over the queue limit read as 'no healthy worker'."""
    full = [FullWorker(), FullWorker()]
    try:
        router = routers([w.url for w in full], "--policy", "round_robin")
        wait_for(lambda: all(w["healthy"] for w in workers_of_user(router).values()), "both workers healthy", router)
        r = httpx.post(router.base_url + "/v1/completions", json={"prompt": "x"}, headers=bearer(USER_KEY), timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", r.text
        assert r.headers.get("retry-after") == "1"
        assert all(w.count("/v1/completions") == 1 for w in full)  # each tried once
        assert all(w["healthy"] for w in workers_of_user(router).values())  # busy is not broken
    finally:
        for w in full:
            w.stop()
