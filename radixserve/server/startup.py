"""What the server checks before anything loads, and the served model's default name (the rest of
its life, from the `serving` line to the shutdown, is `lifecycle.py`).

The checks run before the engine process starts or any weights load, so a wrong path, a
config.json of an architecture radixserve does not run, a quantization method the model cannot
run (AWQ, GPTQ, ...), a context longer than the model's, a host tier larger than the host's
available memory, a busy port or a KV event address that cannot be bound fails in well under a
second with one line instead of after the model loaded.
"""

from __future__ import annotations

import json
import logging
import os

from radixserve.cache.host_memory import check_host_memory
from radixserve.chat_formats import BUILTIN_CHAT_TEMPLATES
from radixserve.default_model import DEFAULT_MODEL_NAME, default_model_positions
from radixserve.http_common.listen import ListenAddressError, check_listen_address
from radixserve.model.config import ModelConfig
from radixserve.model.quantization import quantization_config
from radixserve.engine.kv_publisher import check_kv_event_endpoints
from radixserve.settings import ServerSettings

logger = logging.getLogger("radixserve")


class StartupError(RuntimeError):
    """The server cannot start; the message says why in one line."""


def check_model_path(settings: ServerSettings) -> None:
    """A given --model-path must be a directory with a config.json; --tokenizer-path a directory and
    --chat-template a file."""
    path = settings.model_path
    if path is not None:
        if not os.path.isdir(path):
            raise StartupError(f"--model-path {path!r}: no such directory (a local Hugging Face model directory; "
                               f"leave --model-path out to serve the built-in tiny model, {DEFAULT_MODEL_NAME})")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise StartupError(f"--model-path {path!r}: no config.json in it (a Hugging Face model directory "
                               "has config.json and *.safetensors)")
    tok = settings.tokenizer_path
    if tok is not None and not os.path.isdir(tok):
        raise StartupError(f"--tokenizer-path {tok!r}: no such directory")
    template = settings.chat_template
    if template is not None and not os.path.isfile(template) and template not in BUILTIN_CHAT_TEMPLATES:
        raise StartupError(f"--chat-template {template!r}: no such file (or built-in template: "
                           f"{', '.join(BUILTIN_CHAT_TEMPLATES)})")


def _read_config(path: str) -> dict:
    config_file = os.path.join(path, "config.json")
    try:
        with open(config_file) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise StartupError(f"--model-path {path!r}: cannot read config.json ({e})") from None
    if not isinstance(raw, dict):
        raise StartupError(f"--model-path {path!r}: config.json must hold a JSON object")
    return raw


def check_quantization(settings: ServerSettings) -> None:
    """The checkpoint's quantization_config (and --quantization) must be one the model runs: an AWQ
    or GPTQ checkpoint read as bf16 would load and answer garbage."""
    path = settings.model_path
    if path is None:
        return
    raw = _read_config(path)
    try:
        quantization_config(raw, settings.quantization, source=f"--model-path {path!r}")
    except ValueError as e:
        raise StartupError(str(e)) from None


def check_model_config(settings: ServerSettings) -> None:
    """config.json must describe a model radixserve runs: a supported architecture (or model_type)
    with the keys and values its family needs, as the engine reads it (pure Python, no torch)."""
    path = settings.model_path
    if path is None:
        return
    raw = _read_config(path)
    try:
        ModelConfig.from_dict(raw, source=f"--model-path {path!r}: config.json")
    except (ValueError, TypeError) as e:
        raise StartupError(str(e)) from None


def check_context_length(settings: ServerSettings) -> None:
    """--context-length may not exceed the model's max_position_embeddings (unless allowed)."""
    if settings.context_length is None:
        return
    if settings.model_path is None:
        positions, model = default_model_positions(), "the built-in tiny model"
    else:
        raw = _read_config(settings.model_path)
        positions, model = raw.get("max_position_embeddings"), f"--model-path {settings.model_path!r}"
        if not isinstance(positions, int):
            return  # the engine's config check names a missing or odd value
    try:
        settings.check_context_length(positions, model)
    except ValueError as e:
        raise StartupError(str(e)) from None


def check_hicache_memory(settings: ServerSettings) -> None:
    """--hicache-size (per rank, per worker) must fit in the host memory available now."""
    if settings.hicache_size > 0:
        what = f"--hicache-size {settings.hicache_size:g}" + (
            f" x {settings.tp_size * settings.dp_size} ranks" if settings.tp_size * settings.dp_size > 1 else "")
        try:
            check_host_memory(settings.hicache_host_bytes, what)
        except ValueError as e:
            raise StartupError(str(e)) from None


def check_port_free(host: str, port: int) -> None:
    """The port is in 1-65535 and host:port binds now; raise StartupError if not."""
    try:
        check_listen_address(host, port)
    except ListenAddressError as e:
        raise StartupError(str(e)) from None


def check_before_loading(settings: ServerSettings) -> None:
    """Every check that needs nothing loaded; raises StartupError with the first problem."""
    check_model_path(settings)
    check_quantization(settings)
    check_model_config(settings)
    check_context_length(settings)
    check_hicache_memory(settings)
    check_port_free(settings.host, settings.port)
    problem = check_kv_event_endpoints(settings)
    if problem is not None:
        raise StartupError(problem)


def default_served_model_name(model_path: str) -> str:
    """The model directory's name (`tiny-qwen2`, `Qwen2-7B-Instruct`), as SGLang names hub models."""
    return os.path.basename(os.path.normpath(model_path)) or model_path


class _DropTokenizerLengthWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token indices sequence length is longer than")


def silence_tokenizer_length_warning() -> None:
    """`transformers` warns when a prompt is longer than the tokenizer's model_max_length; the
    server checks every prompt against the engine's own context length and answers 400 itself,
    so that warning is noise in the server log."""
    logging.getLogger("transformers.tokenization_utils_base").addFilter(_DropTokenizerLengthWarning())
