"""Benchmark and diagnosis suite: drive any OpenAI-compatible server, measure, judge, report.

Layers (dependencies point down):

    cli.py          argparse hook: ``expresslane bench serving|traffic|report|one-batch|``
                    ``flat-latency|scenarios|doctor|throughput|server-overhead``
    doctor.py       issue #20's doctor: detect the server, measure with scenarios.py, name
                    the causes of unflat latency and the flags that address them
    scenarios.py    shorts beside a long prompt, Poisson mixed load, goodput sweep, isolated
                    TTFT, against any server (flat_report.py: their tables and chart)
    flat_latency.py the flat-latency experiment (TTFT alone vs mixed, per batching mode),
                    on targets.py: in-process LLM, transformers, or any server via client.py
    one_batch.py    one static batch in-process, step by step, against floors.py
    throughput.py   offline throughput, expresslane against transformers
    accuracy.py     a quantized model's accuracy against the unquantized one, in-process
    inprocess.py    the modes, random token prompts, RequestOutput -> RequestRecord, sync
    serving.py      open-loop benchmark (arrival process, concurrency cap) + sweep.py
    traffic.py      closed-loop simulated users with per-second time series
    overhead.py     HTTP TTFT minus the engine's TTFT (an expresslane server's metrics)
    report.py       HTML page / PNG from result JSON files, drawing with charts.py
    slo.py          SLO verdict and likely cause, tables.py for console/HTML tables
    client.py       the server's model and context; one streaming request -> RequestRecord
    datasets.py     request shapes (random, sharegpt-like, mixed, prefix-repetition, JSONL)
    prompts.py      fresh prompts of exact lengths (the server's /tokenize, or --tokenizer)
    stats.py        RequestRecord list -> vLLM-compatible statistics
    records.py      RequestRecord and result JSON I/O

The GPU profiling scripts in ``benchmarks/`` use ``floors``, ``inprocess`` and ``stats``.

``stats``, ``records`` and ``slo`` know nothing of HTTP, so in-process benchmarks can
feed them records built from ``RequestOutput.metrics``.
"""
