"""What the server's and the router's OpenAPI documents share: the OpenAI-style error body every
error answer carries, and a streamed answer's event-stream content."""

ERROR_SCHEMA = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
# Before OpenAPI 3.2 a text/event-stream schema describes each event: its fields, `data` a JSON
# chunk of the response (or `[DONE]` at the end).
EVENT_STREAM = {"text/event-stream": {"schema": {
    "type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                                     "id": {"type": "string"}, "retry": {"type": "integer"}}}}}
