"""`expresslane serve`: the OpenAI-compatible HTTP server (API process) and its engine process.

Nothing here is imported by ``import expresslane``: FastAPI, uvicorn and ZeroMQ stay
out of the offline engine. Map of a request::

    api.py (routes, auth, errors) -> serving.py (request -> prompts + SamplingParams,
    outputs -> OpenAI JSON / SSE) -> engine_client.py (admission, tokens out, deltas in)
      ==ZeroMQ + msgspec (wire.py)==> engine_proc.py (EngineCore step loop, own process)
"""
