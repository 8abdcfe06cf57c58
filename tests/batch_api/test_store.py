"""The queue's contract on both stores (SQLite file, real redis-server), with simulated time."""

from __future__ import annotations

import json

import pytest

from expresslane.batch_api.records import FileRecord, ItemResult, parse_input
from expresslane.batch_api.store import StoreError

T0 = 1_000_000


def upload(store, lines: list[dict], purpose: str = "batch", fid: str = "file-in") -> str:
    content = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    store.put_file(FileRecord(fid, len(content), T0, "in.jsonl", purpose), content)
    return fid


def request(i: int, url: str = "/v1/completions") -> dict:
    return {"custom_id": f"r{i}", "method": "POST", "url": url,
            "body": {"model": "tiny", "prompt": f"p{i}", "max_tokens": 2}}


def answer(item, ok: bool = True) -> ItemResult:
    body = ({"choices": [{"text": item.body["prompt"]}], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
            if ok else {"error": {"message": "bad"}})
    return ItemResult(item.custom_id, item.index, 200 if ok else 400, body)


def batch_of(store, n: int):
    return store.create_batch(upload(store, [request(i) for i in range(n)]), "/v1/completions", "24h", None, T0)


def lines(store, file_id) -> list[dict]:
    return [json.loads(x) for x in store.file_content(file_id).decode().splitlines()]


def test_each_request_is_claimed_once_and_answered_once(store):
    b = batch_of(store, 10)
    assert (b.status, b.total, b.model) == ("in_progress", 10, "tiny")
    a = store.claim("A", 6, 1000, T0)
    c = store.claim("B", 100, 1000, T0)
    assert len(a) == 6 and len(c) == 4
    assert sorted(i.custom_id for i in a + c) == sorted(f"r{i}" for i in range(10))
    assert store.claim("C", 100, 1000, T0) == []  # every lease is live
    for i in a + c:
        assert store.complete(i, answer(i, ok=i.index != 3))
    assert not store.complete(a[0], answer(a[0]))  # a second answer is refused
    got = store.get_batch(b.id)
    assert (got.completed, got.failed, got.status) == (9, 1, "in_progress")
    assert store.finalize_due(T0 + 1, 60) == [b.id]
    assert store.finalize_due(T0 + 2, 60) == []
    done = store.get_batch(b.id)
    assert (done.status, done.completed, done.failed, done.completed_at) == ("completed", 9, 1, T0 + 1)
    out, err = lines(store, done.output_file_id), lines(store, done.error_file_id)
    assert [x["custom_id"] for x in out] == [f"r{i}" for i in range(10) if i != 3]  # input order
    assert out[0]["response"]["status_code"] == 200 and out[0]["response"]["body"]["choices"][0]["text"] == "p0"
    assert out[0]["error"] is None and out[0]["id"].startswith("batch_req_")
    assert [x["custom_id"] for x in err] == ["r3"] and err[0]["response"]["status_code"] == 400
    assert done.usage["input_tokens"] == 27 and done.usage["output_tokens"] == 18
    assert store.get_file(done.output_file_id).purpose == "batch_output"


def test_an_expired_lease_is_taken_over_and_the_first_result_wins(store):
    b = batch_of(store, 3)
    dead = store.claim("dead", 3, 1000, T0)
    assert store.claim("alive", 3, 1000, T0) == []  # held for a lease
    taken = store.claim("alive", 3, 0, T0)  # a lease of 0: whatever is held is overdue (Redis: idle >= 0 ms)
    assert sorted(i.custom_id for i in taken) == ["r0", "r1", "r2"]
    assert store.claim("other", 3, 1000, T0) == []  # the new owner's lease is live
    first = {i.custom_id: i for i in taken}
    assert store.complete(first["r0"], answer(first["r0"]))
    late = next(i for i in dead if i.custom_id == "r0")
    assert not store.complete(late, answer(late, ok=False))  # the old owner ran it too: not counted
    assert store.get_batch(b.id).completed == 1 and store.get_batch(b.id).failed == 0


def test_renew_keeps_and_release_gives_back(store):
    batch_of(store, 2)
    mine = store.claim("A", 2, 1000, T0)
    store.renew("A", mine, 1000, T0 + 500)
    assert store.claim("B", 2, 1000, T0 + 900) == []
    store.release("A", mine[:1])
    again = store.claim("B", 2, 1000, T0 + 900)
    assert [i.custom_id for i in again] == [mine[0].custom_id]


def test_cancel_stops_claims_and_keeps_partial_results(store):
    b = batch_of(store, 4)
    [first] = store.claim("A", 1, 1000, T0)
    store.complete(first, answer(first))
    assert store.cancel(b.id, T0 + 1).status == "cancelling"
    assert store.claim("A", 10, 1000, T0 + 1) == []
    assert store.finalize_due(T0 + 2, 60) == []  # in-flight requests may still land for a lease
    assert store.finalize_due(T0 + 61, 60) == [b.id]
    done = store.get_batch(b.id)
    assert (done.status, done.cancelled_at, done.completed) == ("cancelled", T0 + 61, 1)
    assert [x["custom_id"] for x in lines(store, done.output_file_id)] == [first.custom_id]
    assert store.cancel(b.id, T0 + 70).status == "cancelled"  # idempotent
    with pytest.raises(StoreError) as e:
        store.cancel("batch_nope", T0)
    assert e.value.status == 404


def test_a_batch_past_its_window_expires_with_the_rest_as_errors(store):
    b = batch_of(store, 3)
    [first] = store.claim("A", 1, 1000, T0)
    store.complete(first, answer(first))
    assert store.finalize_due(b.expires_at - 1, 60) == []
    assert store.finalize_due(b.expires_at, 60) == [b.id]
    done = store.get_batch(b.id)
    assert (done.status, done.completed, done.failed) == ("expired", 1, 2)
    err = lines(store, done.error_file_id)
    assert len(err) == 2 and {x["error"]["code"] for x in err} == {"batch_expired"}
    assert all(x["response"] is None for x in err)


def test_bad_input_files_fail_the_batch_with_line_numbers(store):
    fid = upload(store, [request(0), {"custom_id": "r0", "url": "/v1/completions", "body": {}},
                         request(2, url="/v1/chat/completions"), {"custom_id": "r3", "url": "/v1/completions"}])
    b = store.create_batch(fid, "/v1/completions", "24h", {"k": "v"}, T0)
    assert b.status == "failed" and b.failed_at == T0 and b.total == 0
    assert [(e["line"], e["code"]) for e in b.errors] == [
        (2, "duplicate_custom_id"), (3, "mismatched_endpoint"), (4, "missing_required_parameter")]
    assert store.claim("A", 10, 1000, T0) == []
    assert b.to_openai()["errors"]["object"] == "list" and b.to_openai()["metadata"] == {"k": "v"}
    for kwargs, param, status in ((dict(input_file_id="file-nope"), "input_file_id", 404),
                                  (dict(endpoint="/v1/moderations"), "endpoint", 400),
                                  (dict(completion_window="1h"), "completion_window", 400)):
        args = {"input_file_id": fid, "endpoint": "/v1/completions", "completion_window": "24h", **kwargs}
        with pytest.raises(StoreError) as e:
            store.create_batch(args["input_file_id"], args["endpoint"], args["completion_window"], None, T0)
        assert (e.value.param, e.value.status) == (param, status)


def test_lists_page_newest_first(store):
    fid = upload(store, [request(0)])
    ids = [store.create_batch(fid, "/v1/completions", "24h", None, T0 + k).id for k in range(5)]
    page = store.list_batches(None, 2)
    assert [b.id for b in page] == ids[::-1][:2]
    assert [b.id for b in store.list_batches(page[-1].id, 10)] == ids[::-1][2:]
    upload(store, [request(1)], fid="file-2")
    assert [f.id for f in store.list_files("batch", None, 10)] == ["file-2", "file-in"]
    assert [f.id for f in store.list_files("batch", "file-2", 10)] == ["file-in"]
    assert store.delete_file("file-2") and not store.delete_file("file-2")
    assert store.get_file("file-2") is None


def test_parse_input_skips_blank_lines_and_refuses_non_utf8():
    items, errors = parse_input(b'\n{"custom_id": "a", "url": "/v1/completions", "body": {}}\n\n', "/v1/completions")
    assert [(i.index, i.custom_id) for i in items] == [(0, "a")] and errors == []
    _, errors = parse_input(b"\xff\xfe", "/v1/completions")
    assert errors[0]["code"] == "invalid_file"
    _, errors = parse_input(b"  \n", "/v1/completions")
    assert errors[0]["code"] == "empty_file"
