"""Several API keys against real servers on loopback: `--api-key` repeated and `--api-key-file`.

With more than one key each key's requests get their own prefix cache by default, so
`cached_tokens` cannot tell one key's holder what another key sent (a PIN was recovered in 61
requests across two keys through a shared cache); `--shared-cache-across-keys` shares one. The keys
appear in no log line, no `/server_info`, and on no child process's command line or environment:
the engine process, its tensor-parallel rank and `--dp-size` workers, read from /proc as any local
user (`ps`) reads them. Also: the key file's format, and a bad file refused in one line that never
shows a key."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from conftest import REPO_ROOT, ServerProcess
from radixserve.http_common.api_keys import load_key_ring, parse_key_file

pytestmark = pytest.mark.timeout(400)

KEY_A = f"sk-alice-{uuid.uuid4().hex}"
KEY_B = f"sk-bob-{uuid.uuid4().hex}"
ADMIN_KEY = f"sk-admin-{uuid.uuid4().hex}"
SECRETS = (KEY_A, KEY_B, ADMIN_KEY)


def fresh_prompt() -> str:
    """A prompt no earlier request sent: its only cached part can be this test's."""
    return f"My PIN is {uuid.uuid4().int % 10**6:06d}, note {uuid.uuid4().hex}. Never tell anyone. " * 4


def cached_tokens(base_url: str, key: str, prompt: str) -> int:
    r = httpx.post(f"{base_url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                   json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def key_file(directory: Path, text: str) -> Path:
    path = directory / f"keys-{uuid.uuid4().hex[:8]}"
    path.write_text(text)
    path.chmod(0o600)
    return path


def descendants(pid: int) -> list[int]:
    """Every live process under pid, read from /proc as `ps` does."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def read_proc(pid: int, name: str) -> bytes:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read()
    except OSError:
        return b""


def children_with(server: ServerProcess, modules: list[str]) -> list[int]:
    """The server's descendants once each module in `modules` runs in one (a rank spawns late)."""
    deadline = time.monotonic() + 60
    while True:
        pids = descendants(server.proc.pid)
        lines = [read_proc(p, "cmdline") for p in pids]
        if all(sum(m.encode() in line for line in lines) >= modules.count(m) for m in set(modules)):
            return pids
        assert time.monotonic() < deadline, f"missing children: {modules} among {lines}"
        time.sleep(0.2)


def assert_no_secret_in(pids: list[int]) -> None:
    for pid in pids:
        for what in ("cmdline", "environ"):
            text = read_proc(pid, what)
            for secret in SECRETS:
                assert secret.encode() not in text, f"a key is in /proc/{pid}/{what}: {text[:300]!r}"


# ---------------------------------------------------------------------------------------------- the key file
def test_the_key_file_takes_a_key_and_an_optional_name_per_line():
    keys = parse_key_file("# tenants\n\nsk-one  alice\n  sk-two\nsk-three bob@team.example\n", "keys", 2)
    assert [(k.key, k.label) for k in keys] == [("sk-one", "alice"), ("sk-two", "key 3"),
                                                ("sk-three", "bob@team.example")]
    assert "sk-one" not in repr(keys) and "sk-one" not in repr(load_key_ring(["sk-one"]))
    for text, why in (("sk-x alice extra\n", "line 1: expected KEY or KEY NAME"),
                      ("# c\nsk-x al/ice\n", "line 2: a tenant name")):
        with pytest.raises(ValueError, match=why) as e:
            parse_key_file(text, "keys")
        assert "sk-x" not in str(e.value)
    with pytest.raises(ValueError, match="given twice") as e:
        load_key_ring(["sk-dup", "sk-dup"])
    assert "sk-dup" not in str(e.value)
    ring = load_key_ring(["sk-one", "sk-two"])
    assert ring.match(b"sk-two").label == "key 2" and ring.match(b"sk-tw") is None and ring.match(None) is None
    assert ring.isolates_cache(False, False) and not ring.isolates_cache(False, True)
    assert not load_key_ring(["sk-one"]).isolates_cache(False, False)  # one key: one tenant, one cache


def test_a_bad_key_file_fails_the_start_in_one_line_that_shows_no_key(tmp_path):
    bad = key_file(tmp_path, f"{KEY_A} alice\n{KEY_B} bob trailing-word\n")
    r = subprocess.run([sys.executable, "-m", "radixserve.launch_server", "--api-key-file", str(bad)],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "line 2: expected KEY or KEY NAME" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and KEY_A not in r.stderr and KEY_B not in r.stderr


# ---------------------------------------------------------------------------------------------- real servers
@pytest.fixture(scope="module")
def two_keys(server_model_dir, server_workdir, tmp_path_factory):
    """Key A on the command line, key B (named bob) in a key file, an admin key; --tp-size 2, so the
    engine process has a rank process of its own."""
    keys = key_file(tmp_path_factory.mktemp("keys"), f"# the second tenant\n{KEY_B} bob\n")
    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--tp-size", "2",
                          "--api-key", KEY_A, "--api-key-file", str(keys), "--admin-api-key", ADMIN_KEY,
                          "--log-requests"], server_workdir, api_key=KEY_A)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_a_second_key_does_not_find_what_the_first_cached(two_keys):
    base, prompt = two_keys.base_url, fresh_prompt()
    assert cached_tokens(base, KEY_A, prompt) == 0
    assert cached_tokens(base, KEY_B, prompt) == 0  # A's prompt is not in B's cache
    hit = cached_tokens(base, KEY_A, prompt)  # A's own cache has all of it but the last token
    assert hit > 50
    assert cached_tokens(base, KEY_B, prompt) == hit  # B's own first request is cached for B
    r = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer sk-neither"}, timeout=10)
    assert r.status_code == 401


def test_keys_are_in_no_log_no_server_info_and_no_child_process(two_keys):
    info = two_keys.server_info()
    assert info["settings"]["api_key"] == "***" and info["settings"]["admin_api_key"] == "***"
    assert info["api_key_count"] == 2 and info["cache_per_api_key"] is True
    text = httpx.get(f"{two_keys.base_url}/server_info", headers=two_keys.headers, timeout=10).text
    assert not any(secret in text for secret in SECRETS)

    cached_tokens(two_keys.base_url, KEY_B, fresh_prompt())  # a request logged under --log-requests
    log = two_keys.output()
    assert "API keys: 2 API key(s) (key 1, bob); each key has its own prefix cache" in log
    assert "Request finished." in log and not any(secret in log for secret in SECRETS)

    pids = children_with(two_keys, ["radixserve.engine.engine_process", "radixserve.engine.tp_worker"])
    assert_no_secret_in(pids)
    # The API process's own command line is the user's: the file's key is not on it either.
    assert KEY_B.encode() not in read_proc(two_keys.proc.pid, "cmdline")


def test_shared_cache_across_keys_lets_a_second_key_find_the_first_keys_prompt(server_model_dir, server_workdir):
    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--api-key", KEY_A,
                          "--api-key", KEY_B, "--shared-cache-across-keys"], server_workdir, api_key=KEY_A)
    try:
        proc.wait_ready()
        prompt = fresh_prompt()
        assert cached_tokens(proc.base_url, KEY_A, prompt) == 0
        assert cached_tokens(proc.base_url, KEY_B, prompt) > 50  # one cache for both keys, as asked
        assert proc.server_info()["cache_per_api_key"] is False
        assert "one prefix cache shared by every key" in proc.output()
    finally:
        proc.stop()


def test_dp_workers_get_the_keys_off_their_command_lines(server_model_dir, server_workdir, tmp_path):
    """--dp-size 2, every key in a file: the launcher hands each worker its settings, keys included,
    through a pipe; the built-in router takes both keys and keeps each key's prompts apart as the
    workers do; the admin key from its file guards the workers' /flush_cache."""
    keys = key_file(tmp_path, f"{KEY_A} alice\n{KEY_B} bob\n")
    admin = key_file(tmp_path, f"# the operator's\n{ADMIN_KEY}\n")
    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--dp-size", "2",
                          "--api-key-file", str(keys), "--admin-api-key-file", str(admin)], server_workdir,
                         api_key=KEY_A)
    try:
        proc.wait_ready()
        deadline = time.monotonic() + 60
        while not all(w["healthy"] for w in httpx.get(proc.base_url + "/workers", headers=proc.headers,
                                                      timeout=10).json()["workers"]):
            assert time.monotonic() < deadline, "the workers did not become healthy"
            time.sleep(0.2)
        pids = children_with(proc, ["radixserve.launch_server"] * 2 + ["radixserve.engine.engine_process"] * 2)
        assert_no_secret_in(pids + [proc.proc.pid])
        prompt = fresh_prompt()
        assert cached_tokens(proc.base_url, KEY_A, prompt) == 0
        assert cached_tokens(proc.base_url, KEY_B, prompt) == 0
        assert cached_tokens(proc.base_url, KEY_A, prompt) > 50  # routed back to A's prefix
        worker = httpx.get(proc.base_url + "/workers", headers=proc.headers, timeout=10).json()["workers"][0]["url"]
        for key, status in ((KEY_A, 401), (ADMIN_KEY, 200)):
            r = httpx.post(worker + "/flush_cache", headers={"Authorization": f"Bearer {key}"}, timeout=30)
            assert r.status_code == status, r.text
        assert not any(secret in proc.output() for secret in SECRETS)
    finally:
        assert proc.stop(60) == 0, proc.output()[-3000:]


def test_another_nodes_ranks_get_rank_0s_settings_without_the_keys():
    """A multi-node engine's settings go through rank 0's TCP store, which answers whoever reaches
    its port: the keys are never put there, and a node started with the same keys on its command
    line is not told that its settings differ from rank 0's."""
    import json

    from radixserve.engine.tensor_parallel import SETTINGS_KEY, rank0_settings
    from radixserve.settings import ServerSettings

    class Store(dict):
        def get(self, key):
            return self[key]

    node0 = ServerSettings(api_key=(KEY_A,), admin_api_key=ADMIN_KEY, tp_size=2)
    store = Store({SETTINGS_KEY: json.dumps(node0.without_secrets().to_dict()).encode()})
    assert not any(secret.encode() in store[SETTINGS_KEY] for secret in SECRETS)
    settings, differ = rank0_settings(store, ServerSettings(api_key=KEY_A, admin_api_key=ADMIN_KEY, tp_size=2))
    assert differ == [] and settings.api_key == () and settings.admin_api_key is None
