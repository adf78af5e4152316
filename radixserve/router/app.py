"""The router: an HTTP front for many workers that places each request where its prefix is cached.

Generation endpoints (`/generate`, `/v1/completions`, `/v1/chat/completions`) are proxied to
the worker the policy picks. A request is retried on another worker while nothing has been sent
to the client (connection refused or reset, a worker answering 5xx); once a stream has started,
a failing worker ends it with an OpenAI-style error event and `data: [DONE]`. Streams pass
through chunk by chunk, never buffered.

Control: `GET /workers`, `POST /workers {"url": ...}`, `DELETE /workers/{id}`, `GET /health`
(200 while a worker is healthy), `GET /metrics`, `POST /flush_cache` (every worker),
`GET /v1/models`, `GET /tokenizer` (from a healthy worker), `GET /server_info` (a healthy worker's,
with `pool_size` summed over the healthy workers and a `router` entry per worker), so
`bench_serving` runs against a router as against one server.

Keys: which endpoint takes which key is in `access.py` (worker management and `/flush_cache`
take the router's own `--admin-api-key`, never `--api-key`); which workers the router sends the
workers' admin key to is in `trust.py` (those the operator named, never a URL a client sent).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator, Optional

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from radixserve.http_common.api_keys import load_admin_key, load_key_ring
from radixserve.http_common.auth import bearer_token
from radixserve.router.access import RouterAccessMiddleware, access_summary
from radixserve.router.admin_routes import add_admin_routes
from radixserve.router.keys import routing_keys, tokenizer_from_files
from radixserve.router.kv_sync import kv_sync_loop
from radixserve.router.metrics import RouterMetrics
from radixserve.router.openapi import install_router_openapi
from radixserve.router.policies import BalanceConfig, make_policy
from radixserve.router.settings import RouterSettings
from radixserve.router.trust import WorkerTrust
from radixserve.router.workers import Worker, WorkerRegistry, normalize_url
from radixserve.http_common.errors import error_body, error_response, install_error_handlers
from radixserve.process.gc_tuning import governed_collections
from radixserve.process.tokenizer import load_tokenizer
from radixserve.http_common.loop_lag import watch_loop_lag

logger = logging.getLogger("radixserve.router")

GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
# Answered the same by every worker (they serve one model).
TOKENIZE_PATHS = ("/v1/tokenize", "/v1/detokenize", "/tokenize", "/detokenize")
FORWARD_REQUEST_HEADERS = ("authorization", "content-type", "accept", "x-request-id")
FORWARD_RESPONSE_HEADERS = ("content-type", "retry-after", "cache-control", "x-accel-buffering")
WORKER_KEEPALIVE_S = 4.0


def worker_failed(response: httpx.Response) -> bool:
    """A worker's answer the router does not pass on: a 5xx (another worker may answer) or a redirect
    (not followed: it would carry the request elsewhere; not passed on: its Location is dropped)."""
    return response.status_code >= 500 or 300 <= response.status_code < 400


class RetryableError(Exception):
    """The worker failed before anything reached the client."""

    def __init__(self, message: str, queue_full: bool = False):
        super().__init__(message)
        self.queue_full = queue_full  # a healthy worker's queue-full 503, not a failure


class Router:
    def __init__(self, settings: RouterSettings):
        settings.validate()
        self.settings = settings
        self.keys = load_key_ring(settings.api_key, settings.api_key_file)
        if settings.admin_api_key and self.keys.match(settings.admin_api_key.encode()) is not None:
            raise ValueError("--admin-api-key must differ from every --api-key: every client holds an API key, "
                             "and the admin key decides where their requests go")
        self.worker_admin_key = load_admin_key(settings.worker_admin_api_key, settings.worker_admin_api_key_file,
                                               "--worker-admin-api-key")
        # Whether the workers give each key its own cache, so the prefix keys must be per key too.
        self.isolate_keys = self.keys.isolates_cache(settings.cache_salt_per_api_key,
                                                     settings.shared_cache_across_keys)
        self.registry = WorkerRegistry(settings.max_tree_size)
        self.policy = make_policy(settings.policy, BalanceConfig(
            settings.cache_threshold, settings.balance_abs_threshold, settings.balance_rel_threshold), settings.seed)
        self.metrics = RouterMetrics(self.registry)
        self.client: Optional[httpx.AsyncClient] = None
        self.tokenizer = None
        self.tokenizer_state = "not needed" if settings.policy != "kv_aware" else "loading"
        self._tokens = itertools.count()
        self._health_task: Optional[asyncio.Task] = None
        self._tokenizer_task: Optional[asyncio.Task] = None
        self.trust = WorkerTrust.from_settings(settings.worker_urls, settings.worker_url_allowlist)
        for url in settings.worker_urls:
            self.registry.add(url, trusted=True)

    # ------------------------------------------------------------------ lifecycle
    @property
    def connect_timeout(self) -> float:
        return self.settings.connect_timeout

    @property
    def worker_headers(self) -> dict[str, str]:
        key = self.keys.first_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    @property
    def worker_admin_headers(self) -> dict[str, str]:
        key = self.worker_admin_key
        return {"Authorization": f"Bearer {key}"} if key else self.worker_headers

    @property
    def policy_name(self) -> str:
        return self.policy.name

    @property
    def admin_api_key(self) -> Optional[str]:
        return self.settings.admin_api_key

    @property
    def withholds_worker_admin_key(self) -> bool:
        """A workers' admin key of its own is set: it goes to trusted workers only. (Without one the
        router's admin calls carry --api-key, which every client holds and sends to any worker.)"""
        key = self.worker_admin_key
        return bool(key) and self.keys.match(key.encode()) is None

    def admin_headers_for(self, worker: Worker) -> Optional[dict[str, str]]:
        """Headers of the router's own admin calls to `worker` (/kv_events, /flush_cache); None where
        the workers' admin key is withheld from it (added at run time, not allowlisted: trust.py)."""
        if worker.trusted or not self.withholds_worker_admin_key:
            return self.worker_admin_headers
        return None

    async def start(self) -> None:
        timeout = httpx.Timeout(self.settings.request_timeout, connect=self.settings.connect_timeout)
        # Idle connections to workers expire before the workers' keep-alive (uvicorn: 5 s) closes them,
        # so a request never goes out on a connection being closed (a ReadError and a needless retry
        # on another worker, typically right after a health check 5 s earlier).
        # Redirects are never followed: a worker's 3xx must not carry a key to another address.
        self.client = httpx.AsyncClient(timeout=timeout, follow_redirects=False, limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=256, keepalive_expiry=WORKER_KEEPALIVE_S))
        logger.info("%s", access_summary(bool(self.keys), self.settings.admin_api_key))
        if self.withholds_worker_admin_key:
            logger.info("router: the workers' admin key goes to the %d worker(s) of --worker-urls and to run-time "
                        "workers matching --worker-url-allowlist (%s) only", len(self.trust.configured),
                        self.trust.allowlist.describe())
        await self.check_all()
        for worker in self.registry:
            self._start_worker_tasks(worker)
        self._health_task = asyncio.create_task(self._health_loop(), name="router-health")
        if self.settings.policy == "kv_aware":
            self._tokenizer_task = asyncio.create_task(self._load_tokenizer(), name="router-tokenizer")

    async def stop(self) -> None:
        tasks = [t for t in (self._health_task, self._tokenizer_task) if t is not None]
        tasks += [w.kv_task for w in self.registry if w.kv_task is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        if self.client is not None:
            await self.client.aclose()

    def _start_worker_tasks(self, worker: Worker) -> None:
        if self.settings.policy != "kv_aware" or worker.kv_task is not None:
            return
        headers = self.admin_headers_for(worker)
        if headers is None:
            logger.warning("router: worker %s (%s) was added at run time and matches no --worker-url-allowlist "
                           "entry: the workers' admin key is withheld from it, so kv_aware does not follow its "
                           "/kv_events (it is routed on the prompts in flight there)", worker.id, worker.url)
            return
        worker.kv_task = asyncio.create_task(kv_sync_loop(self, worker, headers), name=f"kv-sync-{worker.id}")

    async def _load_tokenizer(self) -> None:
        if self.settings.tokenizer_path:
            self.tokenizer = await asyncio.to_thread(load_tokenizer, self.settings.tokenizer_path, True)
            self.tokenizer_state = "loaded"
            return
        while True:
            # The operator's workers first: a run-time worker's tokenizer is only as good as its owner.
            for worker in sorted(self.registry.healthy(), key=lambda w: not w.trusted):
                try:
                    r = await self.client.get(worker.url + "/tokenizer", headers=self.worker_headers, timeout=30.0)
                except httpx.HTTPError:
                    continue
                if r.status_code == 404:
                    self.tokenizer_state = "none (workers serve token ids only)"
                    return
                if r.status_code == 200:
                    try:
                        self.tokenizer = await asyncio.to_thread(tokenizer_from_files, r.json()["files"])
                        self.tokenizer_state = "loaded"
                        logger.info("router: tokenizer loaded from %s", worker.url)
                        return
                    except Exception as e:
                        logger.warning("router: tokenizer from %s unusable: %s", worker.url, e)
            await asyncio.sleep(1.0)

    @property
    def ready(self) -> bool:
        return self.tokenizer_state != "loading"

    # ------------------------------------------------------------------ workers
    def add_worker(self, url: object) -> Worker:
        """A worker added at run time (POST /workers): trusted only where the operator allowlisted it."""
        worker = self.registry.add(url, trusted=self.trust.trusts(normalize_url(url)))
        if not self.withholds_worker_admin_key:
            trust = "no --worker-admin-api-key of its own: the router's admin calls carry --api-key"
        elif worker.trusted:
            trust = "allowlisted: trusted with the workers' admin key"
        else:
            trust = "the workers' admin key is withheld from it"
        logger.info("router: worker %s added at %s (%s)", worker.id, worker.url, trust)
        if self.client is not None:
            self._start_worker_tasks(worker)
            asyncio.ensure_future(self.check(worker))
        return worker

    async def flush_workers(self) -> tuple[dict[str, object], bool]:
        """POST /flush_cache to each worker with its admin headers; a worker the workers' admin key is
        withheld from is skipped (and said so). Returns (per-worker result, all flushed)."""
        results: dict[str, object] = {}
        for worker in self.registry:
            headers = self.admin_headers_for(worker)
            if headers is None:
                results[worker.id] = ("skipped: added at run time and not in --worker-url-allowlist, so the "
                                      "router does not send it the workers' admin key")
                continue
            worker.tree.clear()
            try:
                r = await self.client.post(worker.url + "/flush_cache", headers=headers, timeout=30.0)
                results[worker.id] = r.status_code
            except httpx.HTTPError as e:
                results[worker.id] = f"{type(e).__name__}"
        return results, all(v == 200 for v in results.values())

    def remove_worker(self, worker_id: str) -> Worker:
        worker = self.registry.remove(worker_id)
        if worker.kv_task is not None:
            worker.kv_task.cancel()
        self.metrics.forget(worker)
        logger.info("router: worker %s (%s) removed", worker.id, worker.url)
        return worker

    # ------------------------------------------------------------------ health
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_check_interval)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.registry), return_exceptions=True)

    async def check(self, worker: Worker) -> None:
        try:
            r = await self.client.get(worker.url + "/health", timeout=self.settings.health_check_timeout)
            ok = r.status_code == 200
            error = None if ok else f"/health answered {r.status_code}"
        except httpx.HTTPError as e:
            ok, error = False, f"{type(e).__name__}: {e}"
        if worker.id not in self.registry.workers:
            return
        if ok:
            self.record_success(worker)
        else:
            self.record_failure(worker, error or "unhealthy")

    def record_success(self, worker: Worker) -> None:
        worker.consecutive_failures = 0
        worker.consecutive_successes += 1
        # A worker that was never in rotation joins on its first success (it is starting up).
        first = not worker.ever_healthy
        worker.ever_checked = True
        if not worker.healthy and (first or worker.consecutive_successes >= self.settings.health_success_threshold):
            self._set_health(worker, True, "health checks pass")

    def record_failure(self, worker: Worker, error: str, definitive: bool = False) -> None:
        worker.consecutive_successes = 0
        worker.consecutive_failures += 1
        worker.last_error = error
        worker.ever_checked = True
        if worker.healthy and (definitive or worker.consecutive_failures >= self.settings.health_failure_threshold):
            self._set_health(worker, False, error)

    def _set_health(self, worker: Worker, healthy: bool, why: str) -> None:
        worker.healthy = healthy
        worker.ever_healthy = worker.ever_healthy or healthy
        self.metrics.health_transitions.labels(worker=worker.id, to="healthy" if healthy else "unhealthy").inc()
        log = logger.info if healthy else logger.warning
        log("router: worker %s (%s) is %s: %s", worker.id, worker.url, "healthy" if healthy else "unhealthy", why)

    # ------------------------------------------------------------------ proxying
    @staticmethod
    def request_key(request: Request) -> Optional[str]:
        """The bearer token a request was sent with, as the workers read it (their cache namespace)."""
        token = bearer_token(request.headers.get("authorization", "").encode("latin-1", "replace"))
        return token.decode("latin-1") if token else None

    async def proxy(self, path: str, request: Request):
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        stream = isinstance(body, dict) and bool(body.get("stream"))
        api_key = self.request_key(request) if self.isolate_keys else None
        if self.settings.policy == "kv_aware" and self.tokenizer is not None:
            # Tokenizing a 3k-token prompt takes ~10 ms, most of it without the GIL: in a thread,
            # so the event loop goes on streaming every other response meanwhile.
            keys = await asyncio.to_thread(routing_keys, path, body, self.tokenizer, True, api_key)
        else:
            keys = routing_keys(path, body, self.tokenizer, self.settings.policy == "kv_aware", api_key)
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARD_REQUEST_HEADERS}
        if self.keys and "authorization" not in {k.lower() for k in headers}:
            headers.update(self.worker_headers)
        tried: set[str] = set()
        last_error = "no worker is registered"
        queue_full = False
        for attempt in range(self.settings.max_retries + 1):
            candidates = [w for w in self.registry.healthy() if w.id not in tried]
            if not candidates:
                break
            worker, decision = self.policy.choose(candidates, keys)
            tried.add(worker.id)
            self.metrics.decisions.labels(policy=self.policy.name, decision=decision).inc()
            if attempt:
                self.metrics.retries.inc()
            token = next(self._tokens)
            worker.start_request(token, self.policy.key_of(keys))
            self.metrics.requests.labels(worker=worker.id).inc()
            released = False

            def release(w=worker, t=token) -> None:
                nonlocal released
                if not released:
                    released = True
                    w.end_request(t)

            try:
                return await self._forward(worker, path, raw, headers, stream, release)
            except RetryableError as e:
                release()
                last_error = str(e)
                queue_full = queue_full or e.queue_full
                logger.warning("router: %s on %s failed before any byte was sent (%s); retrying elsewhere",
                               path, worker.id, e)
            except BaseException:
                release()
                raise
        if queue_full:
            # The cluster is busy, not broken: say so as a worker would (clients back off on queue_full).
            self.metrics.errors.labels(kind="queue_full").inc()
            return error_response(503, "every worker tried has a full waiting queue; retry later",
                                  code="queue_full", headers={"Retry-After": "1"})
        if not self.registry.healthy():
            last_error = "no healthy worker" + (f" ({last_error})" if tried else "")
        self.metrics.errors.labels(kind="no_worker").inc()
        return error_response(503, f"no worker could serve the request: {last_error}", code="no_healthy_worker",
                              headers={"Retry-After": "1"})

    async def _forward(self, worker: Worker, path: str, raw: bytes, headers: dict, stream: bool, release):
        req = self.client.build_request("POST", worker.url + path, content=raw, headers=headers)
        try:
            resp = await self.client.send(req, stream=True)
        except httpx.ConnectError as e:
            self.record_failure(worker, f"connect failed: {e}", definitive=True)
            raise RetryableError(f"connect failed: {e}") from None
        except httpx.HTTPError as e:
            self.record_failure(worker, f"{type(e).__name__}: {e}")
            raise RetryableError(f"{type(e).__name__}: {e}") from None
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() in FORWARD_RESPONSE_HEADERS}
        if 300 <= resp.status_code < 400:
            # A worker's redirect is never followed (it would carry the client's key and body elsewhere)
            # and never passed on (a 3xx without its Location means nothing to the client): a failure.
            await resp.aclose()
            self.record_failure(worker, f"answered {resp.status_code} (a redirect)")
            raise RetryableError(f"worker answered {resp.status_code}, a redirect")
        if resp.status_code >= 500:
            try:
                detail = (await resp.aread()).decode(errors="replace")[:300]
            except httpx.HTTPError:
                detail = ""
            await resp.aclose()
            if resp.status_code == 503 and "queue is full" not in detail:
                self.record_failure(worker, f"answered {resp.status_code}")
            raise RetryableError(f"worker answered {resp.status_code}: {detail}",
                                 queue_full=resp.status_code == 503 and "queue is full" in detail)
        is_sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        if not (stream and is_sse):
            try:
                content = await resp.aread()
            except httpx.HTTPError as e:
                self.record_failure(worker, f"{type(e).__name__}: {e}")
                raise RetryableError(f"{type(e).__name__} while reading the answer") from None
            finally:
                await resp.aclose()
            release()
            return Response(content, status_code=resp.status_code, headers=out_headers)

        async def passthrough() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:
                self.record_failure(worker, f"stream broke: {type(e).__name__}")
                self.metrics.errors.labels(kind="stream_broken").inc()
                logger.warning("router: stream from %s broke: %s", worker.id, e)
                err = error_body(503, f"the worker {worker.id} failed while streaming: {type(e).__name__}",
                                 code="worker_failed")
                yield f"\n\ndata: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
            finally:
                await resp.aclose()
                release()

        return StreamingResponse(passthrough(), status_code=resp.status_code, headers=out_headers)

    async def any_worker_get(self, path: str) -> Response:
        for worker in self.registry.healthy():
            try:
                r = await self.client.get(worker.url + path, headers=self.worker_headers, timeout=30.0)
            except httpx.HTTPError:
                continue
            if worker_failed(r):
                continue
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        return error_response(503, "no healthy worker could answer", code="no_healthy_worker")

    async def any_worker_post(self, path: str, request: Request) -> Response:
        """A stateless POST (tokenizing) answered by the first healthy worker that answers."""
        body = await request.body()
        headers = {**self.worker_headers, "content-type": request.headers.get("content-type", "application/json")}
        for worker in self.registry.healthy():
            try:
                r = await self.client.post(worker.url + path, content=body, headers=headers, timeout=30.0)
            except httpx.HTTPError:
                continue
            if worker_failed(r):
                continue
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        return error_response(503, "no healthy worker could answer", code="no_healthy_worker")

    async def cluster_info(self) -> Response:
        """A healthy worker's /server_info with the pool summed over the healthy workers.

        Clients that size things by the server's KV pool (bench_serving's capacity oracle) then see
        what the cluster holds; `router` lists the policy and each worker's own figures.
        """
        healthy = self.registry.healthy()

        async def one(worker: Worker) -> Optional[dict]:
            try:
                r = await self.client.get(worker.url + "/server_info", headers=self.worker_headers, timeout=30.0)
                return r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return None

        infos = await asyncio.gather(*(one(w) for w in healthy))
        answered = [(w, i) for w, i in zip(healthy, infos) if isinstance(i, dict)]
        if not answered:
            return error_response(503, "no healthy worker", code="no_healthy_worker")
        info = dict(answered[0][1])
        pools = [i.get("pool_size") for _, i in answered]
        info["pool_size"] = sum(pools) if all(isinstance(p, int) for p in pools) else None
        info["router"] = {"policy": self.policy.name, "workers": [
            {"id": w.id, "url": w.url, "pool_size": i.get("pool_size"), "in_flight_requests":
             i.get("in_flight_requests")} for w, i in answered]}
        return JSONResponse(info)


def create_router_app(settings: RouterSettings) -> FastAPI:
    router = Router(settings)
    if router.keys:  # labels and counts only, never a key
        logger.info("API keys: %s", router.keys.describe(router.isolate_keys))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            # Each proxied stream holds coroutines and buffers: full collections wait for a quiet moment.
            async with governed_collections("router", lambda: not any(w.load for w in router.registry)), \
                    watch_loop_lag("router"):
                yield
        finally:
            await router.stop()

    app = FastAPI(title="radixserve router", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(RouterAccessMiddleware, keys=router.keys, admin_api_key=settings.admin_api_key)
    app.state.router = router

    # One closure per path (not a default argument: FastAPI would publish it as a query parameter).
    def proxied(path: str):
        async def endpoint(request: Request):
            return await router.proxy(path, request)
        return endpoint

    def tokenizing(path: str):
        async def endpoint(request: Request):
            return await router.any_worker_post(path, request)
        return endpoint

    for path in GENERATION_PATHS:
        app.add_api_route(path, proxied(path), methods=["POST"])

    @app.get("/health")
    async def health():
        healthy = router.registry.healthy()
        if not healthy:
            return error_response(503, "no healthy worker", code="no_healthy_worker")
        if not router.ready:
            return error_response(503, "the router is loading the tokenizer", code="router_starting")
        return {"status": "ok", "healthy_workers": len(healthy), "workers": len(router.registry)}

    add_admin_routes(app, router)

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return await router.any_worker_get("/v1/models")

    @app.get("/get_model_info")
    async def model_info():
        return await router.any_worker_get("/get_model_info")

    @app.get("/tokenizer")
    async def tokenizer_files():
        return await router.any_worker_get("/tokenizer")

    for path in TOKENIZE_PATHS:
        app.add_api_route(path, tokenizing(path), methods=["POST"])

    @app.get("/server_info")
    async def server_info():
        return await router.cluster_info()

    install_router_openapi(app, auth=bool(router.keys))
    return app
