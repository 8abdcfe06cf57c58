"""`expresslane serve`: the OpenAI-compatible HTTP server (API process) and its engine process.

Nothing here is imported by ``import expresslane``: FastAPI, uvicorn and ZeroMQ stay
out of the offline engine. Map of a request::

    api.py (routes, auth, errors; limits.py) -> serving.py (request -> prompts +
    SamplingParams, outputs -> OpenAI JSON / SSE) -> engine_client.py (life cycle, restarts:
    admission.py decides what comes in, tracker.py follows it out, engine_link.py owns the
    process) ==ZeroMQ + msgspec (wire.py)==> engine_proc.py (EngineCore step loop, own process)

The API process imports no torch: only the engine process loads the model.
"""
