"""What parsing one request body costs the API's event loop (issue #19): decode, the limit
checks of a large body, validation, timed in-process on the cases of docs/reliability.md.

    python benchmarks/body_parse.py
"""

from __future__ import annotations

import json
import time

from expresslane.config.server import RequestLimits
from expresslane.server import limits, protocol
from expresslane.server.errors import APIError

N = 16 * 2**20  # --max-request-body-bytes' default
C, CHAT = protocol.CompletionRequest, protocol.ChatCompletionRequest
CASES = {
    "256 prompts x 2,047 token ids (valid)": (C, json.dumps({"prompt": [[(i * 7919 + j) % 2000 + 10 for i in range(2047)]
                                                                         for j in range(256)], "max_tokens": 1}).encode()),
    "16 MiB: stop_token_ids of 4 M floats": (C, b'{"prompt":[1],"stop_token_ids":[' + b"0.5," * (N // 4 - 30) + b"0]}"),
    "16 MiB: 5.6 M messages {}": (CHAT, b'{"messages":[' + b"{}," * (N // 3 - 10) + b"{}]}"),
    "16 MiB: 1 M valid messages": (CHAT, b'{"messages":[' + b'{"role":"user"},' * (N // 16 - 10) + b'{"role":"user"}]}'),
    "16 MiB: 8 M stop_token_ids": (C, b'{"prompt":[1],"stop_token_ids":[' + b"0," * (N // 2 - 30) + b"0]}"),
    "16 MiB: 5.6 M empty prompts": (C, b'{"prompt":[' + b"[]," * (N // 3 - 10) + b"[]]}"),
}


def parse(model, raw: bytes) -> str:
    """The API's path for a body over 64 KiB (api.py's `body` then the route's `parse`)."""
    try:
        obj = protocol.decode(raw)
        limits.precheck(obj, RequestLimits(), 10**9, max_model_len=2048, vocab_size=2048)
        protocol.parse(model, obj)
        return "accepted"
    except APIError as e:
        return f"{e.status} {e.param}"


def main() -> None:
    for name, (model, raw) in CASES.items():
        times = []
        for _ in range(3 if len(raw) < 4_000_000 else 1):
            t0 = time.perf_counter()
            result = parse(model, raw)
            times.append(time.perf_counter() - t0)
        print(json.dumps({"body": name, "mb": round(len(raw) / 1e6, 1), "ms": round(min(times) * 1e3, 1),
                          "result": result}), flush=True)


if __name__ == "__main__":
    main()
