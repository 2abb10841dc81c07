"""tierserve's HTTP front end: an OpenAI-compatible API over the async engine."""
