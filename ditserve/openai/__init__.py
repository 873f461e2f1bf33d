"""The OpenAI-compatible `/v1/videos` HTTP facade over the Jobs API: its command, the FastAPI app, the mapping."""
