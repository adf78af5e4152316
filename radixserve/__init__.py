"""radixserve: an LLM serving engine built around a radix-tree prefix KV cache."""

from typing import Any

__version__ = "0.1.0"
__all__ = ["Engine", "ServerSettings", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy, so `import radixserve` (and the API process) stays light.
    if name == "Engine":
        from radixserve.engine.engine import Engine

        return Engine
    if name == "ServerSettings":
        from radixserve.settings import ServerSettings

        return ServerSettings
    raise AttributeError(name)
