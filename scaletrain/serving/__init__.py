"""`scaletrain serve`: the OpenAI-compatible HTTP endpoint (protocol, batching engine, HTTP)."""
