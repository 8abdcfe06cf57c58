"""Property-based fuzzing of every route with schemathesis (its CLI, as a user runs it): 0 5xx.

The fuzzer reads the schema that the server serves at /openapi.json. Where that schema does
not describe a route's request body (finding R2), the body's schema is filled in from the
pydantic model that the route parses, so the fuzzer still generates bodies, valid and not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from expresslane.server import protocol

from .conftest import serves_a_normal_request

pytestmark = pytest.mark.reliability

BODIES = {"/v1/completions": protocol.CompletionRequest, "/v1/chat/completions": protocol.ChatCompletionRequest,
          "/generate": protocol.GenerateRequest, "/tokenize": protocol.TokenizeRequest,
          "/detokenize": protocol.DetokenizeRequest}


def _served_schema(server) -> dict:
    r = httpx.get(server.url + "/openapi.json", timeout=30)
    assert r.status_code == 200
    return r.json()


def _with_bodies(schema: dict) -> dict:
    """The served schema, with each POST route's body schema filled in where it is missing."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in BODIES.items():
        op = schema["paths"][path]["post"]
        if "requestBody" in op:
            continue
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    return schema


def test_openapi_describes_every_request_body(server):
    paths = _served_schema(server)["paths"]
    assert [p for p in BODIES if "requestBody" not in paths[p]["post"]] == []


def _fuzz(server, tmp_path, phases: str, max_examples: int) -> None:
    schema_file = tmp_path / "openapi.json"
    schema_file.write_text(json.dumps(_with_bodies(_served_schema(server))))
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", str(schema_file), "--url", server.url,
           "--checks", "not_a_server_error", "-H", f"Authorization: Bearer {server.api_key}",
           "--phases", phases, "--max-examples", str(max_examples), "--seed", "19", "--workers", "2",
           "--request-timeout", "120",
           "--report", "json", "--report-json-path", str(report), "--no-color"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=540, cwd=tmp_path,  # its cache too
                         env={**os.environ, "NO_COLOR": "1"})
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    r = json.loads(report.read_text())
    cases = r["test_cases"]
    operations = sum(len(methods) for methods in _served_schema(server)["paths"].values())
    assert r["operations"]["tested"] == operations, (r["operations"], r["errors"])
    assert cases["with_failures"] == 0, r["failures"]
    # The bodies are not all rejected: each POST route ran some generated requests (2xx).
    accepted = {op: sum(p["accepted"] for p in rates.values()) for op, rates in r["valid_rates"].items()}
    assert all(accepted[f"POST {path}"] > 0 for path in BODIES), accepted
    print(f"\nschemathesis ({phases}, --max-examples {max_examples}): {cases['generated']} cases over "
          f"{r['operations']['tested']} operations in {r['running_time']:.0f} s, {cases['with_failures']} with a 5xx; "
          f"accepted (2xx) per route: {accepted}")
    serves_a_normal_request(server)


def test_schemathesis_finds_no_5xx(server, tmp_path):
    _fuzz(server, tmp_path, "fuzzing", max_examples=12)


@pytest.mark.slow
def test_schemathesis_finds_no_5xx_with_boundary_cases(server, tmp_path):
    """Schemathesis' coverage phase too (every boundary and wrong type of every field), and more examples."""
    _fuzz(server, tmp_path, "coverage,fuzzing", max_examples=150)
