"""The engine's heartbeat and the liveness /health reads from it: green while the engine loop's
steps end, however long each takes within the stall timeout; red when the beats stop (a stopped
or stuck process) or the loop has been in one step too long (wedged). The server-level checks are
in test_long_prompt_server.py."""

from __future__ import annotations

import os

import pytest
import zmq

from radixserve.engine import messages as m
from radixserve.engine.heartbeat import Heartbeat, LoopPulse
from radixserve.server.liveness import HEARTBEAT_SILENCE_S, judge


def beat(loop_s: float, *, busy: bool = True, steps: int = 7) -> m.EngineHeartbeat:
    return m.EngineHeartbeat(pid=1, steps=steps, busy=busy, loop_s=loop_s)


def test_a_busy_engine_whose_steps_end_is_alive():
    state = judge(beat(35.0), silence_s=0.4, stall_timeout_s=60.0)  # a 35 s CPU step, beats arriving
    assert state.ok and state.busy and state.loop_s == 35.0 and state.steps == 7 and state.reason == ""
    assert judge(None, silence_s=2.0, stall_timeout_s=60.0).ok  # ready, first beat not in yet


def test_a_loop_in_one_step_past_the_stall_timeout_is_wedged():
    state = judge(beat(61.0), silence_s=0.1, stall_timeout_s=60.0)
    assert not state.ok and "wedged" in state.reason and "61.0 s" in state.reason


@pytest.mark.parametrize("stall_timeout_s", [60.0, 4.0])
def test_silence_past_ten_seconds_or_the_stall_timeout_is_a_stopped_engine(stall_timeout_s):
    limit = min(HEARTBEAT_SILENCE_S, stall_timeout_s)
    assert judge(beat(0.01, busy=False), silence_s=limit - 0.1, stall_timeout_s=stall_timeout_s).ok
    state = judge(beat(0.01, busy=False), silence_s=limit + 0.1, stall_timeout_s=stall_timeout_s)
    assert not state.ok and "no heartbeat" in state.reason
    assert not judge(None, silence_s=limit + 0.1, stall_timeout_s=stall_timeout_s).ok


def test_the_heartbeat_thread_reports_the_loop_while_the_loop_is_inside_a_step(tmp_path):
    now = [100.0]
    pulse = LoopPulse(clock=lambda: now[0])
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    addr = f"ipc://{tmp_path}/from_engine"
    pull.bind(addr)
    heartbeat = Heartbeat(ctx, addr, pulse, interval_s=0.02).start()
    try:
        def next_beat() -> m.EngineHeartbeat:
            assert pull.poll(5000), "no heartbeat within 5 s"
            msg = m.decode(pull.recv_multipart())
            assert isinstance(msg, m.EngineHeartbeat)
            return msg

        first = next_beat()
        assert first.pid == os.getpid() and first.steps == 0 and not first.busy
        pulse.beat(busy=True)
        pulse.steps = 3
        now[0] += 12.5  # the loop has been inside this step for 12.5 s; the thread still beats
        while (msg := next_beat()).loop_s != 12.5:
            pass
        assert msg.busy and msg.steps == 3
    finally:
        heartbeat.stop()
        pull.close(0)
        ctx.term()  # returns only once the thread closed its socket
