"""The HTTP server: an API process (FastAPI/uvicorn) in front of an engine process (ZMQ IPC)."""
