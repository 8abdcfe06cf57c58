"""The routing policy on its own (no processes, no clock): lanes, predicted TTFT, prefix
affinity, health."""

from expresslane.cost_model.piecewise import PiecewiseStepCostModel
from expresslane.router.policy import CHUNK_CHARS, Load, Replica, choose, predict_ttft

COST = PiecewiseStepCostModel([1, 256], [0.001, 0.0036])  # 1 ms a step + 10 us a token


def replica(url: str, waiting: int = 0, batch: int = 0, running: int = 0, state: str = "ready") -> Replica:
    load = Load(state=state, num_running=running, waiting_tokens={"interactive": waiting, "batch": batch},
                step_cost=COST, budget=256)
    return Replica(url, healthy=True, load=load)


def test_short_interactive_avoids_the_replica_in_a_long_prefill():
    busy, idle = replica("busy", waiting=8000, running=1), replica("idle", running=30)
    assert choose([busy, idle], "interactive", "hello there") is idle
    assert predict_ttft(busy, 3) > 10 * predict_ttft(idle, 3)
    # the other way round too: the order of the replicas does not matter
    assert choose([idle, busy], "interactive", "hello there") is idle


def test_prefix_affinity_keeps_a_conversation_on_its_replica():
    a, b = replica("a"), replica("b")
    first = "system: be brief\n" + "user: " + "tell me about the sea " * 20
    home = choose([a, b], "interactive", first)
    other = b if home is a else a
    # later turns extend the conversation: same replica, also when it is a little busier
    home.load.waiting_tokens["interactive"] = 40
    for turn in range(3):
        first += f"assistant: answer {turn}\nuser: and then? " + "x" * CHUNK_CHARS
        assert choose([a, b], "interactive", first) is home
    # an unrelated prompt goes to the idle replica
    assert choose([a, b], "interactive", "an unrelated question " * 12) is other
    # but not when the replica holding the prefix is far busier than the prefix is long
    home.load.waiting_tokens["interactive"] = 50_000
    assert choose([a, b], "interactive", first + "more") is other


def test_batch_work_fills_the_least_loaded_replica():
    a, b = replica("a", waiting=100, batch=400), replica("b", waiting=300)
    assert choose([a, b], "batch", "summarize this") is b
    # interactive looks at interactive work ahead (batch work at its budget share)
    assert choose([a, b], "interactive", "quick") is a


def test_only_healthy_ready_replicas_are_candidates():
    dead, draining, ok = replica("dead"), replica("draining", state="draining"), replica("ok", waiting=10_000)
    dead.healthy = False
    assert choose([dead, draining, ok], "interactive", "hi") is ok
    assert choose([dead, draining], "interactive", "hi") is None


def test_pending_tokens_sent_by_the_router_count_before_the_next_poll():
    a, b = replica("a"), replica("b")
    a.pending["interactive"] = 5000  # sent, not yet in a's /load
    assert choose([a, b], "interactive", "hi") is b


def test_prediction_without_a_cost_model_uses_rate_then_queue_depth():
    r = Replica("r", healthy=True, load=Load(state="ready", waiting_tokens={"interactive": 1000}, prefill_rate=1000.0))
    assert abs(predict_ttft(r, 1000) - 2.0) < 1e-9
    q1 = Replica("q1", healthy=True, load=Load(state="ready", num_waiting=1))
    q5 = Replica("q5", healthy=True, load=Load(state="ready", num_waiting=5))
    assert choose([q5, q1], "interactive", "hi") is q1
