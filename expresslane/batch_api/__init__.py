"""OpenAI's Batch API on a durable queue (torch-free, server-free).

``records`` holds the objects (files, batches, work items, results) and the JSONL
formats; ``store`` the one queue interface, with ``sqlite_store`` (embedded, the
default) and ``redis_store`` (several servers share one queue), picked by URL in
``registry``; ``worker`` drains a
store through any executor (the server runs requests in its own app, in the
``batch`` lane). See docs/batch.md.
"""
