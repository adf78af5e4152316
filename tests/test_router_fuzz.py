"""schemathesis against a real router in front of one real tiny CPU worker.

The router publishes its own OpenAPI schema (router/openapi.py); every operation of it is fuzzed
with schemathesis' default checks, bar positive data acceptance: the router describes the bodies it
forwards as free JSON objects and the worker refuses most of them with a 400, as it should. No
fuzzed case may answer a 5xx the schema does not document (the router's is 503, no worker could
serve), and the worker serves afterwards. Derandomized, few examples: about a minute on two cores.
"""

from __future__ import annotations

import json
from typing import Iterator

import httpx
import pytest

from conftest import ServerProcess

pytestmark = pytest.mark.timeout(600)

USER_KEY = "fuzz-user-key"
ROUTER_ADMIN_KEY = "fuzz-router-admin-key"
# Admin operations last: POST /workers and DELETE /workers/{id} change what the others reach.
OPERATIONS = [
    ("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/generate", "POST"),
    ("/v1/tokenize", "POST"), ("/v1/detokenize", "POST"), ("/tokenize", "POST"), ("/detokenize", "POST"),
    ("/health", "GET"), ("/workers", "GET"), ("/metrics", "GET"), ("/v1/models", "GET"),
    ("/get_model_info", "GET"), ("/tokenizer", "GET"), ("/server_info", "GET"),
    ("/flush_cache", "POST"), ("/workers", "POST"), ("/workers/{worker_id}", "DELETE"),
]
ADMIN_OPERATIONS = {("/flush_cache", "POST"), ("/workers", "POST"), ("/workers/{worker_id}", "DELETE")}


@pytest.fixture(scope="module")
def fuzzed_cluster(server_model_dir, server_workdir) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """(router, worker): a context of 24 tokens, so a fuzzed request generates at most 23."""
    worker = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--api-key", USER_KEY,
                            "--context-length", "24", "--max-running-requests", "16", "--served-model-name", "tiny",
                            "--log-level", "warning"], server_workdir, api_key=USER_KEY)
    router = None
    try:
        worker.wait_ready()
        router = ServerProcess(["--worker-urls", worker.base_url, "--api-key", USER_KEY,
                                "--admin-api-key", ROUTER_ADMIN_KEY, "--health-check-interval", "0.5"],
                               server_workdir, module="radixserve.launch_router", api_key=USER_KEY)
        yield router.wait_ready(120), worker
    finally:
        if router is not None:
            router.stop()
        worker.stop()


def test_router_publishes_its_schema(fuzzed_cluster):
    router, _ = fuzzed_cluster
    spec = httpx.get(f"{router.base_url}/openapi.json", headers=router.headers, timeout=10).json()
    published = {(path, method.upper()) for path, ops in spec["paths"].items() for method in ops}
    assert published == set(OPERATIONS)
    completions = spec["paths"]["/v1/completions"]["post"]
    assert completions["requestBody"]["content"]["application/json"]["schema"]["type"] == "object"
    assert "parameters" not in completions  # no handler argument leaks as a query parameter
    assert "422" not in completions["responses"] and "503" in completions["responses"]
    assert spec["paths"]["/workers"]["post"]["security"] == [{"adminBearer": []}]


@pytest.mark.parametrize("path,method", OPERATIONS)
def test_fuzz_router_openapi(fuzzed_cluster, path, method):
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    router, worker = fuzzed_cluster
    spec = httpx.get(f"{router.base_url}/openapi.json", headers=router.headers, timeout=10).json()
    operation = schemathesis.openapi.from_dict(spec)[path][method]
    key = ROUTER_ADMIN_KEY if (path, method) in ADMIN_OPERATIONS else USER_KEY
    headers = {"Authorization": f"Bearer {key}"}
    modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
    strategy = st.one_of(*(operation.as_strategy(generation_mode=mode) for mode in modes))
    documented = {int(s) for s in spec["paths"][path][method.lower()]["responses"]}
    seen: list[int] = []

    @settings(max_examples=20 if method == "POST" else 4, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case):
        response = case.call(base_url=router.base_url, headers=headers, timeout=60)
        seen.append(response.status_code)
        assert response.status_code < 500 or response.status_code in documented, (response.status_code,
                                                                                  response.text[:300])
        case.validate_response(response, headers=headers, excluded_checks=[positive_data_acceptance],
                               transport_kwargs={"base_url": router.base_url})
        if response.status_code >= 400:
            assert set(json.loads(response.text)) == {"error"}

    run()
    assert seen
    # Workers a fuzzed POST /workers added go again; the real worker must still be registered.
    admin = {"Authorization": f"Bearer {ROUTER_ADMIN_KEY}"}
    workers = httpx.get(f"{router.base_url}/workers", headers=admin, timeout=10).json()["workers"]
    for w in workers:
        if w["url"] != worker.base_url:
            httpx.delete(f"{router.base_url}/workers/{w['id']}", headers=admin, timeout=10)
    assert worker.base_url in {w["url"] for w in workers}
    assert httpx.get(f"{worker.base_url}/health", timeout=30).status_code == 200
    r = httpx.post(f"{router.base_url}/v1/completions", headers=router.headers, timeout=60,
                   json={"prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200, r.text
