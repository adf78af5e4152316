"""Continuous batching over the prefix cache: admission, chunked prefill, decode and retraction.

Every step builds one batch: one new token for each decoding request, plus prompt pieces of
waiting requests admitted in policy order within the prefill budget (`PrefillAdder`). While a prompt
is mid-way through its chunks, it shares the step: everyone else takes up to
--chunked-prefill-reserve of the budget first, the long prompt's chunk the rest
(`_share_with_chunks`), so one long prompt holds nobody up for more than a step. A request
holds the tree path of its cached prefix locked and owns the slots of everything after it;
finished chunks and finished requests go back into the cache (`KVManager.cache_req`), so the next
request with the same prefix finds them. The scheduler knows the cache only as a `PrefixCache`
(cache/prefix_cache.py): the device tree, the tree with a host tier and the cache that keeps
nothing run the same code here.

Admission asks the cache about each waiting request it reaches (`PrefixCache.admit`): a request
whose prefix is partly on a lower tier has that part copied back while it waits (started as it
arrives, `WaitingView.admit_ahead`, and at the latest when admission reaches it), and admission
passes over it until the copy is done, so it holds up nobody. Which copies to start is the
cache's policy.

Overlap: the step before may still be in flight when a step is scheduled (`StepInFlight`).
Everything here then works on positions, not token values; the decisions that need the values
(stop tokens, stop strings) are taken when the step is collected, one step late, and a request
that finished at step N has its step N+1 token dropped. Retraction needs the values too: when
decode memory is short, `schedule` collects the step in flight before it retracts.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Optional

from radixserve.cache.admission import Admission
from radixserve.cache.kv_pool import ReqToTokenPool
from radixserve.cache.prefix_cache import PrefixCache, TreeNode
from radixserve.scheduler.batch import ScheduledBatch, StepInFlight
from radixserve.scheduler.kv_manager import KVManager
from radixserve.scheduler.prefill import PrefillAdder, QueueRoom
from radixserve.scheduler.request import Req, ReqState
from radixserve.scheduler.waiting_queue import WaitingQueue
from radixserve.sampling_params import FinishReason, TokenLogprob
from radixserve.settings import ServerSettings

# The share of their remaining output tokens that running requests are assumed to need adapts:
# it decays while decoding goes well and jumps back up when a retraction shows it was too low.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
# --prefix-hold-s holds every finished prefix while at least CONVERSATION_SHARE of the last
# CONVERSATION_WINDOW admitted requests continued a conversation (traffic that comes back for its
# prefixes); otherwise only the prefixes of the turns that did.
CONVERSATION_WINDOW = 256
CONVERSATION_SHARE = 0.25
# After an allocation failure the prompt tokens of a step are halved down to this, then the
# running requests are cut by a quarter; a step already that small fails its requests.
MIN_STEP_PREFILL_TOKENS = 256


@dataclass
class SchedulerStats:
    num_retractions: int = 0
    num_steps: int = 0
    num_decode_steps: int = 0
    admitted: int = 0
    in_batch_deferrals: int = 0
    # Admissions recognised as a later turn of a conversation, and finished prefixes held for
    # --prefix-hold-s: whether the hold engages shows here (and on /metrics).
    continued_turns: int = 0
    prefix_holds: int = 0
    # Steps the device could not allocate memory for (taken back and made smaller).
    alloc_failures: int = 0


class Scheduler:
    def __init__(self, settings: ServerSettings, cache: PrefixCache, req_to_token: ReqToTokenPool, *,
                 context_len: int, eos_token_ids: list[int], decode_text: Optional[Callable[[list[int]], str]] = None,
                 clock: Callable[[], float] = time.monotonic, device_type: str = "cuda"):
        self.settings = settings
        # Prompt tokens one piece may take (-1: no chunking); its default depends on the device.
        self.chunk_size = settings.resolved_chunked_prefill_size(device_type)
        self.cache = cache
        self.kv = KVManager(cache, req_to_token)
        self.req_to_token = req_to_token
        self.context_len = context_len
        self.eos_token_ids = set(eos_token_ids)
        self.decode_text = decode_text
        self.clock = clock
        self.max_running = req_to_token.max_requests  # one row of the table per running request
        self.waiting = WaitingQueue(cache, settings.schedule_policy,
                                    max_wait_s=settings.lpm_max_wait_s, clock=clock,
                                    seed=settings.random_seed)
        self.running: list[Req] = []
        self.reqs: dict[str, Req] = {}
        # SGLang's --schedule-conservativeness: scales how many future decode tokens are reserved.
        self._ratio_scale = settings.schedule_conservativeness
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO * self._ratio_scale
        self.stats = SchedulerStats()
        self._arrivals = 0
        # Prefixes of finished requests held for --prefix-hold-s: (release time, node), oldest first.
        self._held: deque[tuple[float, TreeNode]] = deque()
        # Whether each of the last CONVERSATION_WINDOW admitted requests continued a conversation,
        # and how many did.
        self._continued: deque[bool] = deque(maxlen=CONVERSATION_WINDOW)
        self._continued_count = 0
        # Requests the cache has not looked at yet for copies to start while they wait (cache.waiting.admit_ahead).
        self._arrivals_to_admit: deque[Req] = deque()
        # Lowered after an allocation failure: the prompt tokens one step may compute (None: the settings').
        self.prefill_cap: Optional[int] = None

    def reset_stats(self) -> None:
        """Forget what earlier requests taught (after the engine's warm-up)."""
        self.stats = SchedulerStats()
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO * self._ratio_scale

    # ------------------------------------------------------------------ intake
    def add_request(self, req: Req) -> None:
        if req.rid in self.reqs:
            raise ValueError(f"request id {req.rid!r} is already in use")
        req.arrival_seq = self._arrivals
        self._arrivals += 1
        self.reqs[req.rid] = req
        self._enqueue(req)

    def _enqueue(self, req: Req) -> None:
        self.waiting.add(req)
        self._arrivals_to_admit.append(req)

    def abort(self, rid: str) -> Optional[Req]:
        """Stop a request wherever it is; its computed KV stays in the tree. Returns it, if known."""
        req = self.reqs.get(rid)
        if req is None:
            return None
        if req.state is ReqState.WAITING:
            self.waiting.remove(req)
        elif req.state is ReqState.RUNNING:
            self.running.remove(req)
            self.kv.cache_req(req, finished=True)
        req.finish_reason = FinishReason("abort", message="aborted")
        req.state = ReqState.FINISHED
        del self.reqs[rid]
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def queue_room(self) -> QueueRoom:
        """The room the running batch has now for waiting and new requests (`--max-queued-requests`)."""
        rows = min(self.max_running - len(self.running), self.req_to_token.free_rows)
        return QueueRoom(self.kv, self.running, self.waiting, rows=rows, new_token_ratio=self.new_token_ratio)

    def held_by_running(self) -> int:
        return self.kv.owned_tokens(self.running)

    def check_invariants(self) -> None:
        self.kv.check_invariants(self.running)
        self._check_waiter_counts()

    def _check_waiter_counts(self) -> None:
        """Each node's waiter count is the waiting requests parked at or below it plus held prefixes."""
        expected: Counter = Counter()
        for node in [r.peek_node for r in self.waiting] + [node for _, node in self._held]:
            while node is not None and node.parent is not None:
                expected[node] += 1
                node = node.parent
        for node in self.cache.waiting.iter_nodes():
            assert node.waiters == expected[node], f"{node}: {node.waiters} waiters, expected {expected[node]}"

    # ------------------------------------------------------------------ prefix hold
    def _hold_prefix(self, req: Req) -> None:
        """Keep a finished request's prefix out of eviction and admission for --prefix-hold-s: under
        pressure, a conversation's next turn otherwise finds it evicted by a request that arrived
        during the turn's think time. A turn that continued a conversation is held; so is every
        request while the traffic is mostly conversations (CONVERSATION_SHARE), its first turns
        included. Traffic whose finished prompts nobody continues (one-off questions under shared
        system prompts) holds nothing: there it would only take memory from the batch."""
        if self.settings.prefix_hold_s <= 0:
            return
        if not (req.continues_conversation or self._continued_count >= CONVERSATION_SHARE * CONVERSATION_WINDOW):
            return
        found, node, _ = self.cache.waiting.peek_park(req.fill_ids, namespace=req.cache_namespace)
        if found:  # a cache that keeps nothing has nothing to hold
            self.cache.waiting.add_waiter(node)
            self._held.append((self.clock() + self.settings.prefix_hold_s, node))
            self.stats.prefix_holds += 1

    def release_expired_holds(self) -> bool:
        """Let go of the prefix holds whose time is up (each step does; an idle engine calls it
        too); whether any was."""
        now = self.clock()
        released = bool(self._held) and self._held[0][0] <= now
        while self._held and self._held[0][0] <= now:
            self.cache.waiting.remove_waiter(self._held.popleft()[1])
        return released

    # ------------------------------------------------------------------ the step
    def schedule(self, in_flight: Optional[StepInFlight] = None) -> Optional[ScheduledBatch]:
        """The next batch, or None when nothing can run. in_flight: the launched step whose tokens
        the host has not read yet; it is collected here when decode memory is short, because
        retraction needs every token on the host."""
        self._catch_up()
        decoding, chunked = self._split_running()
        fits = self._decode_fits(decoding)
        if not fits and in_flight is not None and not in_flight.collected:
            self.collect(in_flight)
            self._catch_up()
            decoding, chunked = self._split_running()  # the collected step may have finished some
            fits = self._decode_fits(decoding)
        batch = ScheduledBatch()
        self._schedule_decode(batch, decoding, fits)
        self._schedule_prefill(batch, in_flight, chunked)
        self.stats.num_steps += 1
        if not batch.reqs:
            return None
        if batch.is_decode_only:
            self.stats.num_decode_steps += 1
            self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO * self._ratio_scale,
                                       self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        self.kv.flush_table_writes()
        for req, samples in zip(batch.reqs, batch.sample):
            if samples:
                req.pending += 1
        return batch

    def _catch_up(self) -> None:
        """Drop expired prefix holds, take in the cache's finished copies and redo the waiting
        lookups the tree's changes affect."""
        self.release_expired_holds()
        self.cache.waiting.poll()
        self.waiting.refresh()

    # ------------------------------------------------------------------ decode
    def _split_running(self) -> tuple[list[Req], list[Req]]:
        """The running requests that decode this step, and those in the middle of a chunked
        prompt (more than one position left to compute), in running order. A request whose
        prompt is computed decodes unless a token still on the device is its last (max_new_tokens
        or the context length reached): no step after that one is needed."""
        decoding: list[Req] = []
        chunked: list[Req] = []
        for req in self.running:
            # Req.num_generated and Req.seq_len spelled out: this runs for every running request
            # every step, and the two property calls were half its time.
            generated = len(req.output_ids) + req.pending
            seq_len = len(req.origin_input_ids) + generated
            remaining = seq_len - req.kv_len
            if remaining > 1:
                chunked.append(req)
            elif remaining == 1 and not (req.pending and (
                    generated >= req.sampling_params.max_new_tokens or seq_len >= self.context_len)):
                decoding.append(req)
        return decoding, chunked

    def _decode_fits(self, decoding: list[Req]) -> bool:
        """Whether one more position for each decoding request fits (evicting the tree if needed)."""
        ps = self.kv.page_size
        new_pages = len(decoding) if ps == 1 else sum(1 for r in decoding if r.kv_len % ps == 0)
        if self.kv.ensure_free(new_pages * ps):
            return True
        # Validated at intake: a lone request always fits once everything else is evicted.
        return len(decoding) == 1 and len(self.running) == 1

    def _schedule_decode(self, batch: ScheduledBatch, decoding: list[Req], fits: bool) -> None:
        """Add the decoding requests to the batch, retracting some first while their next
        positions do not fit (fits: whether they do now)."""
        while not fits:
            self._retract_one(decoding)
            fits = self._decode_fits(decoding)
        batch.add_decode(decoding, self.kv.grow_decoding(decoding))

    def _retract_one(self, candidates: list[Req]) -> Req:
        # Cheapest to redo: least decoded output, then the longest prompt (most KV freed, and the
        # prompt part is likely still cached when it comes back).
        assert all(r.pending == 0 for r in candidates), "retraction needs every token on the host"
        victim = min(candidates, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        candidates.remove(victim)
        self.running.remove(victim)
        self.kv.cache_req(victim, finished=True, readmitted=True)
        victim.state = ReqState.WAITING
        victim.num_retractions += 1
        self.stats.num_retractions += 1
        self._enqueue(victim)
        self.new_token_ratio = min(1.0, max(INIT_NEW_TOKEN_RATIO * self._ratio_scale, self.new_token_ratio * 1.5))
        return victim

    # ------------------------------------------------------------------ prefill
    def _prefill_budget(self) -> int:
        s = self.settings
        budget = min(s.max_prefill_tokens, self.chunk_size) if self.chunk_size > 0 else s.max_prefill_tokens
        return budget if self.prefill_cap is None else min(budget, self.prefill_cap)

    def _schedule_prefill(self, batch: ScheduledBatch, in_flight: Optional[StepInFlight], chunked: list[Req]) -> None:
        """Prompt pieces after the decode rows. chunked: the running requests in the middle of a
        chunked prompt; they share the step with the others (`_share_with_chunks`), and while one
        is still mid-way after this step no other prompt starts beyond that share."""
        adder = PrefillAdder(self.kv, batch, budget=self._prefill_budget(),
                             chunking=self.chunk_size > 0, new_token_ratio=self.new_token_ratio,
                             min_shared_prefix=self.settings.in_batch_prefix_min_len)
        # Admission's memory arithmetic starts once, before any prompt piece of this step.
        busy = self._reserve(adder) if self._arrivals_to_admit or len(self.waiting) else False
        if self._arrivals_to_admit:  # copies start even in steps that admit nobody
            adder.available -= self.cache.waiting.admit_ahead(self._arrivals_to_admit, adder.available)
        defer_keys = in_flight.shared_prefix_keys if in_flight is not None else set()
        if chunked:
            # A waiting request whose next tokens a chunked prompt is computing waits for its chunks.
            defer_keys = defer_keys | {adder.continuation_key(r) for r in chunked}
            self._share_with_chunks(batch, adder, chunked, defer_keys, busy)
            if not all(batch.sample) or any(r.kv_len < r.seq_len for r in chunked):
                return  # a prompt is still mid-way: it goes on next step before anyone else starts
        if adder.budget > 0 and len(self.waiting):
            self._admit_waiting(batch, adder, defer_keys, busy)

    def _share_with_chunks(self, batch: ScheduledBatch, adder: PrefillAdder, chunked: list[Req],
                           defer_keys: set[tuple], busy: bool) -> None:
        """Split the step's budget between the prompt with the most left to compute (the long one)
        and everyone else. The others' share (--chunked-prefill-reserve of the budget) is served
        first: waiting prompts that fit whole in it (policy order), the other prompts mid-way, then,
        when no other is mid-way, one waiting prompt started in a piece of what is left. The long
        prompt's chunk takes the rest, less the decode rows while the share lasts: beside a long
        prompt a step computes at most the budget, and a short request is served in the next step
        instead of after every chunk (one 30,000-token prompt on the CPU once held a 2-token request
        for 140 s)."""
        budget = adder.budget
        share = int(budget * self.settings.chunked_prefill_reserve) if adder.chunking else 0
        if share <= 0:
            for req in chunked:
                adder.add_chunk(req)
            return
        decode_rows = len(batch.reqs)  # the decode rows are scheduled before any prompt piece
        longest = max(chunked, key=lambda r: (r.seq_len - r.kv_len, -r.arrival_seq))
        others = [r for r in chunked if r is not longest]
        adder.budget = share
        starter = self._admit_waiting(batch, adder, defer_keys, busy, whole_only=True) if len(self.waiting) else None
        for req in others:
            adder.add_chunk(req)
        # A longer prompt starts beside the long one only when the long one has more than this
        # step's budget left (else it would wait several steps); beside a long one about to finish
        # it starts next step with the whole budget. Starting it every time cost the simulated
        # agent workload with a host tier 0.02 of hit rate (more prompts mid-way, more eviction).
        if starter is not None and not others and adder.budget > 0 and self._has_row() \
                and longest.seq_len - longest.kv_len > budget and not adder.defers(starter[0], defer_keys):
            self._admit_one(batch, adder, *starter)
        others_took = share - adder.budget
        given = min(share, decode_rows + others_took)
        adder.budget = budget - given
        adder.add_chunk(longest)
        adder.budget += given - others_took  # past the long prompt's chunk, decode rows cost no budget

    def _admit_waiting(self, batch: ScheduledBatch, adder: PrefillAdder, defer_keys: set[tuple], busy: bool,
                       *, whole_only: bool = False) -> Optional[tuple[Req, Admission]]:
        """Admit waiting requests in policy order while the budget, the request rows and memory
        last; the first one admitted in part (a chunked prompt) is the last. whole_only: only those
        whose prompt fits whole in the budget; returns the first passed over for not fitting that
        could start instead (ready in the cache's view, not deferred) with its admission, or None."""
        starter = None
        for req in self.waiting.ordered():
            if adder.budget <= 0 or not self._has_row():
                break
            if whole_only and starter is not None and not adder.completes(req):
                continue  # neither admitted nor the starter: the cache is not asked about it
            admission = self.cache.admit(req, room=adder.available, spare_only=busy)
            adder.available -= admission.loading
            if admission.waits:
                continue  # more of its prefix is being copied in: others go first
            if whole_only and not adder.completes(req):
                if starter is None and admission.ready and not adder.defers(req, defer_keys, record=False):
                    starter = (req, admission)  # its key is recorded if it is admitted after all
                continue
            if adder.defers(req, defer_keys):
                self.stats.in_batch_deferrals += 1
                continue
            if not self._admit_one(batch, adder, req, admission):
                break
            if not batch.sample[-1]:
                break  # it became the chunked request: one at a time
        return starter

    def _has_row(self) -> bool:
        """Whether one more request may run (--max-running-requests, and a free req_to_token row)."""
        return len(self.running) < self.max_running and self.req_to_token.free_rows > 0

    def _admit_one(self, batch: ScheduledBatch, adder: PrefillAdder, req: Req, admission: Admission) -> bool:
        """Admit one waiting request with its first prompt piece (on the cache's admission of it);
        False (it waits on) when its memory does not fit."""
        branch_at = self.waiting.shared_with_sibling(req)
        self.waiting.remove(req)
        if not adder.try_add_one(req, admission, alone=not self.running and not batch.reqs, branch_at=branch_at):
            self.waiting.add(req)
            return False
        self._admit(req)
        batch.admitted.append(req)
        return True

    def _reserve(self, adder: PrefillAdder) -> bool:
        """Start admission's memory arithmetic; returns whether running requests fill half the pool.
        Queue-aware admission: while they do, prefixes that waiting requests (or a held, just-finished
        conversation) will reuse are no room for a new request; below that, a full batch comes first."""
        busy = self.cache.memory.protected + self.held_by_running() >= self.kv.allocator.total_tokens // 2
        adder.reserve_for(self.running, spare_waited=not busy)
        return busy

    def _admit(self, req: Req) -> None:
        if req.cached_tokens < 0:  # first admission (not a retracted request coming back)
            req.cached_tokens = req.locked_len
            req.continues_conversation = self.cache.conversations.extends_a_prompt(
                req.last_node, uncached=len(req.origin_input_ids) - req.locked_len)
            if len(self._continued) == CONVERSATION_WINDOW:
                self._continued_count -= self._continued[0]  # about to drop out of the window
            self._continued.append(req.continues_conversation)
            self._continued_count += req.continues_conversation
            self.stats.continued_turns += req.continues_conversation
            req.admission.commit(len(req.origin_input_ids))  # the cache counts its hits
        req.state = ReqState.RUNNING
        req.admitted_time = req.admitted_time or self.clock()
        self.running.append(req)
        self.stats.admitted += 1

    # ------------------------------------------------------------------ allocation failures
    def take_back(self, batch: ScheduledBatch) -> None:
        """Undo a scheduled batch whose launch failed (the device could not allocate its working
        memory), before the step in flight is collected: each request's positions go back to where
        they were, so no position the batch may have half computed reaches the tree, and the
        requests it admitted wait again."""
        for req, before, samples in zip(batch.reqs, batch.kv_lens_before, batch.sample):
            if samples:
                req.pending -= 1
            self.kv.shrink(req, before)
        for req in batch.admitted:
            self.running.remove(req)
            self.kv.cache_req(req, finished=True, readmitted=True)
            req.state = ReqState.WAITING
            self._enqueue(req)

    def restart(self, reqs: list[Req]) -> None:
        """Send the running ones of these requests back to wait, to be computed again from the
        deepest state the cache kept of them (a model whose per-request state cannot be rewound:
        its failed step may have advanced it; the cache was told to keep nothing more of it, see
        RequestStates.discard_states). Every token must be on the host."""
        for req in reqs:
            if req.state is ReqState.RUNNING and req in self.running:
                self._retract_one([req])

    def shrink_steps(self, batch: ScheduledBatch) -> tuple[str, list[Req]]:
        """After `take_back` (and with every token on the host): make steps like the failed one
        smaller. Halves the prompt tokens per step while the batch had more than
        MIN_STEP_PREFILL_TOKENS, else runs a quarter fewer requests (retracting the rest). Returns
        what changed and, when the batch was already one small request, the requests that fail."""
        self.stats.alloc_failures += 1
        if batch.num_new_tokens > MIN_STEP_PREFILL_TOKENS and (self.prefill_cap or batch.num_new_tokens) > \
                MIN_STEP_PREFILL_TOKENS:
            cap = max(MIN_STEP_PREFILL_TOKENS, self.kv.page_floor(batch.num_new_tokens // 2) or self.kv.page_size)
            self.prefill_cap = cap
            return f"prompt tokens per step lowered to {cap}", []
        if len(batch.reqs) > 1:
            self.max_running = max(1, len(batch.reqs) * 3 // 4)
            while len(self.running) > self.max_running:
                self._retract_one(list(self.running))
            return f"running requests lowered to {self.max_running}", []
        failed = [r for r in batch.reqs if r.state is not ReqState.FINISHED]
        for req in failed:
            if req.state is ReqState.WAITING:  # admitted by the failed step, queued again by take_back
                self.waiting.remove(req)
            else:
                self.running.remove(req)
                self.kv.cache_req(req, finished=True)
            req.finish_reason = FinishReason("abort", message="the device ran out of memory for this request")
            req.state = ReqState.FINISHED
            del self.reqs[req.rid]
        return "a one-request step failed: its request ends with an error", failed

    # ------------------------------------------------------------------ results
    def collect(self, step: StepInFlight) -> list[Req]:
        """Wait for a launched step's tokens and process them (once); the requests with news."""
        if step.updated is None:
            ids = step.tokens.result()
            step.updated = self.process_results(step.batch, ids, step.tokens.logprobs(),
                                                step.tokens.prompt_logprobs())
        return step.updated

    def process_results(self, batch: ScheduledBatch, next_token_ids: list[int],
                        logprobs: Optional[list[Optional[TokenLogprob]]] = None,
                        prompt_logprobs: Optional[list[list[TokenLogprob]]] = None) -> list[Req]:
        """Append sampled tokens (and their log probabilities, where asked for, and the prompt
        log probabilities the step gathered), finish what is done; returns the requests with news
        for the caller."""
        now = self.clock()
        updated: list[Req] = []
        sampled = iter(next_token_ids)
        sampled_logprobs = iter(logprobs) if logprobs is not None else None
        gathered = iter(prompt_logprobs) if prompt_logprobs is not None else None
        for req, samples, extend in zip(batch.reqs, batch.sample, batch.extend_lens):
            token = next(sampled) if samples else None
            token_logprob = next(sampled_logprobs) if samples and sampled_logprobs is not None else None
            prompt_entries = next(gathered) if gathered is not None else None
            if req.state is not ReqState.RUNNING:
                continue  # finished or aborted after this step was built: its token is dropped
            if prompt_entries:
                req.input_logprobs.extend(prompt_entries)
            if samples:
                req.pending -= 1
                req.output_ids.append(token)
                if token_logprob is not None:
                    req.output_logprobs.append(token_logprob)
            if not samples or extend > 1:
                # A finished chunk or a just-finished prompt goes into the tree at once, so
                # requests sharing its prefix (deferred in-batch ones above all) find it cached.
                self.kv.cache_req(req, finished=False)
            if not samples:
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            reason = self._finish_reason(req, token)
            if reason is not None:
                req.finish_reason = reason
                self.running.remove(req)
                locked = (req.last_node, req.locked_len)  # cache_req lets go of them
                self.kv.cache_req(req, finished=True)
                self.cache.conversations.mark_prompt_end(req.origin_input_ids, beyond=req.cached_tokens,
                                                         locked=locked, namespace=req.cache_namespace)
                self._hold_prefix(req)
                req.state = ReqState.FINISHED
                del self.reqs[req.rid]
            updated.append(req)
        if not self.has_work:
            self.check_invariants()  # cheap when idle, and it catches any leak at once
        return updated

    def _finish_reason(self, req: Req, token: int) -> Optional[FinishReason]:
        """Why req ends with the token it just sampled (appended), or None if it goes on: the
        grammar, min_new_tokens, stop and end-of-sequence ids, stop strings, the length."""
        params = req.sampling_params
        if req.grammar is not None:
            if not req.grammar.accept(token):  # masked sampling never picks one; a bug if it does
                return FinishReason("abort", message=f"token {token} is not allowed by the request's grammar")
            if req.grammar.terminated:
                return FinishReason("stop", matched=token)
        if len(req.output_ids) < params.min_new_tokens:
            # Stop tokens are masked until then; stop strings are not looked for either (vLLM's rule).
            return self._length_reason(req)
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return FinishReason("stop", matched=token)
        if params.stop and self.decode_text is not None:
            longest = max(len(s) for s in params.stop)
            tail = self.decode_text(req.output_ids[-(longest + 8):])
            for stop in params.stop:
                if stop in tail:
                    return FinishReason("stop", matched=stop)
        return self._length_reason(req)

    def _length_reason(self, req: Req) -> Optional[FinishReason]:
        n = len(req.output_ids)
        if n >= req.sampling_params.max_new_tokens or len(req.origin_input_ids) + n >= self.context_len:
            return FinishReason("length", length=n)
        return None
