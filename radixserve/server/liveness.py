"""Whether the engine is alive, judged in the API process from the engine's heartbeats
(`radixserve.engine.heartbeat`) without asking the engine anything: what `/health` answers.

Green while heartbeats arrive and the engine loop's current iteration (a step, when it has work) is
younger than --health-stall-timeout-s, however busy the engine is; red when the process sent no beat
for HEARTBEAT_SILENCE_S (stopped, or stuck holding the interpreter lock) or its loop has been in one
step too long (wedged). A dead process is the watchdog's (`EngineClient._watchdog`). Probing with a
request instead made /health wait behind every step: one 30,000-token prompt on the CPU (35 s steps)
turned it red three times while the engine was merely busy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from radixserve.engine.messages import EngineHeartbeat

# Ten missed beats (one every 0.5 s): a thread that is only starved of a loaded machine's CPU for a
# few seconds is not a dead engine.
HEARTBEAT_SILENCE_S = 10.0


@dataclass(frozen=True)
class Liveness:
    ok: bool
    reason: str  # why not, "" when ok
    busy: bool  # the engine had requests to step at its last beat
    loop_s: float  # seconds the engine loop has been in its current iteration (a step, when busy)
    silence_s: float  # seconds since the last beat arrived (since the engine was ready, before one did)
    steps: int  # steps the engine has finished


def judge(beat: Optional[EngineHeartbeat], silence_s: float, stall_timeout_s: float) -> Liveness:
    """Liveness from the latest beat (None: none yet) that arrived `silence_s` seconds ago."""
    busy = beat.busy if beat is not None else False
    steps = beat.steps if beat is not None else 0
    # As the beat reported it (at most a beat old): a stopped process is told by its silence.
    loop_s = beat.loop_s if beat is not None else 0.0
    silence_limit = min(HEARTBEAT_SILENCE_S, stall_timeout_s)
    if silence_s > silence_limit:
        reason = (f"the engine process sent no heartbeat for {silence_s:.1f} s (it beats every 0.5 s): it is "
                  "stopped or stuck")
        return Liveness(False, reason, busy, loop_s, silence_s, steps)
    if loop_s > stall_timeout_s:
        reason = (f"the engine loop has been in one step for {loop_s:.1f} s, over --health-stall-timeout-s "
                  f"{stall_timeout_s:g}: it is wedged")
        return Liveness(False, reason, busy, loop_s, silence_s, steps)
    return Liveness(True, "", busy, loop_s, silence_s, steps)
