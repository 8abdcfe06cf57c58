"""The engine's inbox: a large request arrives in pieces (wire.add_messages) that the engine
admits a few per step, after the small messages that came with them (server/inbox.py)."""

from __future__ import annotations

import msgspec

from expresslane.contract import EngineCoreRequest
from expresslane.sampling_params import SamplingParams
from expresslane.server.inbox import Inbox
from expresslane.server.wire import ADD_PIECE_TOKENS, Abort, Add, ToEngine, add_messages

encode = msgspec.msgpack.Encoder().encode
decode = msgspec.msgpack.Decoder(ToEngine).decode


def _req(rid: str, tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [7] * tokens, SamplingParams(), (2,), 0.0)


def test_add_messages_cut_a_request_into_pieces_of_bounded_tokens():
    reqs = [_req(f"r{i}", 2047) for i in range(256)]
    pieces = add_messages(reqs)
    assert [r for p in pieces for r in p.requests] == reqs  # all of them, in order
    assert all(sum(len(r.prompt_token_ids) for r in p.requests) <= ADD_PIECE_TOKENS for p in pieces)
    assert len(pieces) == 256 // (ADD_PIECE_TOKENS // 2047) == 16
    assert len(add_messages([_req("a", 5), _req("b", 5)])) == 1  # a small request stays one message
    long = add_messages([_req("long", ADD_PIECE_TOKENS + 1), _req("next", 1)])
    assert [[r.request_id for r in p.requests] for p in long] == [["long"], ["next"]]


def _ids(msgs) -> list[str]:
    return [r.request_id if isinstance(m, Add) else f"abort:{','.join(m.request_ids)}"
            for m in msgs for r in (m.requests if isinstance(m, Add) else [None])]


def test_bulk_frames_wait_for_the_small_ones_and_come_a_budget_per_step():
    bulk = [encode(Add([_req(f"big{i}", 300)])) for i in range(5)]
    size = len(bulk[0])
    inbox = Inbox(decode, bulk_frame_bytes=size - 1, bulk_bytes_per_step=2 * size)
    for f in bulk:
        inbox.put(f)
    inbox.put(encode(Add([_req("short", 3)])))
    steps = []
    while inbox.has_bulk:
        steps.append(_ids(inbox.messages()))
    # the small message first, though it came last; then two bulk frames a step, in their order
    assert steps == [["short", "big0", "big1"], ["big2", "big3"], ["big4"]]
    one = Inbox(decode, bulk_frame_bytes=size - 1, bulk_bytes_per_step=1)
    one.put(bulk[0])
    assert _ids(one.messages()) == ["big0"]  # a budget below one frame still admits one a step


def test_an_abort_that_overtakes_its_bulk_add_drops_that_request():
    inbox = Inbox(decode, bulk_frame_bytes=100, bulk_bytes_per_step=1)
    inbox.put(encode(Add([_req("big", 500)])))
    inbox.put(encode(Abort(["big"])))
    msgs = iter(inbox.messages())
    abort = next(msgs)
    assert isinstance(abort, Abort)  # small: handled before the bulk Add it refers to
    inbox.aborted(abort.request_ids)
    add = next(msgs)
    assert inbox.dropped(add.requests[0].request_id)  # the engine skips it
    assert list(msgs) == []  # and once no bulk frame waits, the remembered aborts are forgotten
    assert not inbox.dropped("big")
    inbox.aborted(["x"])  # no bulk frame waiting: nothing to remember
    assert not inbox.dropped("x")
