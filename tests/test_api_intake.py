"""How the API process takes in a burst: at most a few requests begin per event-loop iteration,
the engine messages of an iteration travel as one ZMQ message, and a burst of long token-id
prompts is served whole by a real server."""

from __future__ import annotations

import asyncio
import collections
import socket

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from conftest import ServerProcess
from radixserve.engine.messages import AbortRequest, GenerateRequest
from radixserve.http_common.errors import _validation_error
from radixserve.sampling_params import SamplingParams
from radixserve.engine import messages as m
from radixserve.http_common.paced_http import IterationGate
from radixserve.server.intake import MsgspecJSONRequest
from radixserve.server.protocol import CompletionRequest, GenerateBody
from radixserve.settings import ServerSettings

pytestmark = pytest.mark.timeout(300)


async def runs_per_iteration(per_iteration: int, callbacks: int) -> tuple[list[int], list[int]]:
    """How many of `callbacks` handed to the gate together ran in each iteration, and their order."""
    gate = IterationGate(per_iteration)
    iteration, running = 0, True

    def count_iterations() -> None:  # runs once per iteration: call_soon callbacks wait for the next
        nonlocal iteration
        iteration += 1
        if running:
            asyncio.get_running_loop().call_soon(count_iterations)

    asyncio.get_running_loop().call_soon(count_iterations)
    ran: list[tuple[int, int]] = []
    for i in range(callbacks):
        gate.call(lambda i=i: ran.append((i, iteration)))
    while len(ran) < callbacks:
        await asyncio.sleep(0)
    running = False
    return list(collections.Counter(it for _, it in ran).values()), [i for i, _ in ran]


def test_the_gate_runs_a_few_callbacks_per_iteration_all_of_them_in_order():
    counts, order = asyncio.run(runs_per_iteration(4, 50))
    assert sum(counts) == 50 and max(counts) <= 4, counts
    assert order == list(range(50))
    assert asyncio.run(runs_per_iteration(16, 5))[0] == [5]  # a few run at once, in their own iteration


def test_a_failing_callback_does_not_stop_the_ones_behind_it():
    async def run() -> list[int]:
        gate = IterationGate(1)
        ran: list[int] = []

        def fail() -> None:
            raise RuntimeError("a callback failed")

        asyncio.get_running_loop().set_exception_handler(lambda loop, context: None)  # the loop logs it
        gate.call(lambda: ran.append(0))
        gate.call(fail)
        gate.call(lambda: ran.append(2))
        for _ in range(10):
            await asyncio.sleep(0)
        return ran

    assert asyncio.run(run()) == [0, 2]


def test_messages_of_one_kind_travel_together_in_order():
    params = SamplingParams(max_new_tokens=2)
    sent = [GenerateRequest(rid="a", input_ids=[1, 2], sampling_params=params), AbortRequest(rid="x"),
            GenerateRequest(rid="b", input_ids=[3], sampling_params=params),
            GenerateRequest(rid="c", input_ids=[4, 5, 6], sampling_params=params)]
    zmq_messages = m.batched([m.encode(msg) for msg in sent])
    assert [len(frames) for frames in zmq_messages] == [2, 2, 3]  # a, the abort, b and c together
    received = [m.decode(one) for frames in zmq_messages for one in m.unbatched(frames)]
    assert received == sent
    with pytest.raises(ValueError):
        m.decode(m.unbatched([b"NoSuchKind", b"\x80"])[0])


def test_long_token_id_lists_are_checked_as_before():
    ids = list(range(2176))
    assert CompletionRequest.model_validate({"prompt": ids}).prompt == ids
    assert GenerateBody.model_validate({"input_ids": [ids, [7.0]]}).input_ids == [ids, [7]]  # 7.0 is an integer
    for bad, why in (([*ids, True], "a valid integer"), ([*ids, -1], "greater than or equal to 0"),
                     ([*ids, 2 ** 31], "less than or equal to 2147483647"), ([*ids, 1.5], "a valid integer")):
        with pytest.raises(ValidationError) as e:
            CompletionRequest.model_validate({"prompt": bad})
        errors = [{**error, "loc": ("body", *error["loc"])} for error in e.value.errors()]
        message, param, _ = _validation_error(RequestValidationError(errors))
        assert param == "prompt[2176]" and why in message, message


def test_json_bodies_parse_as_the_json_module_parses_them():
    async def parse(body: bytes):
        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}
        return await MsgspecJSONRequest({"type": "http", "method": "POST", "headers": []}, receive).json()

    for body, expected in ((b'{"a": [1, 2.5, "x"], "a": 3}', {"a": 3}), (b'[1e400]', [float("inf")]),
                           (b'"a\\ud800b"', "a\ud800b"), (b'\xef\xbb\xbf[1]', [1])):
        assert asyncio.run(parse(body)) == expected
    nan = asyncio.run(parse(b'[NaN]'))[0]
    assert nan != nan
    with pytest.raises(ValueError):
        asyncio.run(parse(b'[1]x'))
    assert msgspec.json.decode(b'[1]') == [1]


def engine_outputs_into(client) -> tuple[zmq.asyncio.Context, zmq.asyncio.Socket]:
    """Real ZMQ sockets in place of the engine process: what is sent on the returned PUSH socket
    reaches `client`'s reader as the engine's messages do. Close with `ctx.destroy(0)`."""
    ctx = zmq.asyncio.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://engine-outputs")
    push.connect("inproc://engine-outputs")
    client._pull = pull
    return ctx, push


def test_engine_messages_waiting_together_reach_each_request_merged():
    """Engine messages (steps) already waiting when the API reads are routed as one: a request's
    outputs of those steps reach it merged (one event to write), outputs before an error first,
    control replies answered, a finished request nobody waits for reported. Over real ZMQ sockets,
    the messages sent before the reader runs."""
    from radixserve.engine.messages import RequestOutput
    from radixserve.server.engine_client import EngineClient, RequestGroup

    def out(rid: str, *ids: int, **kw) -> RequestOutput:
        return RequestOutput(rid=rid, new_token_ids=list(ids), **kw)

    async def scenario() -> tuple[list, list, list, m.ControlReply, list]:
        client = EngineClient(ServerSettings())  # never started: aborts go nowhere
        ctx, push = engine_outputs_into(client)
        a, b = RequestGroup(client, ["a"]), RequestGroup(client, ["b"])
        client.groups.update(a=a, b=b)
        reply = asyncio.get_running_loop().create_future()
        client.replies["r1"] = reply
        untracked: list = []
        client.on_untracked_finish = untracked.append
        steps = [m.OutputBatch(outputs=[out("a", 1, ttft=0.5), out("b", 7)]),
                 m.ControlReply(reply_id="r1", ok=True),
                 m.OutputBatch(outputs=[out("a", 2), out("gone", 9, finished=True)]),
                 m.OutputBatch(outputs=[out("a", 3, finished=True, completion_tokens=3), out("b", 8)],
                               errors=[m.RequestError(rid="b", message="bad b")])]
        for msg in steps:
            await push.send_multipart(m.encode(msg))
        await asyncio.sleep(0.05)  # all four are waiting before the reader starts
        reader = asyncio.create_task(client._receive_loop())
        got_a = [o async for o in a.outputs()]
        got_b = [b.queue.get_nowait() for _ in range(b.queue.qsize())]
        reader.cancel()
        ctx.destroy(0)
        return got_a, got_b, untracked, reply.result(), list(client.groups)

    got_a, got_b, untracked, reply, groups = asyncio.run(scenario())
    assert [(o.new_token_ids, o.finished, o.ttft, o.completion_tokens) for o in got_a] == [([1, 2, 3], True, 0.5, 3)]
    assert [o.new_token_ids for o in got_b[:-1]] == [[7]] and str(got_b[-1]) == "bad b"  # b's step 4 is cut
    assert [o.rid for o in untracked] == ["gone"] and reply.ok and groups == []


def test_a_backlog_of_engine_outputs_is_decoded_over_short_iterations():
    """An API that fell behind reads many steps' outputs at once; decoding and merging them all in
    one event-loop iteration held every other stream and request for tens of milliseconds. The
    backlog is decoded at most OUTPUTS_DECODED_PER_ITERATION outputs per iteration, then handed
    out OUTPUTS_PER_ITERATION per iteration, and still reaches each request as one merged output."""
    from radixserve.engine.messages import RequestOutput
    from radixserve.server import engine_client as ec

    steps, rids = ec.MESSAGES_PER_READ, [f"r{i}" for i in range(1024)]

    async def scenario() -> tuple[int, int, list]:
        client = ec.EngineClient(ServerSettings())  # never started
        ctx, push = engine_outputs_into(client)
        groups = [ec.RequestGroup(client, [rid]) for rid in rids]
        client.groups.update(zip(rids, groups))
        for step in range(steps):
            await push.send_multipart(m.encode(m.OutputBatch(outputs=[
                RequestOutput(rid=rid, new_token_ids=[step], finished=step == steps - 1) for rid in rids])))
        await asyncio.sleep(0.05)  # the whole backlog is waiting before the reader starts
        reader = asyncio.create_task(client._receive_loop())
        iterations = iterations_before_first = 0
        while not all(g.queue.qsize() for g in groups):
            await asyncio.sleep(0)
            iterations += 1
            if not iterations_before_first and any(g.queue.qsize() for g in groups):
                iterations_before_first = iterations
        got = [g.queue.get_nowait() for g in groups]
        reader.cancel()
        ctx.destroy(0)
        return iterations_before_first, iterations, got

    before_first, total, got = asyncio.run(scenario())
    decoding = steps * len(rids) // ec.OUTPUTS_DECODED_PER_ITERATION
    assert before_first >= decoding - 1, (before_first, decoding)
    assert total - before_first >= len(rids) // ec.OUTPUTS_PER_ITERATION - 1
    assert all(o.new_token_ids == list(range(steps)) and o.finished for o in got)


def test_a_burst_of_long_token_id_prompts_is_served_whole(server_model_dir, server_workdir):
    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--max-total-tokens", "32768"],
                         server_workdir)
    try:
        proc.wait_ready()
        shared = [(7 * i) % 500 for i in range(1000)]

        async def burst():
            async with httpx.AsyncClient(base_url=proc.base_url, timeout=120,
                                         limits=httpx.Limits(max_connections=None)) as http:
                generate = [http.post("/generate", json={"input_ids": shared + [i], "stream": True,
                                                         "sampling_params": {"max_new_tokens": 2}})
                            for i in range(40)]
                complete = [http.post("/v1/completions", json={"prompt": shared + [i], "max_tokens": 2})
                            for i in range(40)]
                bad = [http.post("/v1/completions", json={"prompt": shared + [-1], "max_tokens": 2})]
                return await asyncio.gather(*generate, *complete, *bad)

        answers = asyncio.run(burst())
        assert [r.status_code for r in answers] == [200] * 80 + [400]
        # Two requests written at once on one connection (pipelined): the paced HTTP protocol
        # parses a connection's later bytes after its earlier ones, so both are answered, in order.
        body = b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}'
        first = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body)) + body
        second = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        with socket.create_connection(("127.0.0.1", proc.port), timeout=60) as sock:
            sock.sendall(first + second)
            raw = b""
            while chunk := sock.recv(65536):
                raw += chunk
        assert raw.count(b"HTTP/1.1 200") == 2, raw[:500]
        assert 0 < raw.index(b'"text"') < raw.index(b'"data"'), raw[:500]
        assert all(r.text.endswith("data: [DONE]\n\n") for r in answers[:40])
        assert all(r.json()["usage"]["prompt_tokens"] == 1001 for r in answers[40:80])
        assert answers[80].json()["error"]["param"] == "prompt[1000]"
    finally:
        proc.stop()
