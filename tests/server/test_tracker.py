"""RequestTracker on its own (no server): a malformed engine output fails its request only."""

from __future__ import annotations

import asyncio

import msgspec

from expresslane.contract import EngineCoreOutput, StepStats
from expresslane.outputs import RequestOutput
from expresslane.sampling_params import SamplingParams
from expresslane.server.admission import AdmissionLimits, AdmissionPolicy
from expresslane.server.errors import APIError
from expresslane.server.metrics import Metrics
from expresslane.server.tracker import RequestTracker
from expresslane.server.wire import FromEngine, Outputs

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(FromEngine).decode


def engine_turn(*outputs) -> bytes:
    """An engine message as the engine process encodes it; an output may be a raw dict (malformed)."""
    msg = msgspec.to_builtins(Outputs([], StepStats(1, 0, 0.1, 2, 2, 0.01), 1.0))
    msg["outputs"] = [msgspec.to_builtins(o) if isinstance(o, EngineCoreOutput) else o for o in outputs]
    return _encode(msg)


def test_a_malformed_output_fails_its_request_and_no_other(llm):
    async def main():
        admission = AdmissionPolicy(AdmissionLimits())
        tracker = RequestTracker(llm.tokenizer, admission, Metrics("tiny"))
        params = SamplingParams(n=2, max_tokens=4)
        good, good_batch = tracker.add("good", [("hello", [1, 2, 3])], params, lane="interactive", priority=0,
                                       eos=(0,), timeout=None)
        bad, bad_batch = tracker.add("bad", [("there", [4, 5]), ("again", [6])], SamplingParams(max_tokens=4),
                                     lane="interactive", priority=0, eos=(0,), timeout=None)
        assert [r.request_id for r in good_batch] == ["good-0#0", "good-0#1"]
        assert [r.request_id for r in bad_batch] == ["bad-0", "bad-1"]
        assert admission.waiting_seqs == 4
        to_abort = tracker.handle(_decode(engine_turn(
            EngineCoreOutput("good-0#0", [7]),
            {"request_id": "bad-0", "new_token_ids": [8], "new_logprobs": [None]},  # issue #19 item 0's shape
            EngineCoreOutput("good-0#1", [9]),
            {"new_token_ids": "no id at all"},  # cannot be attributed: logged and dropped
        )))
        assert sorted(to_abort) == ["bad-0", "bad-1"]  # the failed request's work stops in the engine
        err = bad.queue.get_nowait()
        assert isinstance(err, APIError) and err.code == "internal_error" and "malformed" in err.message
        out = good.queue.get_nowait()
        assert isinstance(out, RequestOutput) and [c.token_ids for c in out.outputs] == [[7], [9]]
        assert len(tracker) == 1 and admission.waiting_seqs == 0  # both good sequences started
        # the failed request's late outputs are ignored; the good one carries on to its end
        to_abort = tracker.handle(_decode(engine_turn(
            EngineCoreOutput("bad-1", [1]),
            EngineCoreOutput("good-0#0", [1], finish_reason="stop"),
            EngineCoreOutput("good-0#1", [2], finish_reason="length"))))
        assert to_abort == [] and len(tracker) == 0
        final = good.queue.get_nowait()
        assert final.finished and [c.finish_reason for c in final.outputs] == ["stop", "length"]

    asyncio.run(main())


def test_an_abort_stops_waiting_and_returns_every_engine_sequence(llm):
    async def main():
        admission = AdmissionPolicy(AdmissionLimits())
        tracker = RequestTracker(llm.tokenizer, admission, Metrics("tiny"))
        group, batch = tracker.add("x", [("a", [1, 2]), ("b", [3])], SamplingParams(n=3), lane="batch", priority=1,
                                   eos=(0,), timeout=None)
        assert (admission.waiting_seqs, admission.waiting_tokens) == (6, 9)
        assert {r.request_prompt_tokens for r in batch} == {3}  # each sequence carries its request's prompt work
        assert tracker.abort("x-0") == ["x-0#0", "x-0#1", "x-0#2"]
        assert tracker.abort("x-0") == []  # idempotent
        assert (admission.waiting_seqs, admission.waiting_tokens) == (3, 3)
        tracker.fail_all(APIError(500, "gone", "internal_error"))
        assert isinstance(group.queue.get_nowait(), APIError)
        assert len(tracker) == 0 and admission.waiting_seqs == 0

    asyncio.run(main())


def test_the_chat_role_chunk_waits_for_the_first_token(llm):
    """vLLM's chat stream sends its role chunk with the first token; clients that start TTFT at
    the first chunk with choices (``vllm bench serve --backend openai-chat``) rely on it."""
    from expresslane.server.serving import Chat

    async def main():
        tracker = RequestTracker(llm.tokenizer, AdmissionPolicy(AdmissionLimits()), Metrics("tiny"))
        group, _ = tracker.add("c", [("hi", [1, 2])], SamplingParams(max_tokens=2), lane="interactive",
                               priority=0, eos=(0,), timeout=None)
        stream = Chat(None, "tiny", "chatcmpl-c", group, SamplingParams(max_tokens=2), False, False).stream()
        first = asyncio.ensure_future(anext(stream))
        for _ in range(20):  # let the stream run as far as it can without an engine output
            await asyncio.sleep(0)
        assert not first.done()  # nothing sent before the engine's first token
        tracker.handle(_decode(engine_turn(EngineCoreOutput("c-0", [7]))))
        role = await first
        assert b'"role":"assistant"' in role.replace(b" ", b"")
        tracker.handle(_decode(engine_turn(EngineCoreOutput("c-0", [8], finish_reason="length"))))
        rest = [chunk async for chunk in stream]
        assert rest[-1] == b"data: [DONE]\n\n" and all(b'"role"' not in c for c in rest)

    asyncio.run(main())


def test_a_finished_request_leaves_no_reference_cycles(llm):
    """Its outputs (for n=128 with logprobs, tens of MB) are freed by refcount the moment the last
    reference goes, not by a later full collection: the API process's memory returns after it."""
    import gc

    async def main():
        tracker = RequestTracker(llm.tokenizer, AdmissionPolicy(AdmissionLimits()), Metrics("tiny"))
        group, _ = tracker.add("r", [("hello", [1, 2, 3]), ("there", [4])], SamplingParams(n=2, max_tokens=2,
                               logprobs=2), lane="interactive", priority=0, eos=(0,), timeout=None)
        lp = [{7: -0.1, 8: -2.0}]
        tracker.handle(_decode(engine_turn(*(EngineCoreOutput(f"r-{p}#{c}", [7], new_logprobs=lp)
                                             for p in range(2) for c in range(2)))))
        tracker.handle(_decode(engine_turn(*(EngineCoreOutput(f"r-{p}#{c}", [8], new_logprobs=lp,
                                                               finish_reason="length")
                                             for p in range(2) for c in range(2)))))
        outs = [group.queue.get_nowait() for _ in range(4)]
        assert len(tracker) == 0 and all(o.finished for o in outs[2:])
        return group, outs

    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        group, outs = asyncio.run(main())
        del group, outs
        gc.collect()
        ours = {type(o).__name__ for o in gc.garbage if type(o).__module__.startswith("expresslane")}
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert ours == set(), f"reference cycles through {ours}"


def test_top_logprobs_read_as_the_engine_dict():
    from expresslane.server.tracker import TopLogprobs

    lp = {7: -0.125, 3: -1.5, 2**31 - 1: -30.000000000000004}
    top = TopLogprobs(lp)
    assert list(top.items()) == list(lp.items())  # order and exact floats kept
    assert [top.get(t) for t in (7, 3, 2**31 - 1, 5)] == [-0.125, -1.5, -30.000000000000004, None]
    assert top.get(5, float("-inf")) == float("-inf")
    assert list(TopLogprobs({}).items()) == []


def test_a_burst_of_engine_turns_lets_other_tasks_run_between_them(llm):
    """zmq.asyncio hands a queued message back without suspending: the reader must yield
    between turns itself, or a fast engine's burst holds /health and every stream."""
    from expresslane.server.engine_client import EngineClient

    class QueuedLink:  # five turns already waiting on the socket, then nothing
        def __init__(self):
            self.turns = [_decode(engine_turn()) for _ in range(5)]

        async def recv(self):
            if self.turns:
                return self.turns.pop(0)
            await asyncio.Event().wait()

        def send(self, msg):
            raise AssertionError(f"nothing to abort, got {msg!r}")

    async def main():
        client = EngineClient({}, Metrics("tiny"), AdmissionLimits(), "info")
        client.tracker = RequestTracker(llm.tokenizer, client.admission, client.metrics)
        order: list[str] = []
        handle = client.tracker.handle
        client.tracker.handle = lambda msg: (order.append("turn"), handle(msg))[1]

        async def other_request():  # runs until the reader has taken every turn
            while order.count("turn") < 5 and len(order) < 50:
                order.append("other")
                await asyncio.sleep(0)

        reader = asyncio.create_task(client._read(QueuedLink()))
        await other_request()
        reader.cancel()
        assert order.count("turn") == 5
        assert all(order[i:i + 2] != ["turn", "turn"] for i in range(len(order) - 1)), order

    asyncio.run(main())
