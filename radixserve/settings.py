"""All settings in one typed dataclass; the command line is generated from it.

SGLang's flag names are the canonical spellings; the seed article's spellings
(`--chunk-prefill-size`, `--radix-cache-policy`, `--mem-fraction`) are aliases.
The offline `Engine(**settings)` takes the same names with underscores.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar

from radixserve.kv_events_config import KvEventsConfig, parse_kv_events_config

SCHEDULE_POLICIES = ("lpm", "fcfs", "lof", "random", "dfs-weight")
EVICTION_POLICIES = ("lru", "lfu", "fifo")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
HICACHE_WRITE_POLICIES = ("write_back", "write_through")
STORAGE_BACKENDS = ("file", "redis")
# The storage tier's records are pages: smaller ones make a disk read (and an index entry) per few tokens.
STORAGE_MIN_PAGE_SIZE = 16
# Defaults that depend on the device the engine runs on.
DEFAULT_MAX_RUNNING_REQUESTS = {"cuda": 1024, "cpu": 256}
# A chunk's step costs its tokens times the context they attend to: on the CPU an 8,192-token chunk
# deep into a 30,000-token prompt took 15-43 s a step (one long prompt then held every other request
# that long), a 1,024-token chunk ~2.8 s, and the whole prompt took 48 s instead of 107 s.
DEFAULT_CHUNKED_PREFILL_SIZE = {"cuda": 8192, "cpu": 1024}
CPU_KV_POOL_TOKENS = 65536
# Recurrent-state snapshots a hybrid model's prefix cache keeps on the CPU without --mamba-cache-size.
CPU_MAMBA_CACHE_SIZE = 64
# Rows up to which projections run the weight-streaming Triton GEMM instead of cuBLAS: faster up to
# 32 rows on an H200; at 64, cuBLAS won on most projections (docs/runs/2026-12-01-decode-row-gemm.md).
# The model's default too.
DECODE_GEMM_MAX_ROWS = 32


def option(default: Any, help: str, *, aliases: tuple[str, ...] = (), choices: tuple[str, ...] | None = None,
           cli: bool = True, metavar: Optional[str] = None, show_default: bool = True, repeat: bool = False) -> Any:
    """A settings dataclass field with what `add_settings_arguments` makes its command-line flag of:
    `help`, `aliases`, `choices`, `metavar`; `cli=False` for a field with no flag; `show_default=False`
    for a help whose prose says what happens without the flag (a "(default: ...)" in the help needs
    nothing: it is never added twice). A `tuple[str, ...]` field takes any number of values after
    its flag, or with `repeat` one value per flag, the flag given several times."""
    return field(default=default, metadata={"help": help, "aliases": aliases, "choices": choices, "cli": cli,
                                            "metavar": metavar, "show_default": show_default, "repeat": repeat})


_opt = option  # the short spelling of ServerSettings' many fields


@dataclass
class ServerSettings:
    # --- model -------------------------------------------------------------
    model_path: Optional[str] = _opt(
        None, "Hugging Face model directory (config.json + *.safetensors) (default: the built-in tiny "
        "random Qwen2, built on first use in ~/.cache/radixserve/tiny-qwen2: a CPU demo).")
    tokenizer_path: Optional[str] = _opt(None, "Tokenizer directory (default: --model-path).")
    chat_template: Optional[str] = _opt(
        None, "A Jinja chat template file used instead of the tokenizer's (for models whose template "
        "does not render `tools`), or a built-in one by name: qwen3 (Qwen3's prompt format, with "
        "keep_reasoning; see --keep-reasoning-history).")
    reasoning_parser: Optional[str] = _opt(
        None, "Split a chat reply's <think>...</think> reasoning from its answer: message.reasoning_content "
        "and content, streamed as delta.reasoning_content then delta.content (vLLM's and SGLang's shape); "
        "qwen3 reads Qwen3's tags (also when the template opens <think> in the prompt). A request's "
        "separate_reasoning: false turns it off for that request. (default: off; replies as the model wrote "
        "them)", choices=("qwen3",))
    keep_reasoning_history: bool = _opt(
        False, "Render earlier assistant turns with their reasoning as generated (the template variable "
        "keep_reasoning; a request's chat_template_kwargs may set it either way): Qwen3's template drops it, "
        "so each turn's prompt stops matching the cached conversation at the previous reply. Needs a "
        "template that reads keep_reasoning, e.g. --chat-template qwen3 (docs/tuning.md).")
    grammar_in_reasoning: bool = _opt(
        False, "With --reasoning-parser, a chat reply's grammar (response_format, regex, ebnf, a forced tool "
        "call) holds from its first token, the reasoning included (vLLM's structured outputs "
        "enable_in_reasoning). (default: the reasoning is free text and the grammar starts after </think>; "
        "docs/structured_outputs.md)")
    chat_template_timeout_s: float = _opt(
        5.0, "Longest a chat template may take to render one request; longer is a 400 (template_limit).")
    load_format: str = _opt("auto", "auto: read safetensors; dummy: random weights from config.json alone.",
                            choices=("auto", "safetensors", "dummy"))
    trust_remote_code: bool = _opt(
        False, "Accepted for compatibility with SGLang/vLLM command lines. Every supported model runs on "
        "built-in code, so no code from the model directory is ever executed.")
    served_model_name: Optional[str] = _opt(
        None, "Model name reported by /v1/models and accepted in requests' model field (default: the model "
        "directory's name, e.g. tiny-qwen2).")
    context_length: Optional[int] = _opt(
        None, "Longest sequence (prompt + output) in tokens (default: the model's max_position_embeddings); "
        "more than the model's is refused unless --allow-longer-context-length is given.")
    allow_longer_context_length: bool = _opt(
        False, "Let --context-length exceed the model's max_position_embeddings (as SGLang's "
        "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN does): the rotary table is extended without scaling, so "
        "positions past the model's were never trained on and outputs there may be garbage.")
    dtype: str = _opt("auto", "Weight and activation dtype (auto: bfloat16 on CUDA, float32 on CPU).",
                      choices=("auto", "float32", "float16", "bfloat16"))
    device: str = _opt("auto", "auto: cuda when present, else cpu.", choices=("auto", "cpu", "cuda"))
    quantization: Optional[str] = _opt(
        None, "fp8: quantize a bf16/fp16/fp32 checkpoint's projections to FP8 (e4m3) as it loads, one scale "
        "per output channel, activations scaled per token (the embedding and lm_head stay in --dtype). An "
        "FP8 checkpoint (quantization_config quant_method fp8, per-tensor or block-wise, or compressed-tensors "
        "float8) loads as FP8 without this flag; any other quantization_config (awq, gptq, ...) is refused. (default: none)",
        choices=("fp8",))
    kv_cache_dtype: str = _opt(
        "auto", "KV cache dtype. auto: --dtype; fp8_e4m3: one byte per value with per-layer k/v scales (the "
        "checkpoint's k_scale/v_scale where it has them, else 1.0), so the same memory holds twice the "
        "tokens of a bf16 cache.", choices=KV_CACHE_DTYPES)
    mamba_ssm_dtype: str = _opt(
        "float32", "Hybrid models (Qwen3.5, Qwen3-Next): the dtype of each running request's linear-attention "
        "states (per layer [value heads, 128, 128]; 151 MiB a request for Qwen3.5-27B in float32). bfloat16 "
        "halves them (the kernels still compute in float32; each step rounds the state once).",
        choices=("float32", "bfloat16"))
    mamba_cache_size: Optional[int] = _opt(
        None, "Hybrid models: how many recurrent-state snapshots the prefix cache keeps (one per cached "
        "position a later request can resume from: a conversation's end, a shared prompt's branch point; "
        "each the size of one running request's states, in --mamba-ssm-dtype). Their own pool, beside the "
        "running requests' states and the KV pool. Default: one per 1,024 tokens of the KV pool (on CUDA "
        "the memory the plan leaves for the pool is split between the two so); on the CPU "
        f"{CPU_MAMBA_CACHE_SIZE}. 0: none, and no prefix is reused for these models.")
    random_seed: int = _opt(0, "Seed for dummy weights and for sampling without a per-request seed.")

    # --- KV memory ---------------------------------------------------------
    page_size: int = _opt(1, "Tokens per KV page; the allocator and the radix cache work in whole pages.")
    max_total_tokens: Optional[int] = _opt(
        None, "KV pool size in tokens (default: what --mem-fraction-static of GPU memory holds after "
        f"the weights; on the CPU {CPU_KV_POOL_TOKENS}).")
    mem_fraction_static: float = _opt(0.85, "Fraction of GPU memory for the weights, the KV pool and the working set of the "
                                      "largest step (measured at start-up; see docs/tuning.md).",
                                      aliases=("--mem-fraction",))

    # --- radix cache -------------------------------------------------------
    radix_eviction_policy: str = _opt("lru", "Which unlocked leaves of the radix tree are evicted first.",
                                      aliases=("--radix-cache-policy",), choices=EVICTION_POLICIES)
    disable_radix_cache: bool = _opt(False, "Reuse nothing: every request computes its whole prompt and "
                                     "frees its KV at finish.")
    hicache_size: float = _opt(
        0.0, "Host-memory tier under the radix cache, in GB (pinned on CUDA): prefixes evicted from the "
        "device pool are copied here and copied back when a request needs them, instead of being computed "
        "again. 0 (default): off. With --tp-size, per rank (each rank keeps its own KV shard there); with "
        "--dp-size, per worker.")
    hicache_ratio: float = _opt(
        0.0, "The host tier's size as a multiple of the device KV pool (e.g. 4); an alternative to "
        "--hicache-size. 0 (default): off.")
    hicache_write_policy: str = _opt(
        "write_back", "When the host tier gets a copy: write_back (when the device evicts the prefix) or "
        "write_through (as soon as it is cached on the device, so eviction needs no copy).",
        choices=HICACHE_WRITE_POLICIES)
    mamba_host_cache_size: Optional[int] = _opt(
        None, "Hybrid models with the host tier: how many recurrent-state snapshots the host tier keeps "
        "(pinned on CUDA), beside its KV: a prefix evicted from the device, or a snapshot the device "
        "snapshot pool evicts for room, takes its snapshot there and brings it back when it is loaded or "
        "resumed from, so a request resumes from the host tier too. Each is the size "
        "of one running request's states. Default: as many times --mamba-cache-size as the host tier "
        "holds of the device KV pool (--hicache-ratio 4: 4x the snapshots), in no more bytes than the "
        "host tier's KV (at least --mamba-cache-size of them). 0: none (prefixes on the "
        "host then resume nobody). With --tp-size, per rank.")
    storage_dir: Optional[str] = _opt(
        None, "A storage tier on local disk under the host tier (needs --hicache-size or --hicache-ratio "
        "and --page-size 16 or more): pages the host tier evicts are written here, off the step, keyed by "
        "their KV-event page hashes, and read back for a request when that is faster than computing them "
        "again. A server restarted on the same directory with the same model and settings finds them. "
        "A hybrid model's recurrent-state snapshots go with their pages (through the host tier's snapshot "
        "slots: --mamba-host-cache-size not 0). With --tp-size N each rank keeps its shard of every page "
        "in DIR/tp<N>-rank<r>. Default: off.", metavar="DIR")
    storage_size: float = _opt(
        16.0, "The storage tier's size on disk in GB (--storage-dir), per tensor-parallel rank; the least "
        "recently used pages go first when it is full.")
    storage_backend: str = _opt(
        "file", "Where the storage tier keeps its pages: file (--storage-dir on a local disk) or redis "
        "(--storage-url: a Redis server several workers share; run it with maxmemory-policy allkeys-lru; "
        "with --tp-size N every rank reaches it and keeps its shard of each page under keys of its own).",
        choices=STORAGE_BACKENDS)
    storage_url: Optional[str] = _opt(
        None, "The Redis server of --storage-backend redis, e.g. redis://127.0.0.1:6379/0.", metavar="URL")
    storage_read_gbps: float = _opt(
        0.0, "The storage tier's read bandwidth in GB/s its load decisions use. Default 0: measured at "
        "start-up with page-sized reads (latency included); give it where the disk is shared and the "
        "measurement would be noisy.")
    storage_prefill_tflops: float = _opt(
        0.0, "The prefill rate in TFLOP/s the storage tier weighs a read against. Default 0: measured at "
        "start-up with a matmul of the model's width.")
    storage_read_latency_ms: float = _opt(
        0.0, "Fault injection: extra latency of every storage-tier page read, in ms (a slow disk); "
        "the start-up bandwidth measurement sees it too.")

    # --- scheduling --------------------------------------------------------
    schedule_policy: str = _opt(
        "lpm", "Order of the waiting queue: lpm (longest cached prefix first), fcfs, lof (longest output "
        "first), random, dfs-weight (depth-first over the radix tree).", choices=SCHEDULE_POLICIES)
    lpm_max_wait_s: float = _opt(
        7.0, "LPM's starvation bound: a request that has waited this many seconds goes before every "
        "request that has not, however long their cached prefix (the overdue among themselves by cached "
        "length, within arrival windows of this many seconds).")
    prefix_hold_s: float = _opt(
        0.25, "Multi-turn tuning: a finished conversation turn's prefix is kept this many seconds as if a "
        "request were waiting for it (evicted after prefixes nobody waits for; while running requests fill "
        "half the pool, no new request is admitted into its memory), so the conversation's next turn still "
        "finds it. A turn is a request whose prompt extends a finished request's whole prompt; while a "
        "quarter of recent requests are such turns, every finished request's prefix is kept. Traffic "
        "without conversations holds nothing. For chat and agent traffic under cache pressure "
        "(docs/tuning.md). 0: off.")
    max_running_requests: Optional[int] = _opt(
        None, f"Most requests decoding at once (default: {DEFAULT_MAX_RUNNING_REQUESTS['cuda']} on CUDA, "
        f"{DEFAULT_MAX_RUNNING_REQUESTS['cpu']} on the CPU; a hybrid model on CUDA: at most as many as "
        "0.15 of the memory after the weights holds recurrent states for, the rest going to the KV pool and "
        "the prefix cache's state snapshots).")
    max_queued_requests: Optional[int] = _opt(
        None, "Most requests left waiting once the running batch has taken what it has room for (free "
        "request slots and KV); beyond it the server answers 503 with Retry-After.")
    max_prefill_tokens: int = _opt(16384, "Most new prompt tokens computed in one step.")
    chunked_prefill_size: Optional[int] = _opt(
        None, "Longest prompt piece computed in one step; longer prompts are split and each finished "
        "chunk goes into the radix tree. -1 disables chunking. (default: "
        f"{DEFAULT_CHUNKED_PREFILL_SIZE['cuda']} on CUDA, {DEFAULT_CHUNKED_PREFILL_SIZE['cpu']} on the CPU, "
        "where a step's cost grows fastest with the chunk)", aliases=("--chunk-prefill-size",))
    chunked_prefill_reserve: float = _opt(
        0.25, "While a prompt is mid-way through its chunks, this share of each step's prefill budget "
        "goes first to everyone else: waiting prompts that fit whole in it, then one longer prompt "
        "started in pieces of it; decode rows count against it too. The long prompt's chunk takes the "
        "rest, all of the budget when nobody else needs any, and never less than 1 - this share. 0: the "
        "chunk takes the whole budget and other prompts wait until the long one is computed.")
    grammar_compile_timeout_s: float = _opt(
        20.0, "A structured-output request whose grammar has not compiled after this many seconds fails "
        "with a 400 (grammar_compile_timeout).")
    grammar_cache_mb: float = _opt(1024.0, "Memory the cache of compiled grammars may hold (least recently used "
                                   "out first; at most 256 grammars).")
    schedule_conservativeness: float = _opt(
        1.0, "Scales the decode tokens reserved for running requests at admission: lower admits more "
        "and retracts more often, higher admits less.")
    in_batch_prefix_min_len: int = _opt(
        32, "Of waiting requests that share an uncached prefix at least this long, one is admitted "
        "first so the prefix is computed once.")

    # --- model runner ------------------------------------------------------
    attention_backend: str = _opt("auto", "auto: triton on CUDA, torch elsewhere.",
                                  choices=("auto", "torch", "triton"))
    cuda_graph_max_bs: int = _opt(
        1024, "Largest decode batch replayed from a CUDA graph (at most --max-running-requests is captured). "
        "Larger batches launch every kernel from Python, which costs a small model's decode host time. "
        "Lower it to start faster or to keep the graphs' memory for the KV pool.")
    disable_cuda_graph: bool = _opt(False, "Run decode steps eagerly.")
    decode_gemm_max_rows: int = _opt(
        DECODE_GEMM_MAX_ROWS, "On CUDA, projections of at most this many rows (decode batches) run our weight-streaming "
        "Triton GEMM instead of cuBLAS (FP8 projections up to twice as many rows); 0 turns it off.")
    skip_warmup: bool = _opt(False, "Start without the warm-up requests that compile the GPU kernels "
                             "(the first requests then wait for the compiles).")
    disable_overlap_schedule: bool = _opt(
        False, "Build each step only after the previous one's tokens are back. By default the next step "
        "is scheduled and launched while the device still runs the current one; outputs are the same.")
    disable_cpu_affinity: bool = _opt(
        False, "Leave the engine process where the OS puts it. By default, on a machine with several NUMA "
        "nodes, each engine process is bound to the CPU cores local to its GPU (kernel launches and pinned "
        "copies from the far node cost more, and where a process lands changes from start to start).")

    # --- server ------------------------------------------------------------
    host: str = _opt("127.0.0.1", "Address the HTTP server binds.")
    port: int = _opt(30000, "HTTP port.")
    # Every accepted key (`--api-key` repeated); a lone string given to ServerSettings or Engine is one key.
    api_key: tuple[str, ...] = _opt(
        (), "Require 'Authorization: Bearer <key>' on every endpoint but /health. Repeat it for several keys; "
        "with more than one, each key gets its own prefix cache (see --shared-cache-across-keys). Any local "
        "user can read a command line (ps): prefer --api-key-file. (default: none, open)", repeat=True)
    api_key_file: Optional[str] = _opt(
        None, "A file of accepted keys, one a line: KEY, or KEY NAME (a name the start-up log shows instead of "
        "the key); blank lines and lines starting with # are skipped. Adds to --api-key; keeps the keys off the "
        "command line. Keep it mode 600. (default: none)")
    shared_cache_across_keys: bool = _opt(
        False, "With more than one API key (--api-key repeated, --api-key-file), share one prefix cache across "
        "all of them. By default each key gets its own, as with --cache-salt-per-api-key: in a shared cache, "
        "cached_tokens and the time to the first token tell one key's holder what prompts another key sent "
        "(docs/serving.md, Tenants). Only for keys of one team that may see each other's prompts.")
    cache_salt_per_api_key: bool = _opt(
        False, "Isolate each API key's prefix cache: a request shares cached prefixes only with requests sent "
        "with the same 'Authorization: Bearer' key (and the same cache_salt, if any), so cached_tokens never "
        "shows another key's prompts. The default with more than one key (--api-key, --api-key-file); with "
        "one or none, this flag turns it on: the key need not be --api-key, behind a gateway that checks "
        "keys each key it passes through gets its own cache. Requests without a key share one.")
    admin_api_key: Optional[str] = _opt(
        None, "Key for the admin endpoints (/flush_cache, /kv_events), which change every user's state or show "
        "what other users sent. Without it they take any --api-key; with neither they are open. With --dp-size "
        "it is the router's admin key too (its worker management and /flush_cache, which never take --api-key: "
        "off without this key).")
    admin_api_key_file: Optional[str] = _opt(
        None, "A file holding the --admin-api-key (one line; # comments skipped), which keeps it off the "
        "command line. (default: none)")
    health_stall_timeout_s: float = _opt(
        60.0, "/health answers 503 when the engine loop has been inside one step this long (wedged: a "
        "hung collective, a kernel that never returns) or the engine process sent no heartbeat for "
        "min(10 s, this) (stopped, or stuck holding the interpreter). A busy engine whose steps finish "
        "stays 200 however long its queue; /health_generate still checks that a token comes out.")
    graceful_shutdown_timeout: float = _opt(
        30.0, "On SIGTERM, seconds in-flight requests get to finish (/health answers 503 meanwhile); what is "
        "left then gets a 503 error body, or an error event and [DONE] on a stream.")
    stream_interval: int = _opt(
        1, "A streamed request gets an event every this many tokens (and with its first and its last); "
        "larger values send fewer, bigger events, which saves host time in the engine and the API at "
        "high concurrency. A request that does not stream gets its first token and its end only, "
        "whatever this is.")
    log_requests: bool = _opt(False, "Log each request's arrival and finish, and each rejected request "
                              "(its status and reason, never its text).")
    max_request_bytes: Optional[int] = _opt(
        None, "Largest request body; a larger one is answered 413 before it is read. Default: 64 bytes "
        "per context token (4 bytes a character, 16 characters a token).")
    max_connections: Optional[int] = _opt(
        None, "Most client connections held at once; one more is answered 503 and closed as it opens. A "
        "request's headers must arrive within 10 s and its body within 60 s, or its connection is closed. "
        "The server raises its soft open-file limit to the hard one (up to 65,536). Default: that limit less 256.")
    max_request_sequences: int = _opt(
        2048, "Most sequences one request may ask for: its prompts (a batch list) times n. More is a 400 "
        "naming this limit before anything is tokenized (2,048: OpenAI's limit on a prompt list). It bounds "
        "one request's share of the queue; fairness between clients is --max-queued-requests' and a gateway's.")
    log_file: Optional[str] = _opt(None, "Also write the log to this file.")
    log_level: str = _opt("info", "Logging level.", choices=("debug", "info", "warning", "error"))
    log_interval: int = _opt(40, "Write a decode batch line every this many decode steps.")
    step_trace_file: Optional[str] = _opt(
        None, "Write one CSV line per engine step here (time, step ms and its wait for the device, loop-gap "
        "ms, kind, requests, prompt tokens); summarise with `python -m radixserve.engine.step_trace FILE`. "
        "With --dp-size, worker i writes FILE.i.")
    dp_size: int = _opt(1, "Data-parallel engine workers behind a built-in cache-aware router.")
    dp_rank: int = _opt(
        0, "This worker's rank among data-parallel workers: its KV event batches carry it and its KV event "
        "ports are offset by it. --dp-size sets it for each worker it starts.")
    kv_events_config: Optional[str] = _opt(
        None, "Publish the radix cache's blocks as KV events in vLLM's wire format over ZMQ, for a cluster's "
        "KV-aware router: vLLM's KVEventsConfig as JSON, e.g. '{\"enable_kv_cache_events\": true, "
        "\"replay_endpoint\": \"tcp://127.0.0.1:5558\"}' (the events bound on tcp://127.0.0.1:5557, the default "
        "endpoint; an endpoint with a host name or IP is connected to, vLLM's rule: the router binds there). "
        "Blocks of the shared cache carry their token ids (\"unsalted_token_ids\": false: none do); a salted or "
        "per-key cache's never do. Anyone who reaches the sockets reads them, the replay socket all it "
        "buffered: a wildcard address (*, 0.0.0.0, ::) is warned about at start-up (docs/serving.md, "
        "\"What a KV-event subscriber learns\"). (default: off)")
    tp_size: int = _opt(
        1, "Tensor-parallel ranks per engine: the model's heads, MLP and vocabulary split over this many "
        "processes, one per GPU (NCCL; gloo on the CPU). With --dp-size M, M x N GPUs.", aliases=("--tp",))
    nnodes: int = _opt(
        1, "Machines one tensor-parallel engine spans (SGLang's flag): --tp-size ranks split evenly over them, "
        "--tp-size / --nnodes GPUs on each. Start the same command on every machine with its --node-rank and "
        "the same --dist-init-addr; node 0 serves HTTP and schedules, the others only run their ranks.")
    node_rank: int = _opt(0, "This machine's index among the --nnodes machines (0 serves HTTP).")
    dist_init_addr: Optional[str] = _opt(
        None, "HOST:PORT of node 0 where the ranks of a multi-node engine meet (torch.distributed's TCP store on "
        "node 0; step messages and collectives then use other ports between the nodes). Needed with --nnodes > 1; "
        "reachable only from the engine's machines: nothing on these ports is authenticated.")
    tp_all_reduce: str = _opt(
        "nccl", "The all-reduce of tensor parallelism's decode steps: nccl, or symm-mem (torch's symmetric-memory "
        "one-shot all-reduce over NVLink, CUDA only; prefill-sized messages still use NCCL). Compare them with "
        "scripts/tp_allreduce_bench.py.", choices=("nccl", "symm-mem"))

    def __post_init__(self) -> None:
        # One key as a string (the offline Engine's and older callers' spelling), or a JSON list.
        if self.api_key is None:
            self.api_key = ()
        elif isinstance(self.api_key, str):
            self.api_key = (self.api_key,)
        else:
            self.api_key = tuple(self.api_key)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first setting that makes no sense."""
        if not self.grammar_compile_timeout_s > 0 or not self.grammar_cache_mb >= 0:
            raise ValueError("grammar_compile_timeout_s must be > 0 and grammar_cache_mb >= 0")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise ValueError(f"{f.name}={value!r} is not one of {', '.join(choices)}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"max_total_tokens={self.max_total_tokens} holds no page")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")
        chunk = self.chunked_prefill_size
        if chunk is not None and (chunk == 0 or chunk < -1):
            raise ValueError(f"chunked_prefill_size must be positive or -1, got {self.chunked_prefill_size}")
        if not 0.0 <= self.chunked_prefill_reserve < 1.0:
            raise ValueError(f"chunked_prefill_reserve must be in [0, 1), got {self.chunked_prefill_reserve}")
        if not self.health_stall_timeout_s > 0:
            raise ValueError(f"health_stall_timeout_s must be > 0, got {self.health_stall_timeout_s}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.mamba_cache_size is not None and self.mamba_cache_size < 0:
            raise ValueError(f"mamba_cache_size must be >= 0, got {self.mamba_cache_size}")
        if self.mamba_host_cache_size is not None and self.mamba_host_cache_size < 0:
            raise ValueError(f"mamba_host_cache_size must be >= 0, got {self.mamba_host_cache_size}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.graceful_shutdown_timeout < 0:
            raise ValueError(f"graceful_shutdown_timeout must be >= 0, got {self.graceful_shutdown_timeout}")
        if self.lpm_max_wait_s <= 0:
            raise ValueError(f"lpm_max_wait_s must be > 0, got {self.lpm_max_wait_s}")
        if self.prefix_hold_s < 0:
            raise ValueError(f"prefix_hold_s must be >= 0, got {self.prefix_hold_s}")
        if self.schedule_conservativeness < 0:
            raise ValueError(f"schedule_conservativeness must be >= 0, got {self.schedule_conservativeness}")
        if self.max_request_bytes is not None and self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.max_request_sequences < 1:
            raise ValueError(f"max_request_sequences must be >= 1, got {self.max_request_sequences}")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {self.context_length}")
        if self.hicache_size < 0 or self.hicache_ratio < 0:
            raise ValueError("hicache_size and hicache_ratio must be >= 0")
        if self.hicache_size > 0 and self.hicache_ratio > 0:
            raise ValueError("give hicache_size or hicache_ratio, not both")
        if self.hicache_enabled and self.disable_radix_cache:
            raise ValueError("the host tier (hicache_size/hicache_ratio) needs the radix cache; "
                             "drop disable_radix_cache")
        self._validate_storage()
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.dp_rank < 0:
            raise ValueError(f"dp_rank must be >= 0, got {self.dp_rank}")
        if self.kv_events_config is not None:
            parse_kv_events_config(self.kv_events_config)
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        self._validate_keys()
        self._validate_nodes()
        if self.decode_gemm_max_rows < 0:
            raise ValueError(f"decode_gemm_max_rows must be >= 0, got {self.decode_gemm_max_rows}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if not self.chat_template_timeout_s > 0:
            raise ValueError(f"chat_template_timeout_s must be > 0, got {self.chat_template_timeout_s}")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")

    def _validate_keys(self) -> None:
        for key in (*self.api_key, self.admin_api_key):
            if key is not None and (not isinstance(key, str) or not key or any(c.isspace() for c in key)):
                raise ValueError("an API key must be a non-empty string without whitespace")
        if self.admin_api_key is not None and self.admin_api_key_file is not None:
            raise ValueError("give admin_api_key or admin_api_key_file, not both")
        if self.shared_cache_across_keys and self.cache_salt_per_api_key:
            raise ValueError("shared_cache_across_keys and cache_salt_per_api_key contradict each other: give one")

    def without_secrets(self) -> "ServerSettings":
        """These settings without the keys: what the engine process and its ranks are given (they check
        no key) and what a multi-node engine's store (unauthenticated) holds."""
        return dataclasses.replace(self, api_key=(), api_key_file=None, admin_api_key=None,
                                   admin_api_key_file=None)

    @property
    def storage_enabled(self) -> bool:
        return self.storage_dir is not None or self.storage_url is not None

    def _validate_storage(self) -> None:
        if not self.storage_enabled:
            return
        if self.storage_backend == "file" and not self.storage_dir:
            raise ValueError("storage_backend file needs storage_dir (a directory)")
        if self.storage_backend == "redis" and not self.storage_url:
            raise ValueError("storage_backend redis needs storage_url (redis://host:port/db)")
        if self.storage_backend == "redis" and self.storage_dir:
            raise ValueError("storage_backend redis keeps its pages in Redis: give storage_url, not storage_dir")
        if not self.hicache_enabled:
            raise ValueError("the storage tier (storage_dir) sits under the host tier: give hicache_size or "
                             "hicache_ratio too")
        if self.page_size < STORAGE_MIN_PAGE_SIZE:
            raise ValueError(f"the storage tier (storage_dir) keeps whole pages: page_size must be >= "
                             f"{STORAGE_MIN_PAGE_SIZE}, got {self.page_size}")
        if not self.storage_size > 0:
            raise ValueError(f"storage_size must be > 0 GB, got {self.storage_size}")
        if self.storage_read_gbps < 0 or self.storage_prefill_tflops < 0:
            raise ValueError("storage_read_gbps and storage_prefill_tflops must be >= 0 (0: measured at start-up)")
        if self.storage_read_latency_ms < 0:
            raise ValueError(f"storage_read_latency_ms must be >= 0, got {self.storage_read_latency_ms}")

    def _validate_nodes(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in 0..{self.nnodes - 1} (nnodes={self.nnodes}), got {self.node_rank}")
        if self.nnodes == 1:
            return
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size={self.tp_size} does not split evenly over nnodes={self.nnodes}")
        if self.dp_size > 1:
            raise ValueError("dp_size > 1 with nnodes > 1 is not supported: start one multi-node engine per worker")
        if self.tp_all_reduce == "symm-mem":
            raise ValueError("tp_all_reduce=symm-mem works within one machine (NVLink); with nnodes > 1 use nccl")
        if not self.dist_init_addr:
            raise ValueError("nnodes > 1 needs dist_init_addr (HOST:PORT of node 0, the same on every node)")
        self.dist_init_host_port()

    def dist_init_host_port(self) -> tuple[str, int]:
        """--dist-init-addr as (host, port); ValueError when it is not HOST:PORT."""
        host, sep, port = (self.dist_init_addr or "").rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"dist_init_addr must be HOST:PORT with a port in 1-65535, got {self.dist_init_addr!r}")
        return host, int(port)

    @property
    def tp_ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    def check_context_length(self, model_positions: int, model: str) -> None:
        """A context_length above the model's max_position_embeddings is a ValueError naming the
        model's limit, unless allow_longer_context_length says it is meant."""
        if (self.context_length is not None and self.context_length > model_positions
                and not self.allow_longer_context_length):
            raise ValueError(
                f"context_length {self.context_length} is more than the model's max_position_embeddings "
                f"{model_positions} ({model}): give at most {model_positions} or none, or set "
                "allow_longer_context_length (--allow-longer-context-length) to run untrained positions anyway")

    @property
    def hicache_host_bytes(self) -> int:
        """Host memory --hicache-size asks for on this machine: per rank (of this node), per worker."""
        return int(self.hicache_size * 1e9) * self.tp_ranks_per_node * self.dp_size

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "ServerSettings":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown setting(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def kv_events(self) -> Optional[KvEventsConfig]:
        """The KV event publisher's config when it publishes, else None."""
        if self.kv_events_config is None:
            return None
        config = parse_kv_events_config(self.kv_events_config)
        return config if config.publishes else None

    @property
    def hicache_enabled(self) -> bool:
        return self.hicache_size > 0 or self.hicache_ratio > 0

    def hicache_tokens(self, pool_tokens: int, bytes_per_token: int) -> int:
        """Host tier size in tokens (0: off), whole pages."""
        if self.hicache_ratio > 0:
            tokens = int(pool_tokens * self.hicache_ratio)
        else:
            tokens = int(self.hicache_size * 1e9 // bytes_per_token)
        tokens -= tokens % self.page_size
        if self.hicache_enabled and tokens < self.page_size:
            raise ValueError(f"the host tier holds no page ({self.hicache_size} GB, ratio {self.hicache_ratio})")
        return tokens

    def resolved_max_running_requests(self, device_type: str) -> int:
        return self.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS["cuda" if device_type == "cuda" else "cpu"]

    def resolved_chunked_prefill_size(self, device_type: str) -> int:
        """--chunked-prefill-size, or the device's default (-1: no chunking)."""
        if self.chunked_prefill_size is not None:
            return self.chunked_prefill_size
        return DEFAULT_CHUNKED_PREFILL_SIZE["cuda" if device_type == "cuda" else "cpu"]

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _takes_many(f: dataclasses.Field) -> bool:
    return str(f.type).startswith("tuple")


def add_settings_arguments(parser: argparse.ArgumentParser, cls: type = ServerSettings) -> None:
    """One argparse option per dataclass field (see `option`), in field order."""
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True):
            continue
        flags = [_flag(f.name), *f.metadata.get("aliases", ())]
        default = f.default
        help_text = f.metadata.get("help", "")
        if f.type in ("bool", bool):
            parser.add_argument(*flags, dest=f.name, action="store_true", default=default, help=help_text)
            continue
        if f.metadata.get("repeat"):  # None when never given; settings_from_args makes it the tuple
            parser.add_argument(*flags, dest=f.name, action="append", type=str, default=None, help=help_text)
            continue
        kind = str if "str" in str(f.type) else int if "int" in str(f.type) else float
        # A help that explains its own default keeps only that one. The default follows a help's
        # last sentence ("Port. (default: 1)"), or ends one left open for it ("Port (default: 1).").
        if "(default" not in help_text and f.metadata.get("show_default", True):
            help_text += f" (default: {default})" + ("" if help_text.endswith(".") else ".")
        extra: dict[str, Any] = {"nargs": "*"} if _takes_many(f) else {}
        if f.metadata.get("metavar"):
            extra["metavar"] = f.metadata["metavar"]
        parser.add_argument(*flags, dest=f.name, type=kind, default=default,
                            choices=f.metadata.get("choices"), help=help_text, **extra)


SettingsT = TypeVar("SettingsT")


def settings_from_args(args: argparse.Namespace, cls: type[SettingsT] = ServerSettings) -> SettingsT:
    """An instance of `cls` from what its generated flags parsed (a list of values as a tuple)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    for f in dataclasses.fields(cls):
        if f.metadata.get("repeat") and values.get(f.name) is None:
            values[f.name] = f.default
        if _takes_many(f) and f.name in values:
            values[f.name] = tuple(values[f.name])
    return cls(**values)
