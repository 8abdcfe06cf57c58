"""Benchmark and diagnosis suite: drive any OpenAI-compatible server, measure, judge, report.

Layers (dependencies point down):

    cli.py          argparse hook: ``expresslane bench serving|traffic|report|one-batch|``
                    ``flat-latency|scenarios|doctor``
    doctor.py       issue #20's doctor: detect the server, measure with scenarios.py, name
                    the causes of unflat latency and the flags that address them
    scenarios.py    shorts beside a long prompt, Poisson mixed load, goodput sweep, isolated
                    TTFT, against any server (flat_report.py: their tables and chart)
    flat_latency.py the flat-latency experiment (TTFT alone vs mixed, per batching mode),
                    on targets.py: in-process LLM, transformers, or any server via client.py
    one_batch.py    one static batch in-process, step by step, against the bandwidth floor
    inprocess.py    random token prompts, RequestOutput -> RequestRecord, device sync
    serving.py      open-loop benchmark (arrival process, concurrency cap) + sweep.py
    traffic.py      closed-loop simulated users with per-second time series
    report.py       HTML page / PNG from result JSON files, drawing with charts.py
    slo.py          SLO verdict and likely cause, tables.py for console/HTML tables
    client.py       one streaming request -> RequestRecord
    datasets.py     prompts and lengths (random, sharegpt-like, mixed, JSONL)
    stats.py        RequestRecord list -> vLLM-compatible statistics
    records.py      RequestRecord and result JSON I/O

``stats``, ``records`` and ``slo`` know nothing of HTTP, so in-process benchmarks can
feed them records built from ``RequestOutput.metrics``.
"""
