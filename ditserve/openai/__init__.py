"""The OpenAI-compatible `/v1/videos` HTTP facade over the Jobs API: its command and flags, the FastAPI app, the
guards before it, the mapping."""
