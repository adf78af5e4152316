"""The HTTP API by surface: OpenAI (`openai_api`), SGLang-native (`native`), operator (`admin`),
and what probes and scrapers read (`observability`). Each is a FastAPI router whose endpoints get
the app's one `ServingContext` as a dependency."""
