"""The server started with the seed's command, driven by the openai SDK, AsyncClient and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixserve.client import AsyncClient

from conftest import ServerProcess

pytestmark = pytest.mark.timeout(300)

SYSTEM_PROMPT = ("You are a helpful assistant. Answer the question as clearly and briefly as you can. "
                 "A server answers many questions at once, and many prompts begin with the same instructions, "
                 "so a careful system keeps the work it has already done and reuses it for the next request.")


def metric_values(base_url: str, headers=None) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", headers=headers or {}, timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


def wait_idle(server, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server.server_info()["stats"]
        if stats["running_requests"] == 0 and stats["queued_requests"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"engine still busy: {stats}")
        time.sleep(0.05)


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------------------------------------- SDKs
def test_openai_sync_client(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    models = client.models.list()
    model = models.data[0].id
    completion = client.completions.create(model=model, prompt="The river ran past", max_tokens=8, temperature=0)
    assert completion.choices[0].finish_reason in ("length", "stop")
    assert completion.usage.completion_tokens >= 1
    assert completion.usage.prompt_tokens_details.cached_tokens >= 0
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=6,
                                          temperature=0, seed=3)
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens > 0 and chat.usage.prompt_tokens_details.cached_tokens >= 0
    # n choices, each with its own index; greedy choices agree.
    many = client.completions.create(model=model, prompt=[1, 2, 3, 4], n=3, max_tokens=5, temperature=0)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert len({c.text for c in many.choices}) == 1
    assert many.usage.prompt_tokens == 4 and many.usage.completion_tokens > 0


def test_openai_async_streaming_with_usage(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        model = (await client.models.list()).data[0].id
        plain = await client.completions.create(model=model, prompt="Numbers matter too", max_tokens=12,
                                                temperature=0)
        stream = await client.completions.create(model=model, prompt="Numbers matter too", max_tokens=12,
                                                 temperature=0, stream=True, stream_options={"include_usage": True})
        pieces, usage, reasons = [], None, []
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                pieces.append(c.text)
                if c.finish_reason:
                    reasons.append(c.finish_reason)
        assert "".join(pieces) == plain.choices[0].text
        assert reasons == [plain.choices[0].finish_reason]
        assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens
        assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt ran just before

        chat_stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=10,
            temperature=0, stream=True, stream_options={"include_usage": True})
        content, roles, usage = [], [], None
        async for chunk in chat_stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                if c.delta.role:
                    roles.append(c.delta.role)
                if c.delta.content:
                    content.append(c.delta.content)
        chat = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=10,
            temperature=0)
        assert roles == ["assistant"]
        assert "".join(content) == chat.choices[0].message.content
        assert usage.completion_tokens == chat.usage.completion_tokens
        await client.close()

    asyncio.run(main())


def test_async_client_seed_script(server):
    """The seed's client script: chat template via client.tokenizer, streaming completions, TTFT."""

    async def session(client: AsyncClient, model: str, session_id: int, history: list[dict]) -> float:
        messages = history + [{"role": "user", "content": "Continue the analysis..."}]
        start = asyncio.get_running_loop().time()
        stream = await client.completions(
            model=model, prompt=client.tokenizer.apply_chat_template(messages, add_generation_prompt=True),
            stream=True, temperature=0.7, max_tokens=8)
        first_token_time = None
        async for chunk in stream:
            if first_token_time is None:
                first_token_time = asyncio.get_running_loop().time()
            assert chunk["object"] == "text_completion"
        return first_token_time - start

    async def main():
        async with AsyncClient(server.base_url) as client:
            model = (await client.models())["data"][0]["id"]
            tok = await client.load_tokenizer()
            assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False).startswith("<|im_start|>")
            history = [{"role": "system", "content": SYSTEM_PROMPT}]
            ttfts = await asyncio.gather(*(session(client, model, i, history) for i in range(4)))
            assert all(t > 0 for t in ttfts)
            chat = await client.chat(model=model, messages=history + [{"role": "user", "content": "hi"}],
                                     max_tokens=4, temperature=0)
            assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            native = await client.generate(text="Hello", sampling_params={"max_new_tokens": 3, "temperature": 0})
            # the client tokenizes exactly as the server does
            text = "Tokenize me: 1234, spaces   and\nnew lines!"
            served = await client.generate(text=text, sampling_params={"max_new_tokens": 1, "temperature": 0})
            assert len(tok.encode(text)) == served["meta_info"]["prompt_tokens"]
            assert set(native["meta_info"]) >= {"id", "finish_reason", "prompt_tokens", "completion_tokens",
                                                "cached_tokens", "e2e_latency"}

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------- oracle
def test_32_concurrent_streams_match_offline_engine(server, server_model_dir):
    from radixserve.engine.engine import Engine

    prompts = [f"Request {i}: " + " ".join(["The river ran past the old mill", "Numbers matter too",
                                             "Please write a short story about a cat", "A queue holds requests",
                                             "What is the capital of France?"][i % 5:]) + f" ({i * 7})"
               for i in range(32)]
    max_tokens = 16

    async def one(client, model, prompt):
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True)
        text, reason = [], None
        async for chunk in stream:
            for c in chunk.choices:
                text.append(c.text)
                reason = c.finish_reason or reason
        return "".join(text), reason

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        model = (await client.models.list()).data[0].id
        results = await asyncio.gather(*(one(client, model, p) for p in prompts))
        await client.close()
        return results

    results = asyncio.run(main())
    engine = Engine(model_path=str(server_model_dir), device="cpu", max_total_tokens=32768)
    expected = engine.generate(prompt=prompts, sampling_params={"max_new_tokens": max_tokens, "temperature": 0})
    for i, ((text, reason), exp) in enumerate(zip(results, expected)):
        assert text == exp["text"], f"prompt {i}: server {text!r} != offline {exp['text']!r}"
        assert reason == exp["meta_info"]["finish_reason"]["type"]


def test_generate_native_and_sse(server):
    with server.client() as http:
        body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
        plain = http.post("/generate", json=body).json()
        assert len(plain["output_ids"]) == plain["meta_info"]["completion_tokens"] == 6
        assert plain["meta_info"]["finish_reason"]["type"] == "length"
        events = []
        with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        assert events[-1] == "[DONE]"
        decoded = [json.loads(e) for e in events[:-1]]
        texts = [e["text"] for e in decoded]
        assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))  # cumulative
        assert texts[-1] == plain["text"] and decoded[-1]["output_ids"] == plain["output_ids"]
        assert decoded[-1]["meta_info"]["cached_tokens"] > 0
        batch = http.post("/generate", json={"input_ids": [[5, 6, 7], [8, 9]],
                                             "sampling_params": {"max_new_tokens": 2, "temperature": 0}}).json()
        assert isinstance(batch, list) and len(batch) == 2


def test_stream_interval_sends_fewer_bigger_events_with_the_same_tokens(server_model_dir, server_workdir):
    """--stream-interval 4: a 10-token stream arrives in at most 4 events (the first token, then
    every 4, then the end), cumulative as ever, ending with exactly what the unstreamed request
    returns; the OpenAI SDK's chunks add up to the same text."""
    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--max-total-tokens", "32768",
                          "--stream-interval", "4"], server_workdir).wait_ready()
    try:
        with proc.client() as http:
            body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 10, "temperature": 0,
                                                                   "ignore_eos": True}}
            plain = http.post("/generate", json=body).json()
            with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        decoded = [json.loads(e) for e in events[:-1]]
        # The engine sends 1, 4, 4 and 1 tokens; the API may merge outputs that arrive together.
        counts = [len(e["output_ids"]) for e in decoded]
        steps = [b - a for a, b in zip([0] + counts, counts)]
        assert len(decoded) <= 4 and counts[-1] == 10 and all(n >= 4 for n in steps[1:-1])
        assert decoded[-1]["output_ids"] == plain["output_ids"] and decoded[-1]["text"] == plain["text"]
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused")
        model = proc.server_info()["served_model_name"]
        chunks = list(client.completions.create(model=model, prompt="Once upon a time", max_tokens=10,
                                                temperature=0, stream=True))
        whole = client.completions.create(model=model, prompt="Once upon a time", max_tokens=10, temperature=0)
        assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
        assert len([c for c in chunks if c.choices and c.choices[0].text]) <= 4
    finally:
        proc.stop()


# ---------------------------------------------------------------------------------------------- prefix cache
def test_a_conversations_next_turn_sent_as_text_is_recognised_and_held(server_model_dir, server_workdir):
    """As a client sending text makes it: the second turn's prompt is the first's text, a reply and
    a new message, and the tokenizer reads the first prompt's last word together with the reply
    ("tree" + "s ..."), so the ids differ at that boundary. The second turn still counts as
    continuing the conversation and, finished, its prefix is held (`--prefix-hold-s`); both show
    on /metrics."""
    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--max-total-tokens", "32768",
                          "--prefix-hold-s", "30"], server_workdir).wait_ready()
    try:
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused")
        model = proc.server_info()["served_model_name"]
        first_prompt = SYSTEM_PROMPT + "\nUser: What is a radix tree?\nAssistant: A radix tree"
        first = client.completions.create(model=model, prompt=first_prompt, max_tokens=6, temperature=0)
        assert metric_values(proc.base_url)["radixserve:continued_turns_total"] == 0
        second_prompt = first_prompt + "s a trie with merged edges.\nUser: And how does a server use one?\nAssistant:"
        second = client.completions.create(model=model, prompt=second_prompt, max_tokens=6, temperature=0)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert first.usage.prompt_tokens - 8 <= cached < first.usage.prompt_tokens  # the boundary token differs
        wait_idle(proc)
        values = metric_values(proc.base_url)
        assert values["radixserve:continued_turns_total"] == 1
        assert values["radixserve:prefix_holds_total"] >= 1  # the second turn's prefix, held 30 s
    finally:
        proc.stop()


def test_shared_system_prompt_cached_tokens_metrics_and_log(server):
    with server.client() as http:
        assert http.post("/flush_cache").status_code == 200
    tok = httpx.get(f"{server.base_url}/tokenizer").json()
    assert "tokenizer.json" in tok["files"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(server.server_info()["model_path"]))
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    before = metric_values(server.base_url)
    questions = ["What is the capital of France?", "Summarize the text in three points.",
                 "Translate the following sentence into simple words.", "How do stones grind grain?"]
    seen: list[list[int]] = []
    cached, prompt_tokens = [], []
    system_ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT}],
                                                                tokenize=False), add_special_tokens=False)
    for q in questions:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                               add_special_tokens=False)
        reply = client.chat.completions.create(model=server.server_info()["served_model_name"], messages=messages,
                                               max_tokens=4, temperature=0)
        assert reply.usage.prompt_tokens == len(ids)
        expected = max((lcp(ids, prev) for prev in seen), default=0)
        assert reply.usage.prompt_tokens_details.cached_tokens == expected
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        prompt_tokens.append(reply.usage.prompt_tokens)
        seen.append(ids)
    assert cached[0] == 0 and all(c >= len(system_ids) for c in cached[1:])

    after = metric_values(server.base_url)
    delta = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731
    assert delta("radixserve:cached_prompt_tokens_total") == sum(cached)
    assert delta("radixserve:prompt_tokens_total") == sum(prompt_tokens)
    assert delta("radixserve:request_cached_tokens_total") == sum(cached)
    hit_rate = after["radixserve:prefix_hit_rate"]
    assert hit_rate == pytest.approx(after["radixserve:cached_prompt_tokens_total"]
                                     / after["radixserve:prompt_tokens_total"])
    assert 0 <= after["radixserve:prefix_hit_rate_window"] <= 1

    # The seed's monitoring pipeline prints the hit rate, and the newest value is the metric's.
    pipeline = f"grep \"prefix_hit_rate\" {server.log_file} | tail -n 10 | awk '{{print $NF}}' | sort -n"
    printed = subprocess.run(["bash", "-c", pipeline], capture_output=True, text=True, check=True).stdout.split()
    assert printed and all(0.0 <= float(x) <= 1.0 for x in printed)
    last = subprocess.run(["bash", "-c", f"grep prefix_hit_rate {server.log_file} | tail -n 1 | awk '{{print $NF}}'"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert last == f"{hit_rate:.3f}"
    log = server.log_file.read_text()
    assert "Prefill batch. #new-seq:" in log and "#cached-token:" in log
    assert "Request finished. id: chatcmpl-" in log and "ttft:" in log and "finish_reason: length" in log


# ---------------------------------------------------------------------------------------------- flow control
def _start_long_stream(http: httpx.Client, max_new_tokens: int = 4000):
    body = {"text": "The weather today is sunny", "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    ctx = http.stream("POST", "/generate", json=body)
    response = ctx.__enter__()
    lines = response.iter_lines()
    got = 0
    for line in lines:
        if line.startswith("data: "):
            got += 1
            if got == 2:
                break
    ctx.lines = lines  # closing the line iterator would close the response too
    return ctx


def test_client_disconnect_frees_kv(server):
    wait_idle(server)
    before = metric_values(server.base_url)
    with server.client() as http:
        ctx = _start_long_stream(http)
        running = server.server_info()["stats"]
        ctx.__exit__(None, None, None)  # the client goes away mid-stream
    assert running["running_requests"] == 1 and running["held_by_running_tokens"] > 0, running
    stats = wait_idle(server, 5.0)
    assert stats["held_by_running_tokens"] == 0 and stats["protected_tokens"] == 0
    assert stats["free_tokens"] + stats["evictable_tokens"] == stats["pool_tokens"]
    deadline = time.monotonic() + 5
    while True:  # the engine confirms the abort: it did not run to max_new_tokens
        after = metric_values(server.base_url)
        aborted = after.get('radixserve:requests_total{finish_reason=abort}', 0) - \
            before.get('radixserve:requests_total{finish_reason=abort}', 0)
        if aborted == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert aborted == 1
    assert "Request aborted. id:" in server.log_file.read_text()

    # A non-streaming client that gives up is noticed too.
    body = {"prompt": "The weather today is sunny", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
    stats = wait_idle(server, 5.0)
    assert stats["held_by_running_tokens"] == 0 and stats["protected_tokens"] == 0


def test_request_id_is_a_label(server):
    """A client's rid is echoed back but never identifies the engine request: two requests with
    the same rid at once are two requests, each with its own output."""
    body = {"text": "The weather today is sunny", "rid": "my-request", "stream": True,
            "sampling_params": {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}}
    with server.client() as http:
        with http.stream("POST", "/generate", json=body) as first:
            lines = first.iter_lines()
            event = json.loads(next(line for line in lines if line.startswith("data: "))[len("data: "):])
            assert event["meta_info"]["id"] == "my-request"
            second = http.post("/generate", json={**body, "stream": False,
                                                  "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
            assert second.status_code == 200, second.text
            assert second.json()["meta_info"]["id"] == "my-request"
            assert len(second.json()["output_ids"]) == 3
    wait_idle(server, 5.0)


def test_flush_cache_refused_while_running(server):
    with server.client() as http:
        ctx = _start_long_stream(http)
        refused = http.post("/flush_cache")
        ctx.__exit__(None, None, None)
        assert refused.status_code == 409
        assert refused.json()["error"]["code"] == "requests_running"
        wait_idle(server)
        assert http.post("/flush_cache").status_code == 200
        stats = server.server_info()["stats"]
        assert stats["evictable_tokens"] == 0 and stats["free_tokens"] == stats["pool_tokens"]


def test_info_endpoints(server):
    with server.client() as http:
        info = http.get("/server_info").json()
        assert info["pool_size"] == 32768 and info["settings"]["schedule_policy"] == "lpm"
        assert info["settings"]["radix_eviction_policy"] == "fifo" and info["settings"]["chunked_prefill_size"] == 1024
        assert info["engine_alive"] and info["engine_pid"] != info["api_pid"]
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        metrics = http.get("/metrics").text
        for name in ("radixserve:time_to_first_token_seconds_bucket", "radixserve:inter_token_latency_seconds",
                     "radixserve:e2e_request_latency_seconds", "radixserve:queue_time_seconds",
                     "radixserve:kv_fragmentation", "radixserve:prefix_hit_rate_window", "radixserve:num_queue_reqs",
                     "radixserve:kv_free_tokens", "radixserve:kv_evictable_tokens", "radixserve:kv_protected_tokens",
                     "radixserve:radix_tree_nodes", "radixserve:evicted_tokens_total", "radixserve:retractions_total",
                     "radixserve:generation_tokens_total", "radixserve:requests_total"):
            assert name in metrics, name


def test_queued_outputs_of_one_request_are_merged():
    """Outputs of a request already waiting when the stream reads are merged (tokens of all, the
    end and counts of the last, the first-token time of the first); other requests' outputs and
    errors keep their place."""
    from radixserve.engine.messages import RequestOutput
    from radixserve.sampling_params import FinishReason
    from radixserve.server.engine_client import EngineClient, EngineRequestError, RequestGroup
    from radixserve.settings import ServerSettings

    async def drain(group: RequestGroup, items: list) -> list:
        for item in items:
            group.queue.put_nowait(item)
        got = []
        try:
            async for out in group.outputs():
                got.append(out)
        except EngineRequestError as e:
            got.append(e)
        return got

    client = EngineClient(ServerSettings())  # never started: aborts go nowhere
    one = RequestGroup(client, ["a"])
    got = asyncio.run(drain(one, [
        RequestOutput(rid="a", new_token_ids=[1], ttft=0.5, queue_time=0.1, prompt_tokens=4, completion_tokens=1),
        RequestOutput(rid="a", new_token_ids=[2, 3], prompt_tokens=4, completion_tokens=3),
        RequestOutput(rid="a", new_token_ids=[4], finished=True, finish_reason=FinishReason("length"),
                      prompt_tokens=4, cached_tokens=2, completion_tokens=4)]))
    assert len(got) == 1
    merged = got[0]
    assert merged.new_token_ids == [1, 2, 3, 4] and merged.finished and merged.finish_reason == FinishReason("length")
    assert (merged.ttft, merged.queue_time, merged.completion_tokens, merged.cached_tokens) == (0.5, 0.1, 4, 2)

    two = RequestGroup(client, ["a", "b"])
    got = asyncio.run(drain(two, [
        RequestOutput(rid="a", new_token_ids=[1]), RequestOutput(rid="a", new_token_ids=[2]),
        RequestOutput(rid="b", new_token_ids=[7]), RequestOutput(rid="a", new_token_ids=[3], finished=True),
        EngineRequestError("bad b")]))
    assert [(o.rid, o.new_token_ids) for o in got[:3]] == [("a", [1, 2]), ("b", [7]), ("a", [3])]
    assert isinstance(got[3], EngineRequestError)


def test_n_choices_each_sample_with_their_own_seed(server):
    """n choices of a seeded request use seeds seed, seed+1, ...: they differ from each other, and
    each is exactly what a single request with its seed samples."""
    from radixserve.server.routes.openai_api import openai_params
    from radixserve.server.protocol import CompletionRequest
    from radixserve.validation import SEED_MAX

    body = CompletionRequest(prompt=[5, 6, 7], n=4, seed=SEED_MAX - 1)
    assert [openai_params(body, 8, j)["seed"] for j in range(4)] == [SEED_MAX - 1, SEED_MAX, SEED_MAX - 3, SEED_MAX - 4]
    request = {"prompt": "Seeds make sampling repeatable:", "max_tokens": 12, "temperature": 1.5, "ignore_eos": True}
    with server.client(timeout=120) as http:
        many = http.post("/v1/completions", json={**request, "n": 4, "seed": 1234}).json()["choices"]
        texts = [c["text"] for c in sorted(many, key=lambda c: c["index"])]
        assert len(set(texts)) == 4, texts
        for j, text in enumerate(texts):
            single = http.post("/v1/completions", json={**request, "seed": 1234 + j}).json()["choices"][0]["text"]
            assert single == text, (j, single, text)


def test_long_texts_are_tokenized_off_the_event_loop(server_model_dir):
    """Tokenizing (and the early character bound) never runs O(prompt) work on the event loop: a
    long text is encoded in the tokenizer pool, a text no context could hold is never encoded."""
    import threading

    from radixserve.process.tokenizer import load_tokenizer
    from radixserve.engine import messages as m
    from radixserve.server.errors import APIError
    from radixserve.server.serving import INLINE_TOKENIZE_CHARS, ServingContext
    from radixserve.settings import ServerSettings

    class Engine:  # the limits a running engine reports; nothing else is used
        ready = m.EngineReady(pid=0, model_path="", pool_size=4096, context_len=4096, vocab_size=512,
                              max_running_requests=1, device="cpu", dtype="float32")

    tokenizer = load_tokenizer(str(server_model_dir))
    ctx = ServingContext(ServerSettings(), tokenizer, Engine(), None, "", "tiny")
    threads = []
    real_encode = ctx.encode

    def recording_encode(text):
        threads.append(threading.current_thread())
        return real_encode(text)

    ctx.encode = recording_encode

    async def main():
        short = await ctx.tokenize("hello there", "prompt")
        long_ids = await ctx.tokenize("hello there " * (INLINE_TOKENIZE_CHARS // 6), "prompt")
        with pytest.raises(APIError) as info:
            await ctx.tokenize("x" * (ctx.max_token_chars * 4096 + 1), "prompt")
        return short, long_ids, info.value

    short, long_ids, err = asyncio.run(main())
    assert short and len(long_ids) > len(short)
    assert threads[0] is threading.main_thread()  # a short text: inline, cheaper than a thread hop
    assert threads[1] is not threading.main_thread() and threads[1].name.startswith("tokenize")
    assert len(threads) == 2  # the text past the bound was refused without encoding it
    assert err.status == 400 and err.code == "context_length_exceeded" and "characters" in err.message
