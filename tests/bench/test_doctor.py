"""bench doctor and bench scenarios: the decision logic on recorded measurements (no wall
clock), server detection, and end to end against the fake server and a real
`expresslane serve --scheduling-policy fcfs` whose flags the doctor then fixes."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from aiohttp import web

from expresslane.bench import client
from expresslane.bench.doctor import detect_server, diagnose, format_doctor
from expresslane.bench.flat_report import format_scenarios

from .conftest import bench
from .fake_server import Behavior


def h200(short_alone=31.0, short_beside=175.0, total_alone=342.0, total_beside=855.0, itl_beside_p99=71.0,
         mixed_p50=17.0, mixed_p99=210.0, mixed_itl_p99=71.0) -> dict:
    """Issue #20's H200 figures (expresslane with default flags), in the scenarios' layout."""
    def shorts(ttft, total, itl_p99):
        return {"short_ttft_ms": ttft, "short_total_ms": total, "short_itl_p50_ms": 4.8, "short_itl_p99_ms": itl_p99,
                "short_tpot_ms": 5.0, "failed": 0}
    alone, beside = shorts(short_alone, total_alone, 6.0), shorts(short_beside, total_beside, itl_beside_p99)
    return {
        "isolated": {"ttft_ms": {"64": 8.0, "128": 8.3, "2048": 55.3, "8192": 267.0}, "batch1_itl_ms": 4.65,
                     "failed": 0},
        "beside_long": {"alone": alone, "beside": beside, "long_ttft_ms": 294.0, "long_alone_ttft_ms": 267.0,
                        "long_failed": 0,
                        "ratios": {"short_ttft": short_beside / short_alone, "short_total": total_beside / total_alone,
                                   "short_itl_p99": itl_beside_p99 / 4.8, "long_ttft": 294 / 267}},
        "mixed": {"rate": 8.0, "requests": 160, "short_ttft_p50_ms": mixed_p50, "short_ttft_p99_ms": mixed_p99,
                  "short_itl_p99_ms": mixed_itl_p99, "short_total_p50_ms": 400.0, "long_ttft_p50_ms": 295.0,
                  "good_per_s": 6.4, "good_fraction": 0.85, "failed": 0, "errors": []},
    }


def causes(d: dict) -> list[str]:
    return [c["cause"] for c in d["causes"]]


def test_default_flags_on_h200_name_head_of_line_and_slow_decode_with_sized_flags():
    d = diagnose(h200(), "expresslane", 8192)
    assert causes(d) == ["head-of-line prefill", "decode slowed by prefill chunks"]
    # prefill costs (267 - 8) / (8192 - 64) ms a token; a 4.65 ms decode step carries ~146 of them
    assert d["prefill_ms_per_token"] == pytest.approx(0.0319, rel=0.01)
    assert d["chunk"] == 144  # inside the 100-150 tokens of a decode step's slack
    assert d["budget"] == 480  # a step half as long as the shorts' own TTFT alone
    # ours: the deadline policy sizes steps itself (the cost model); a smaller slack for decodes
    assert d["flags"] == ["--scheduling-policy deadline", "--lane-slo interactive:slack=0.5"]


def test_no_flag_for_the_policy_the_server_already_runs():
    """An expresslane server that reports `deadline` at /load is not told to use it."""
    d = diagnose(h200(), "expresslane", 8192, policy="deadline")
    assert d["flags"] == ["--lane-slo interactive:slack=0.5"]
    m = h200(short_beside=33.0, total_beside=380.0, itl_beside_p99=7.0, mixed_p50=40.0, mixed_p99=300.0,
             mixed_itl_p99=8.0)
    assert diagnose(m, "expresslane", 8192, policy="deadline")["flags"] == []
    assert diagnose(m, "expresslane", 8192, policy="fcfs")["flags"] == ["--scheduling-policy deadline"]


def test_flags_use_the_detected_server_names():
    m = h200()
    assert diagnose(m, "vllm", 8192)["flags"] == ["--long-prefill-token-threshold 144",
                                                  "--max-num-batched-tokens 2048"]
    assert diagnose(m, "sglang", 8192)["flags"] == ["--chunked-prefill-size 480"]
    assert diagnose(m, "unknown", 8192)["flags"] == []


def test_a_flat_server_gets_no_cause_and_no_flags():
    # tuned vLLM's shape: shorts barely notice the long prompt, decode keeps its pace
    m = h200(short_beside=33.0, total_beside=380.0, itl_beside_p99=7.0, mixed_p50=9.0, mixed_p99=30.0,
             mixed_itl_p99=8.0)
    d = diagnose(m, "vllm", 8192)
    assert d["causes"] == [] and d["flags"] == []


def test_queueing_without_head_of_line_blocking():
    m = h200(short_beside=33.0, total_beside=380.0, itl_beside_p99=7.0, mixed_p50=40.0, mixed_p99=300.0,
             mixed_itl_p99=8.0)
    d = diagnose(m, "expresslane", 8192)
    assert causes(d) == ["queueing"]
    assert d["flags"] == ["--scheduling-policy deadline"]


def test_per_token_server_overhead_from_the_engine_timestamps():
    m = h200(short_beside=33.0, total_beside=380.0, itl_beside_p99=7.0, mixed_p50=9.0, mixed_itl_p99=8.0)
    # issue #20: ~8 us per prompt token between HTTP and the engine (+68 ms at 8k)
    split = {"64": {"client_ms": 9.0, "engine_ttft_ms": 6.1, "server_ms": 2.9},
             "8192": {"client_ms": 267.0, "engine_ttft_ms": 199.0, "server_ms": 68.0}}
    d = diagnose(m, "expresslane", 8192, split)
    assert causes(d) == ["per-token server overhead"]
    assert "8.0 us per prompt token" in d["causes"][0]["evidence"]
    assert d["flags"] == []  # no flag removes it; the report says so
    flat = diagnose(m, "expresslane", 8192, {**split, "8192": {"client_ms": 201.0, "engine_ttft_ms": 199.0,
                                                               "server_ms": 2.0}})
    assert flat["causes"] == []


class _Server:
    """A few GET routes on a free port, to see what detect_server makes of them."""

    def __init__(self, routes: dict[str, dict]):
        self.routes, self.loop = routes, asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.runner = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result()

    async def _start(self):
        app = web.Application()
        for path, body in self.routes.items():
            async def answer(_req, body=body):
                return web.json_response(body)
            app.router.add_get(path, answer)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return runner

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.mark.parametrize("routes, name", [
    ({"/v1/models": {"data": [{"id": "m", "owned_by": "vllm"}]}, "/version": {"version": "0.26.0"}}, "vllm"),
    ({"/v1/models": {"data": [{"id": "m", "owned_by": "sglang"}]}}, "sglang"),
    ({"/v1/models": {"data": [{"id": "m", "owned_by": "org"}]}, "/get_server_info": {}}, "sglang"),
    ({"/v1/models": {"data": [{"id": "m"}]}, "/version": {"version": "0.9"}}, "vllm"),
    ({"/v1/models": {"data": [{"id": "m"}]}}, "unknown"),
])
def test_detect_server(routes, name):
    srv = _Server(routes)
    try:
        async def go():
            async with client.make_session() as session:
                return await detect_server(session, client.Endpoint(srv.url, "m"))
        assert asyncio.run(go())["name"] == name
    finally:
        srv.stop()


def test_scenarios_against_a_server_that_prefills_one_prompt_at_a_time(server, tmp_path):
    """The fake server prefills first come first served: the shorts wait behind the long prompt."""
    server.configure(Behavior(ttft=0.002, itl=0.002, prefill_per_token=0.0002, max_model_len=1000))
    out, chart = tmp_path / "s.json", tmp_path / "s.png"
    assert bench("scenarios", "--base-url", server.base_url, "--num-short", "4", "--repeats", "1",
                 "--output-len", "4", "--short-len", "16", "--rate", "10", "--duration", "1",
                 "--rates", "5,10", "--sweep-duration", "1", "--isolated-lens", "16,600",
                 "--output", str(out), "--chart", str(chart)) == 0
    r = json.loads(out.read_text())
    assert r["long_len_used"] == 1000 - 4 - 1  # cut to the server's context
    b = r["beside_long"]
    # ordering facts and lower bounds (a busy machine delays, never hastens): the shorts wait for
    # the long prompt's 995 tokens of prefill (0.2 s on this fake server), sent 5 ms before them
    assert b["beside"]["short_ttft_ms"] > b["alone"]["short_ttft_ms"]
    assert b["beside"]["short_ttft_ms"] > 995 * 0.2 - 5 - 10
    assert r["isolated"]["ttft_ms"]["600"] > r["isolated"]["ttft_ms"]["16"]
    assert [p["rate"] for p in r["goodput"]["points"]] == [5.0, 10.0]
    assert r["mixed"]["failed"] == 0 and r["mixed"]["requests"] == 10
    assert chart.read_bytes()[:4] == b"\x89PNG"
    assert "beside the long" in format_scenarios(r)


def test_doctor_end_to_end_on_expresslane_fcfs_then_with_its_flags(tmp_path):
    """The doctor names a cause on `serve --scheduling-policy fcfs` and prints flags; a server
    started with them is flatter: its shorts' TTFT beside the long prompt, as a ratio to
    alone, is lower (an ordering fact; on fcfs the shorts wait for a whole ~1000-token step)."""
    from server.conftest import Server

    common = ["--num-short", "8", "--repeats", "1", "--duration", "2", "--rate", "4", "--output-len", "16"]

    def doctor(*serve_args: str) -> dict:
        # the doctor measures this machine's latency: the engine sizes steps by its calibrated model
        srv = Server("--max-model-len", "1024", "--step-cost-model", "calibrate", *serve_args, api_key=None).wait_ready()
        try:
            out = tmp_path / "doctor.json"
            assert bench("doctor", "--base-url", srv.url, *common, "--output", str(out)) == 0
        finally:
            srv.stop()
        r = json.loads(out.read_text())
        assert r["server"]["name"] == "expresslane"
        assert r["engine_split"] is not None  # return_metrics: the engine's own TTFT
        return r

    before = doctor("--scheduling-policy", "fcfs")
    assert before["server"]["policy"] == "fcfs"  # from /load
    d = before["diagnosis"]
    assert "head-of-line prefill" in causes(d), format_doctor(before)
    assert d["flags"][0] == "--scheduling-policy deadline"
    assert "  " + " ".join(d["flags"]) in format_doctor(before)
    after = doctor(*(x for flag in d["flags"] for x in flag.split()))
    assert after["server"]["policy"] == "deadline"
    assert after["beside_long"]["ratios"]["short_ttft"] < before["beside_long"]["ratios"]["short_ttft"], \
        format_doctor(before) + "\n" + format_doctor(after)
