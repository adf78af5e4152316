"""What the API server and the router share below both of them: OpenAI-style error bodies and
handlers (`errors`), the API-key middleware (`auth`), and the event-loop health of an asyncio
HTTP process (`loop_lag`)."""
