"""What every process of a server does for itself, written once and importing no torch (the API
process and the router start without it): logging, garbage-collector tuning, and, for a parent,
spawning a child that dies with it and supervising its children (watching them, stopping them);
the tokenizer loader every process that reads text uses."""
