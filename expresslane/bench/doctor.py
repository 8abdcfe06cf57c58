"""``expresslane bench doctor``: is this server flat, and if not, why and which flags fix it.

Against any OpenAI-compatible server (expresslane, vLLM, SGLang; which one is read from
``/v1/models``' ``owned_by``, else SGLang's ``/get_server_info``, else ``/version``), it
runs the flat-latency scenarios (``scenarios.py``: isolated, beside-long, mixed) and,
on expresslane, asks for the engine's own timestamps (``return_metrics``) to split a
prompt's TTFT into engine time and the server's time around it. Then ``diagnose`` (a
pure function of those measurements) names the causes:

  cause                          evidence
  head-of-line prefill           shorts' TTFT beside a long prompt >= 1.5x alone
  decode slowed by prefill       shorts' ITL p99 beside a long prompt or under the mixed
                                 load >= 2x the batch-1 ITL, or their total time >= 1.3x alone
  queueing                       under the mixed load, the median short TTFT >= 2x isolated
                                 (unless head-of-line prefill explains it)
  per-token server overhead      the server's time around the engine grows >= 2 us per
                                 prompt token and is >= 5% of a long prompt's TTFT

and the flags, with values from the same measurements, in the detected server's names
(expresslane: the deadline policy, whose steps the step-cost model sizes, and a smaller
interactive ``slack`` when decodes are slowed; vLLM and SGLang: the chunk and budget below):

  prefill_ms_per_token = slope of isolated TTFT over prompt length
  chunk  = tokens of prefill one decode step may carry and stay within 2x the batch-1
           ITL:  batch-1 ITL / prefill_ms_per_token, and at least a short prompt (a
           short prompt longer than the chunk would be chunked like a long one);
           multiples of 16
  budget = tokens of a step a just-arrived short prompt may wait behind, half its own
           TTFT:  0.5 * short TTFT alone / prefill_ms_per_token   (>= 2 chunks)
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from datetime import datetime

import aiohttp

from expresslane.bench import client
from expresslane.bench.flat_report import format_scenarios, times
from expresslane.bench.scenarios import Probe, ScenarioConfig, measure, open_probe
from expresslane.bench.serving import run_facts
from expresslane.bench.tables import fmt, text_table

SERVERS = ("expresslane", "vllm", "sglang")
HOL_RATIO = 1.5
ITL_RATIO = 2.0
TOTAL_RATIO = 1.3
QUEUE_RATIO = 2.0
OVERHEAD_US_PER_TOKEN = 2.0
OVERHEAD_SHARE = 0.05


@dataclass(frozen=True, slots=True)
class DoctorConfig:
    scenarios: ScenarioConfig  # the doctor runs isolated, beside-long and mixed of it

    def scenario_config(self) -> ScenarioConfig:
        s = self.scenarios
        lens = tuple(sorted({s.short_len, *s.isolated_lens, s.long_len}))
        return replace(s, run=("isolated", "beside-long", "mixed"), isolated_lens=lens)


# -- which server ---------------------------------------------------------------------------
async def detect_server(session: aiohttp.ClientSession, ep: client.Endpoint) -> dict:
    async def get(path: str) -> dict | None:
        try:
            async with session.get(ep.base_url + path, headers=ep.headers) as resp:
                return await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, ValueError):
            return None

    models = await get("/v1/models") or {}
    owner = next((str(c.get("owned_by", "")).lower() for c in models.get("data") or []
                  if c.get("id") == ep.model), "")
    version = (await get("/version") or {}).get("version")
    if owner in SERVERS:
        # ours says its scheduling policy at /load: a flag it already runs is no advice
        load = (await get("/load") or {}) if owner == "expresslane" else {}
        return {"name": owner, "version": version, "how": "/v1/models owned_by",
                "policy": load.get("scheduling_policy"), "pd_lanes": load.get("pd_lanes")}
    if await get("/get_server_info") is not None:
        return {"name": "sglang", "version": version, "how": "/get_server_info"}
    if version is not None:
        return {"name": "vllm", "version": version, "how": "/version (vLLM's)"}
    return {"name": "unknown", "version": None, "how": "nothing recognised"}


# -- server time around the engine (expresslane: return_metrics) ---------------------------------------
async def engine_split(p: Probe, lengths: list[int], repeats: int) -> dict | None:
    """Per prompt length: client-side time of a 1-token request, the engine's own TTFT
    (first token - engine arrival), and the difference (the server's part); None when the
    server does not return engine timestamps."""
    rows = {}
    for n in lengths:
        client_ms, engine_ms = [], []
        for _ in range(repeats):
            [(text, _)] = await p.prompts([n])
            body = client.request_body(p.endpoint, text, 1)
            body.pop("stream_options", None)
            body.update(stream=False, return_metrics=True)
            t0 = time.perf_counter()
            async with p.session.post(p.endpoint.url, json=body, headers=p.endpoint.headers) as resp:
                data = await resp.json(content_type=None) if resp.status == 200 else {}
            wall = (time.perf_counter() - t0) * 1e3
            m = data.get("metrics") if isinstance(data, dict) else None
            if not isinstance(m, dict) or m.get("first_token_time") is None:
                return None
            client_ms.append(wall)
            engine_ms.append((m["first_token_time"] - m["engine_arrival_time"]) * 1e3)
        rows[str(n)] = {"client_ms": min(client_ms), "engine_ttft_ms": min(engine_ms)}
        rows[str(n)]["server_ms"] = rows[str(n)]["client_ms"] - rows[str(n)]["engine_ttft_ms"]
    return rows


# -- diagnosis (pure) --------------------------------------------------------------------------
def prefill_ms_per_token(iso: dict) -> float | None:
    pts = sorted((int(n), t) for n, t in iso["ttft_ms"].items() if t is not None)
    if len(pts) < 2 or pts[-1][0] == pts[0][0]:
        return None
    (n0, t0), (n1, t1) = pts[0], pts[-1]
    return max((t1 - t0) / (n1 - n0), 1e-6)


def round16(x: float, low: int, high: int) -> int:
    return int(min(max(low, int(x) // 16 * 16), high))


def diagnose(m: dict, server: str, long_len: int, split: dict | None = None, policy: str | None = None) -> dict:
    """Causes with their evidence, and the flags (with values) that address them."""
    iso, b, mix = m["isolated"], m["beside_long"], m["mixed"]
    itl1 = iso["batch1_itl_ms"]
    per_tok = prefill_ms_per_token(iso)
    short_iso = iso["ttft_ms"].get(str(min(int(n) for n in iso["ttft_ms"])))
    causes = []
    r = b["ratios"]
    if r["short_ttft"] is not None and r["short_ttft"] >= HOL_RATIO:
        causes.append(("head-of-line prefill",
                       f"short prompts get their first token {r['short_ttft']:.1f}x later beside a {long_len}-token "
                       f"prompt ({fmt(b['alone']['short_ttft_ms'])} -> {fmt(b['beside']['short_ttft_ms'])} ms): "
                       "they wait behind its prefill"))
    worst_itl = max((x for x in (b["beside"]["short_itl_p99_ms"], mix["short_itl_p99_ms"]) if x is not None),
                    default=None)
    if itl1 and worst_itl is not None and (worst_itl >= ITL_RATIO * itl1 or (r["short_total"] or 0) >= TOTAL_RATIO):
        causes.append(("decode slowed by prefill chunks",
                       f"short ITL p99 {fmt(worst_itl)} ms against {fmt(itl1)} ms at batch 1 "
                       f"({worst_itl / itl1:.1f}x); short total time {times(r['short_total'])} alone: the steps "
                       "their decodes share with a prefill chunk are long"))
    hol = any(c == "head-of-line prefill" for c, _ in causes)  # it explains slow first tokens under load too
    if not hol and short_iso and mix["short_ttft_p50_ms"] is not None \
            and mix["short_ttft_p50_ms"] >= QUEUE_RATIO * short_iso:
        causes.append(("queueing", f"under {mix['rate']:g} req/s the median short TTFT is "
                       f"{fmt(mix['short_ttft_p50_ms'])} ms, {mix['short_ttft_p50_ms'] / short_iso:.1f}x isolated "
                       f"({fmt(short_iso)} ms): requests wait for a seat or for the steps ahead"))
    overhead = overhead_per_token(split)
    if overhead is not None:
        us, share, n = overhead
        if us >= OVERHEAD_US_PER_TOKEN and share >= OVERHEAD_SHARE:
            causes.append(("per-token server overhead",
                           f"the server adds {us:.1f} us per prompt token around the engine ({share:.0%} of a "
                           f"{n}-token prompt's TTFT)"))
    # a short prompt must fit one chunk (else it is chunked like a long one): chunk >= short_len
    short_len = min(int(n) for n in iso["ttft_ms"])
    chunk = round16(max(itl1 / per_tok, -(-short_len // 16) * 16), 16, long_len) if itl1 and per_tok else None
    budget = round16(0.5 * (b["alone"]["short_ttft_ms"] or 0) / per_tok, 2 * chunk, 8192) if chunk else None
    names = [c for c, _ in causes]
    return {"server": server, "prefill_ms_per_token": per_tok, "chunk": chunk, "budget": budget,
            "causes": [{"cause": c, "evidence": e} for c, e in causes],
            "flags": flags_for(server, names, chunk, budget, policy)}


def overhead_per_token(split: dict | None) -> tuple[float, float, int] | None:
    """(us per prompt token, share of the longest prompt's TTFT, its length) from `engine_split`."""
    if not split or len(split) < 2:
        return None
    pts = sorted((int(n), row) for n, row in split.items())
    (n0, a), (n1, z) = pts[0], pts[-1]
    us = (z["server_ms"] - a["server_ms"]) / (n1 - n0) * 1e3
    return us, z["server_ms"] / z["client_ms"] if z["client_ms"] else 0.0, n1


def flags_for(server: str, causes: list[str], chunk: int | None, budget: int | None,
              policy: str | None = None) -> list[str]:
    """Command-line flags of `server` for the causes, each once, in a fixed order; `policy`:
    the scheduling policy an expresslane server reported (None: unknown)."""
    prefill = {"head-of-line prefill", "decode slowed by prefill chunks"} & set(causes)
    out: list[str] = []
    if server == "expresslane":
        # deadline sizes every step with the step-cost model (the default); a fixed
        # --long-prefill-token-threshold or a small --max-num-batched-tokens would turn that off
        if (prefill or "queueing" in causes) and policy != "deadline":
            out.append("--scheduling-policy deadline")
        if "decode slowed by prefill chunks" in causes:
            out.append("--lane-slo interactive:slack=0.5")  # about half the default prefill per decode step
    elif server == "vllm":
        if prefill and chunk:  # vLLM caps every step's share of a long prefill, alone or not
            out += [f"--long-prefill-token-threshold {chunk}", f"--max-num-batched-tokens {max(2048, chunk)}"]
        if "queueing" in causes:
            out.append("--max-num-seqs 512")
    elif server == "sglang":
        if prefill and budget:
            out.append(f"--chunked-prefill-size {budget}")
        if "queueing" in causes:
            out.append("--max-running-requests 512")
    return out


NOTES = {
    "decode slowed by prefill chunks": "less prefill per step keeps the decodes' pace and makes long prompts "
                                       "wait longer: replaying 8 req/s with 15% 8k prompts offline on an H200 "
                                       "(Llama-3-8B shape), expresslane with slack 0.5 had an ITL p99 of 2.1x "
                                       "batch-1 and long prompts' TTFT of 0.69 s, against 3.7x and 0.42 s at "
                                       "the default 1.0 (docs/performance.md)",
    "per-token server overhead": "no flag removes it: the time goes between HTTP and the engine (see the "
                                 "breakdown above); for expresslane it is issue #20 item 4",
    "queueing": "if it stays after the flags, the offered load is past this server's capacity: lower it or "
                "add replicas",
}


# -- the command --------------------------------------------------------------------------------
async def _run(cfg: DoctorConfig) -> dict:
    sc = cfg.scenario_config()
    sc.validate()
    async with client.make_session() as session:
        p = await open_probe(session, sc)
        server = await detect_server(session, p.endpoint)
        measured = await measure(p, sc)
        split = await engine_split(p, [p.short_len, p.long_len], sc.repeats) if server["name"] == "expresslane" \
            else None
    diagnosis = diagnose(measured, server["name"], p.long_len, split, server.get("policy"))
    return {"kind": "flat-doctor", "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
            **run_facts(p.endpoint, p.maker, p.notices, []),
            **sc.settings(), "long_len_used": p.long_len,
            "server": server, **measured, "engine_split": split, "diagnosis": diagnosis}


def run_doctor(cfg: DoctorConfig) -> dict:
    return asyncio.run(_run(cfg))


def format_doctor(r: dict) -> str:
    d, s = r["diagnosis"], r["server"]
    out = [format_scenarios(r).rsplit("\n", 1)[0],
           f"server: {s['name']}{' ' + s['version'] if s['version'] else ''} (from {s['how']})"
           + (f", scheduling policy {s['policy']}" if s.get("policy") else "")
           + (f", --pd-lanes {s['pd_lanes']}" if s.get("pd_lanes") else "")]
    if split := r.get("engine_split"):
        rows = [[n, fmt(v["client_ms"]), fmt(v["engine_ttft_ms"]), fmt(v["server_ms"])] for n, v in split.items()]
        out += ["", "time of a 1-token request, split by the engine's timestamps (min of repeats)",
                text_table((["prompt tokens", "client ms", "engine TTFT ms", "server ms"], rows))]
    out += ["", "diagnosis:"]
    if not d["causes"]:
        out.append("  flat: no cause found (short requests barely notice the long prompt or the load)")
    for c in d["causes"]:
        out.append(f"  - {c['cause']}: {c['evidence']}")
    for c in d["causes"]:
        if note := NOTES.get(c["cause"]):
            out.append(f"    ({note})")
    if d["flags"]:
        out += ["", f"flags for {s['name']} (prefill {d['prefill_ms_per_token']:.4f} ms/token; chunk "
                    f"{d['chunk']}, budget {d['budget']} tokens):", "  " + " ".join(d["flags"])]
    elif d["causes"] and s["name"] == "unknown":
        out.append(f"  unknown server: a prefill chunk of about {d['chunk']} tokens per step and a step budget "
                   f"of about {d['budget']} tokens address the prefill causes")
    out.append("=" * 78)
    return "\n".join(out)
