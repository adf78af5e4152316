"""KV events in vLLM's wire format (`--kv-events-config`), read by a subscriber written here from the
published format: ZMQ frames (topic, 8-byte big-endian sequence number, msgpack payload), the
payload `[ts, events, dp_rank]`, events tagged with their class name, decoded with `msgpack`
(not with the server's encoder). Real server processes on loopback, real sockets."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

import httpx
import msgpack
import pytest
import zmq

from conftest import ServerProcess, free_port

PAGE = 4
TOPIC = b"kv@test"
END_SEQ = -1


@dataclass
class Mirror:
    """What one tier holds, per the events: block hash -> (parent hash, the block's tokens). The
    device's blocks form a tree from the root; the host tier holds copies of any of them."""

    tree: bool
    blocks: dict[int, tuple[Optional[int], tuple[int, ...]]] = field(default_factory=dict)
    stored: int = 0
    removed: int = 0

    def store(self, hashes, parent, tokens, block_size):
        assert len(tokens) == len(hashes) * block_size, "a stored event carries whole blocks"
        for i, h in enumerate(hashes):
            assert h not in self.blocks, f"block {h} stored twice without a removal"
            assert not self.tree or parent is None or parent in self.blocks, f"block {h}'s parent is not held"
            self.blocks[h] = (parent, tuple(tokens[i * block_size:(i + 1) * block_size]))
            parent = h
        self.stored += len(hashes)

    def remove(self, hashes):
        for h in hashes:
            assert h in self.blocks, f"block {h} removed but never stored"
            del self.blocks[h]
        self.removed += len(hashes)

    @property
    def tokens(self) -> int:
        return len(self.blocks) * PAGE

    def chain_of(self, tokens: list[int]) -> list[int]:
        """Hashes of the held blocks that spell tokens' whole pages from the root, as far as held."""
        children: dict[tuple[Optional[int], tuple[int, ...]], int] = {
            (parent, toks): h for h, (parent, toks) in self.blocks.items()}
        chain, parent = [], None
        for i in range(len(tokens) // PAGE):
            h = children.get((parent, tuple(tokens[i * PAGE:(i + 1) * PAGE])))
            if h is None:
                break
            chain.append(h)
            parent = h
        return chain


class VllmEventSubscriber:
    """A consumer of vLLM's KV events: a SUB socket for the live stream and the replay ROUTER for
    what it missed (a gap in the sequence numbers, or everything before it subscribed)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay_endpoint: str, *, bind: bool):
        self.ctx = ctx
        self.replay_endpoint = replay_endpoint
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        (self.sub.bind if bind else self.sub.connect)(endpoint)
        self.payloads: dict[int, bytes] = {}
        self.replayed: list[int] = []
        self.next_seq = 0
        self.mirrors = {"GPU": Mirror(tree=True), "CPU": Mirror(tree=False)}
        self.cleared = 0
        self.dp_ranks: set[int] = set()
        self.kinds: list[str] = []

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            got = []
            while True:
                assert dealer.poll(30_000), "no answer from the replay socket"
                empty, seq_bytes, payload = dealer.recv_multipart()
                assert empty == b""
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    assert payload == b""
                    return got
                got.append((seq, payload))
        finally:
            dealer.close(0)

    def _apply(self, seq: int, payload: bytes) -> None:
        if seq < self.next_seq:
            assert self.payloads[seq] == payload, "a replayed batch differs from the live one"
            return
        assert seq == self.next_seq, f"batch {seq} while {self.next_seq} is missing"
        self.payloads[seq] = payload
        self.next_seq += 1
        ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and abs(ts - time.time()) < 3600
        self.dp_ranks.add(dp_rank)
        for event in events:
            kind = event[0]
            self.kinds.append(kind)
            if kind == "BlockStored":
                _, hashes, parent, tokens, block_size, lora_id, medium = event
                assert block_size == PAGE and lora_id is None
                assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in hashes)
                self.mirrors[medium].store(hashes, parent, tokens, block_size)
            elif kind == "BlockRemoved":
                _, hashes, medium = event
                self.mirrors[medium].remove(hashes)
            else:
                assert event == ["AllBlocksCleared"], event
                self.cleared += 1
                for mirror in self.mirrors.values():
                    mirror.blocks.clear()

    def catch_up(self, before: Optional[int] = None) -> None:
        """Replay what was published from next_seq on (up to `before`)."""
        self.replayed.append(self.next_seq)
        for seq, payload in self.replay(self.next_seq):
            if before is None or seq < before:
                self._apply(seq, payload)

    def pump(self, timeout_ms: int = 200) -> bool:
        """Apply what the live stream has; whether anything came."""
        got = False
        while self.sub.poll(timeout_ms):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == TOPIC and len(seq_bytes) == 8
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.next_seq:  # missed some (sent before the subscription reached the publisher)
                self.catch_up(before=seq)
            self._apply(seq, payload)
            got, timeout_ms = True, 0
        return got

    def wait_for(self, what: str, condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
        """Follow the stream until condition holds. A PUB socket drops what it sends before a
        subscription reaches it, and only a later batch shows the gap: a quiet second asks the
        replay socket for anything newer, as a consumer that must not miss a batch does."""
        deadline = time.monotonic() + timeout_s
        quiet_since = time.monotonic()
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}; events seen: {self.kinds[-20:]}"
            if self.pump():
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > 1.0:
                self.catch_up()
                quiet_since = time.monotonic()

    def close(self) -> None:
        self.sub.close(0)


def generate(base: str, input_ids: list[int], max_new_tokens: int = 1) -> dict:
    r = httpx.post(base + "/generate", timeout=60, json={
        "input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}})
    assert r.status_code == 200, r.text
    return r.json()


def metrics(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def kv_events_args(model_dir, endpoint: str, replay: str, **extra) -> list[str]:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "replay_endpoint": replay, "topic": TOPIC.decode(), "buffer_steps": 1000, "hwm": 10000, **extra}
    return ["--model-path", str(model_dir), "--device", "cpu", "--page-size", str(PAGE),
            "--kv-events-config", json.dumps(config)]


def prompt(seed: int, length: int = 30) -> list[int]:
    return [10 + (seed * 37 + i * 11) % 480 for i in range(length)]


@pytest.fixture(scope="module")
def ctx():
    context = zmq.Context()
    yield context
    context.term()


def test_router_follows_blocks_evictions_flush_and_replays(server_model_dir, server_workdir, ctx):
    """Connect mode (vLLM's rule for a host address): the router binds, the server connects to it.
    The subscriber mirrors the cache exactly: a prompt's whole pages with its token ids and parent
    chain, each eviction, the flush; a late reader replays the same batches byte for byte."""
    pub_port, replay_port = free_port(), free_port()
    sub = VllmEventSubscriber(ctx, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", bind=True)
    proc = ServerProcess([*kv_events_args(server_model_dir, f"tcp://127.0.0.1:{pub_port}",
                                          f"tcp://127.0.0.1:{replay_port}"), "--max-total-tokens", "160"],
                         server_workdir)
    try:
        proc.wait_ready()
        sub.pump(0)  # a bound SUB sends its subscription to a new peer when its socket is next used
        base = proc.base_url
        gpu = sub.mirrors["GPU"]

        first = prompt(1)  # 30 tokens: 7 whole pages, 2 tokens left over
        generate(base, first)
        sub.wait_for("the prompt's blocks", lambda: len(gpu.chain_of(first)) == len(first) // PAGE)
        chain = gpu.chain_of(first)
        assert [gpu.blocks[h][1] for h in chain] == [tuple(first[i:i + PAGE]) for i in range(0, 28, PAGE)]
        assert gpu.blocks[chain[0]][0] is None and all(
            gpu.blocks[chain[i]][0] == chain[i - 1] for i in range(1, len(chain)))

        # A prompt sharing 5 pages: its new blocks hang off the shared chain's fifth block.
        second = first[:20] + prompt(2, 14)
        generate(base, second)
        sub.wait_for("the second prompt's blocks", lambda: len(gpu.chain_of(second)) == len(second) // PAGE)
        assert gpu.chain_of(second)[:5] == chain[:5] and gpu.chain_of(second)[5] not in chain

        # The pool holds 160 tokens: distinct prompts evict the oldest blocks.
        for seed in range(3, 12):
            generate(base, prompt(seed))
        sub.wait_for("evictions", lambda: gpu.removed > 0 and not gpu.chain_of(first)[5:])
        sub.pump()

        # Idle, the mirror holds exactly what the tree holds.
        def tree_tokens() -> float:
            m = metrics(base)
            return m["radixserve:kv_evictable_tokens"] + m["radixserve:kv_protected_tokens"]

        sub.wait_for("the mirror to match the tree", lambda: len(gpu.blocks) * PAGE == tree_tokens())

        assert httpx.post(base + "/flush_cache", timeout=30).status_code == 200
        sub.wait_for("AllBlocksCleared", lambda: sub.cleared == 1)
        assert not gpu.blocks and sub.dp_ranks == {0}
        assert not sub.mirrors["CPU"].blocks and sub.mirrors["CPU"].stored == 0  # no host tier

        # A late reader asks from sequence number 2: every buffered batch since, then the end marker.
        replayed = sub.replay(2)
        assert [seq for seq, _ in replayed] == list(range(2, sub.next_seq))
        assert all(payload == sub.payloads[seq] for seq, payload in replayed)
        assert sub.replay(sub.next_seq + 5) == []
    finally:
        proc.stop()
        sub.close()


def test_late_subscriber_replays_host_tier_blocks_and_rank(server_model_dir, server_workdir, ctx, tmp_path):
    """Bind mode (an ipc:// address), data-parallel rank 1 (ports and paths offset by it, batches
    tagged with it) and a host tier: a subscriber that connects after the server has published
    replays from sequence number 0 and then mirrors both tiers: blocks copied to the host tier
    are BlockStored "CPU" as they leave the device (BlockRemoved "GPU"), and BlockStored "GPU"
    again when a request copies them back."""
    replay_port = free_port()  # rank 1's: the configured port is one less
    endpoint = f"ipc://{tmp_path}/kv-{uuid.uuid4().hex[:8]}.sock"
    proc = ServerProcess([*kv_events_args(server_model_dir, endpoint, f"tcp://127.0.0.1:{replay_port - 1}"),
                          "--max-total-tokens", "160", "--hicache-ratio", "4", "--dp-rank", "1"], server_workdir)
    sub = None
    try:
        proc.wait_ready()
        base = proc.base_url
        first = prompt(1)
        generate(base, first)
        for seed in range(2, 8):  # push first's blocks off the device, onto the host tier
            generate(base, prompt(seed))

        sub = VllmEventSubscriber(ctx, endpoint + "_dp1", f"tcp://127.0.0.1:{replay_port}", bind=False)
        sub.pump(0)
        gpu, cpu = sub.mirrors["GPU"], sub.mirrors["CPU"]
        sub.wait_for("the replay of what came before", lambda: sub.next_seq > 0)
        assert sub.replayed[0] == 0 and sub.dp_ranks == {1}
        assert len(gpu.chain_of(first)) < len(first) // PAGE, "the first prompt should have left the device"
        assert gpu.removed and cpu.stored
        first_pages = {tuple(first[i:i + PAGE]) for i in range(0, 28, PAGE)}
        assert first_pages <= {toks for _, toks in cpu.blocks.values()}, "its blocks are on the host tier"

        generate(base, first)  # found on the host tier and copied back
        sub.wait_for("the copy back", lambda: len(gpu.chain_of(first)) == len(first) // PAGE)

        def tiers() -> tuple[float, float]:
            m = metrics(base)
            return m["radixserve:kv_evictable_tokens"] + m["radixserve:kv_protected_tokens"], \
                m["radixserve:hicache_cached_tokens"]

        sub.wait_for("the mirrors to match both tiers", lambda: (gpu.tokens, cpu.tokens) == tiers())
        assert metrics(base)["radixserve:host_cached_prompt_tokens_total"] > 0
    finally:
        proc.stop()
        if sub is not None:
            sub.close()


def test_salted_blocks_reach_a_late_subscriber_as_hashes_without_token_ids(server_model_dir, server_workdir, ctx):
    """A salted request and an unsalted one, then a subscriber that connects late and replays from
    sequence number 0, as anyone who reaches the sockets can: the unsalted prompt's blocks carry
    its token ids, the salted one's only their hashes (chained from the salt's namespace, so not
    the hashes the same tokens get unsalted). The PUB socket is bound on a wildcard address, which
    the start-up log warns about."""
    pub_port, replay_port = free_port(), free_port()
    proc = ServerProcess(kv_events_args(server_model_dir, f"tcp://*:{pub_port}", f"tcp://127.0.0.1:{replay_port}"),
                         server_workdir)
    sub = None
    try:
        proc.wait_ready()
        base, secret, shared = proc.base_url, prompt(21), prompt(22)
        r = httpx.post(base + "/generate", timeout=60, json={
            "input_ids": secret, "cache_salt": f"tenant-{uuid.uuid4()}",
            "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        assert r.status_code == 200, r.text
        generate(base, shared)
        generate(base, secret)  # the same tokens unsalted: other hashes, and their tokens published

        sub = VllmEventSubscriber(ctx, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", bind=False)
        whole = 28  # 30-token prompts: 7 whole pages of 4

        def stored() -> list[tuple[list[int], list[int]]]:
            events = [e for _, payload in sub.replay(0) for e in msgpack.unpackb(payload, raw=False)[1]]
            return [(e[1], e[3]) for e in events if e[0] == "BlockStored"]

        deadline = time.monotonic() + 60
        while sum(len(hashes) for hashes, _ in stored()) < 3 * whole // PAGE:
            assert time.monotonic() < deadline, f"the three prompts' blocks were not published: {stored()}"
            time.sleep(0.2)
        events = stored()
        with_tokens = [(hashes, tokens) for hashes, tokens in events if tokens]
        without = [hashes for hashes, tokens in events if not tokens]
        assert all(len(tokens) == len(hashes) * PAGE for hashes, tokens in with_tokens)
        pages = {tuple(tokens[i:i + PAGE]) for _, tokens in with_tokens for i in range(0, len(tokens), PAGE)}
        assert {tuple(p[i:i + PAGE]) for p in (shared, secret) for i in range(0, whole, PAGE)} == pages
        salted_hashes = [h for hashes in without for h in hashes]
        assert len(salted_hashes) == whole // PAGE and all(isinstance(h, int) and h for h in salted_hashes)
        assert not set(salted_hashes) & {h for hashes, _ in with_tokens for h in hashes}
        assert f"KV events: tcp://*:{pub_port} listens on every interface" in proc.output()
    finally:
        proc.stop()
        if sub is not None:
            sub.close()


def test_unsalted_token_ids_false_publishes_no_token_ids_at_all():
    """The config's own field: the shared cache's blocks lose their token ids too, hashes kept."""
    from radixserve.cache.kv_pool import PageAllocator
    from radixserve.cache.namespace import cache_namespace
    from radixserve.cache.page_events import PageEvents
    from radixserve.cache.radix_cache import RadixCache
    from radixserve.kv_events_config import parse_kv_events_config

    assert parse_kv_events_config('{"enable_kv_cache_events": true}').unsalted_token_ids
    for keep in (True, False):
        alloc = PageAllocator(16, PAGE)
        cache = RadixCache(alloc, page_size=PAGE)
        recorder = PageEvents(cache)
        recorder.follow_blocks(unsalted_token_ids=keep)
        for namespace in (None, cache_namespace("salt")):
            cache.insert(list(range(8)), alloc.pages_to_slots(alloc.alloc_pages(2)), namespace=namespace)
        shared, salted = [e for e in recorder.take_blocks() if e[0] == "BlockStored"]
        assert len(shared[1]) == len(salted[1]) == 2 and not set(shared[1]) & set(salted[1])
        assert shared[3] == (list(range(8)) if keep else []) and salted[3] == []


def test_the_default_endpoint_is_bound_on_loopback_and_wildcards_are_named():
    from radixserve.kv_events_config import exposed_endpoints, listens_everywhere, parse_kv_events_config

    default = parse_kv_events_config('{"enable_kv_cache_events": true, "replay_endpoint": "tcp://127.0.0.1:5558"}')
    assert default.resolved_endpoint == "tcp://127.0.0.1:5557" and default.endpoint_binds
    assert exposed_endpoints(default) == []
    assert all(listens_everywhere(e) for e in ("tcp://*:5557", "tcp://0.0.0.0:5558", "tcp://[::]:5557"))
    assert not any(listens_everywhere(e) for e in ("tcp://127.0.0.1:5557", "tcp://[::1]:5557", "ipc:///tmp/kv"))
    wide = parse_kv_events_config('{"enable_kv_cache_events": true, "endpoint": "tcp://router:5557", '
                                  '"replay_endpoint": "tcp://0.0.0.0:5558"}')
    assert exposed_endpoints(wide, dp_rank=2) == ["tcp://0.0.0.0:5560"]  # connected PUB: only the replay listens


def test_map_layout_is_recent_vllms_tagged_maps():
    """event_layout "map": each event a map with its class name under "type", required fields
    present even when nil, as recent vLLM releases send them."""
    from radixserve.engine.kv_publisher import event_record

    stored = ("BlockStored", [1, 2], None, list(range(8)), "GPU")
    assert msgpack.unpackb(msgpack.packb(event_record(stored, 4, "map"))) == {
        "type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": list(range(8)),
        "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None}
    assert event_record(("BlockRemoved", [2], "CPU"), 4, "map") == {
        "type": "BlockRemoved", "block_hashes": [2], "medium": "CPU"}
    assert event_record(("AllBlocksCleared",), 4, "map") == {"type": "AllBlocksCleared"}
    assert event_record(stored, 4, "array") == ["BlockStored", [1, 2], None, list(range(8)), 4, None, "GPU"]


@pytest.mark.parametrize("config, field", [
    ('{"enable_kv_cache_events": true, "endpont": "tcp://*:5557"}', "endpont"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
    ('{"publisher": "kafka"}', "publisher"),
    ('{"endpoint": "tcp://*"}', "endpoint"),
    ('{"buffer_steps": 0}', "buffer_steps"),
    ('{"event_layout": "json"}', "event_layout"),
    ("{not json", "not JSON"),
])
def test_a_bad_config_is_refused_by_name_before_anything_loads(config, field):
    import subprocess
    import sys

    from conftest import REPO_ROOT

    r = subprocess.run([sys.executable, "-m", "radixserve.launch_server", "--kv-events-config", config],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and field in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_endpoints_follow_vllms_bind_and_rank_rules():
    from radixserve.kv_events_config import binds, offset_endpoint

    assert binds("tcp://*:5557") and binds("ipc:///tmp/kv") and binds("tcp://[::]:5557")
    assert not binds("tcp://router.cluster.local:5557") and not binds("tcp://127.0.0.1:5557")
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("ipc:///tmp/kv", 2) == "ipc:///tmp/kv_dp2"
    assert offset_endpoint(None, 2) is None


def test_a_busy_replay_port_fails_the_start_in_one_line(server_model_dir, ctx):
    import subprocess
    import sys

    from conftest import REPO_ROOT

    taken = ctx.socket(zmq.ROUTER)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        config = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:1",
                             "replay_endpoint": f"tcp://127.0.0.1:{port}"})
        r = subprocess.run([sys.executable, "-m", "radixserve.launch_server", "--model-path", str(server_model_dir),
                            "--device", "cpu", "--port", str(free_port()), "--kv-events-config", config],
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    finally:
        taken.close(0)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert f"cannot bind tcp://127.0.0.1:{port}" in lines[0] and "Address already in use" in lines[0]


def scrape(base: str) -> dict[tuple[str, tuple], float]:
    """/metrics read with Prometheus' own text parser: (sample name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_gateway_gauges_have_vllm_and_sglang_names_and_meanings(server_model_dir, server_workdir):
    """The gauges a gateway reads from vLLM and SGLang workers, beside ours: one request running and
    one waiting (--max-running-requests 1), KV usage as a 0-1 fraction of the pool that requests
    hold, the cache's block size and block count, and the prefix cache's queried and hit tokens."""
    import threading

    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--page-size", str(PAGE),
                          "--max-total-tokens", "8192", "--max-running-requests", "1",
                          "--served-model-name", "gauge-model"], server_workdir)
    stop = threading.Event()

    def stream_long(seed: int) -> None:
        with httpx.stream("POST", proc.base_url + "/generate", timeout=120, json={
                "input_ids": prompt(seed), "stream": True,
                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return  # closing the stream aborts the request

    vllm = (("engine", "0"), ("model_name", "gauge-model"))
    sglang = (("model_name", "gauge-model"),)
    try:
        proc.wait_ready()
        base = proc.base_url
        generate(base, prompt(1))
        generate(base, prompt(1))  # all but the last page's worth found cached
        threads = [threading.Thread(target=stream_long, args=(seed,), daemon=True) for seed in (2, 3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while True:
            m = scrape(base)
            if m.get(("vllm:num_requests_running", vllm)) == 1 and m.get(("vllm:num_requests_waiting", vllm)) == 1:
                break
            assert time.monotonic() < deadline, {k: v for k, v in m.items() if k[0].startswith(("vllm", "sglang"))}
            time.sleep(0.2)
        assert m[("sglang:num_running_reqs", sglang)] == 1 and m[("sglang:num_queue_reqs", sglang)] == 1
        usage = m[("vllm:kv_cache_usage_perc", vllm)]
        assert 0 < usage < 1 and usage == m[("sglang:token_usage", sglang)] == m[("radixserve:token_usage", ())]
        info = [labels for (name, labels), value in m.items() if name == "vllm:cache_config_info" and value == 1]
        assert len(info) == 1 and dict(info[0])["block_size"] == str(PAGE)
        assert dict(info[0])["num_gpu_blocks"] == str(8192 // PAGE)
        assert dict(info[0])["model_name"] == "gauge-model" and dict(info[0])["enable_prefix_caching"] == "True"
        queries = m[("vllm:prefix_cache_queries_total", vllm)]
        hits = m[("vllm:prefix_cache_hits_total", vllm)]
        assert queries == m[("radixserve:prompt_tokens_total", ())] >= 3 * 30  # admitted prompts (the waiting one is not yet)
        assert hits == m[("radixserve:cached_prompt_tokens_total", ())] >= 28  # the repeat's 7 whole pages
    finally:
        stop.set()
        proc.stop()


def test_dynamo_kv_indexer_scores_follow_our_cache(server_model_dir, server_workdir, tmp_path):
    """A consumer written by someone else: NVIDIA Dynamo's standalone KV indexer (`python -m
    dynamo.indexer`, from the ai-dynamo-runtime wheel, CPU-only) subscribes to our events and
    scores a prompt we cached by its cached tokens (7 whole pages of 4), and a flushed worker zero."""
    pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime is not installed")
    import subprocess
    import sys

    endpoint = f"ipc://{tmp_path}/kv-{uuid.uuid4().hex[:8]}.sock"
    proc = ServerProcess(kv_events_args(server_model_dir, endpoint, f"tcp://127.0.0.1:{free_port()}"),
                         server_workdir)
    indexer = None
    port = free_port()
    try:
        proc.wait_ready()
        # After the server: its ZMQ client does not retry an ipc path that does not exist yet.
        indexer = subprocess.Popen([sys.executable, "-m", "dynamo.indexer", "--block-size", str(PAGE), "--port",
                                    str(port), "--threads", "1", "--workers", f"7={endpoint}"],
                                   stdout=open(server_workdir / f"dynamo-indexer-{port}.out", "wb"),
                                   stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"

        def listening() -> bool:
            try:
                workers = httpx.get(url + "/workers", timeout=5).json()
            except httpx.HTTPError:
                return False
            return any(l["status"] == "active" for w in workers for l in w["listeners"].values())

        def score(tokens: list[int]) -> int:
            r = httpx.post(url + "/query", json={"model_name": "default", "token_ids": tokens}, timeout=10)
            assert r.status_code == 200, r.text
            return r.json()["scores"].get("7", {}).get("0", 0)

        deadline = time.monotonic() + 60
        while not listening():
            assert indexer.poll() is None and time.monotonic() < deadline, "the indexer did not start"
            time.sleep(0.2)
        time.sleep(2.0)  # its subscription reaches our PUB socket, which takes it in while idle

        cached = prompt(1)
        generate(base := proc.base_url, cached)
        deadline = time.monotonic() + 60
        while score(cached) != 28:
            assert time.monotonic() < deadline, f"the indexer scores {score(cached)}, not 28"
            time.sleep(0.2)
        assert score(cached[:12] + prompt(9, 18)) == 12  # the shared 3 pages
        assert score(prompt(5)) == 0

        assert httpx.post(base + "/flush_cache", timeout=30).status_code == 200
        deadline = time.monotonic() + 60
        while score(cached) != 0:
            assert time.monotonic() < deadline, "the flush did not reach the indexer"
            time.sleep(0.2)
    finally:
        if indexer is not None:
            indexer.terminate()
            indexer.wait(30)
        proc.stop()
