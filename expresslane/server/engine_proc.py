"""The engine process: EngineCore's step loop behind two ZeroMQ sockets.

It ignores SIGTERM and SIGINT, which a supervisor may send the whole process group: the API
process drains, then sends ``Shutdown``; if the API process dies, this one exits within half a
second (``child_process.py``). The loop blocks on the input socket only when the engine
has nothing to run; otherwise it takes whatever messages arrived (a large request's
Adds a few per step: ``inbox.py``), steps once and sends that step's outputs. Tokenization, detokenization and stop strings live in the
API process: only token ids cross the socket.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from expresslane.child_process import exit_with_parent, ignore_stop_signals
from expresslane.config import EngineConfig
from expresslane.server.inbox import Inbox
from expresslane.server.profiler import EngineProfiler, ProfileError
from expresslane.server.wire import (Abort, Add, Failed, LoadLoRA, LoRADone, Outputs, Profile, Profiled, Ready,
                                    Shutdown, ToEngine, UnloadLoRA)

if TYPE_CHECKING:  # imported by run_engine, in the engine process: the API process imports this module too
    from expresslane.engine.core import EngineCore

log = logging.getLogger(__name__)


def engine_threads(environ: dict[str, str], cores: int) -> int | None:
    """Torch's CPU threads for the engine process: every core it may use but one, which the API
    process needs (tokenizing, streaming: torch's threads spinning against it lengthen every
    inter-token gap); None when the user set OMP_NUM_THREADS."""
    if "OMP_NUM_THREADS" in environ:
        return None
    return max(1, cores - 1)


def run_engine(engine_kwargs: dict[str, Any], in_addr: str, out_addr: str, log_level: str,
               profile_dir: str | None = None) -> None:
    """Process entry point (multiprocessing spawn target)."""
    ignore_stop_signals()
    exit_with_parent()
    import torch

    from expresslane.engine.core import EngineCore

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s engine %(name)s: %(message)s")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)  # not macOS
    threads = engine_threads(os.environ, cores)
    if threads is not None:
        torch.set_num_threads(threads)
    log.info("torch CPU threads: %d (%s)", torch.get_num_threads(),
             "OMP_NUM_THREADS" if threads is None else "the cores this process may use, one left to the API process")
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.bind(in_addr)  # the API process connects: its messages queue until this bind
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    out.connect(out_addr)
    encode = msgspec.msgpack.Encoder().encode
    try:
        core = EngineCore(EngineConfig.from_kwargs(**engine_kwargs))
    except Exception as e:  # reported to the API process, which exits with the message
        log.exception("engine start failed")
        out.send(encode(Failed(f"{type(e).__name__}: {e}")))
        raise SystemExit(1) from e
    # What start-up left alive (the model, torch's modules, graphs) lives as long as the process:
    # out of the collector's reach, a full collection during serving scans only what serving made
    # (it scanned 280k start-up objects, ~90 ms, inside a step).
    gc.collect()
    gc.freeze()
    out.send(encode(Ready(core.max_model_len, core.config.cache.num_kv_blocks, core.cost_model.to_dict(),
                          core.config.scheduler.max_num_batched_tokens, core.config.scheduler.scheduling_policy,
                          core.runner_type, core.hf_config.hidden_size, core.hf_config.vocab_size,
                          core.config.scheduler.pd_lanes)))
    try:
        _loop(core, inp, out, encode, EngineProfiler(profile_dir) if profile_dir else None)
    finally:
        out.close(linger=0)  # the API process is stopping or gone: nothing is left to deliver
        inp.close(linger=0)
        ctx.term()
    logging.shutdown()
    os._exit(0)  # skip the interpreter's teardown of torch (seconds on a busy machine): nothing is left to save


def _profile(profiler: EngineProfiler | None, start: bool) -> Profiled:
    if profiler is None:  # the API process refuses first; this is a backstop
        return Profiled(error="profiling is off: start the server with --profile-dir DIR", status=400)
    try:
        if start:
            profiler.start()
            return Profiled()
        return Profiled(trace=profiler.stop())
    except ProfileError as e:
        return Profiled(error=str(e), status=400)
    except Exception as e:  # e.g. the trace could not be written: the engine goes on serving
        log.exception("profile %s failed", "start" if start else "stop")
        return Profiled(error=f"{type(e).__name__}: {e}", status=500)


def _lora(core: EngineCore, msg: LoadLoRA | UnloadLoRA, loading: set[int]) -> LoRADone | None:
    """The answer, or None: a load read off the step loop, answered by `_loaded` (the API process
    sends one change at a time)."""
    if isinstance(msg, UnloadLoRA):
        if core.remove_lora(msg.lora_int_id):
            return LoRADone()
        return LoRADone(f"no LoRA adapter with id {msg.lora_int_id}", 404)
    try:
        core.add_lora(msg.lora, wait=False)
    except ValueError as e:  # --enable-lora off
        return LoRADone(str(e), 400)
    loading.add(msg.lora.lora_int_id)
    return None


def _loaded(core: EngineCore, loading: set[int]) -> list[LoRADone]:
    """The answers to loads whose read has finished (a bad directory, a rank over --max-lora-rank: 400)."""
    done = []
    for lora_id, error in core.take_lora_reads().items():
        if lora_id in loading:
            loading.discard(lora_id)
            done.append(LoRADone() if error is None else LoRADone(error, 400))
    return done


def _loop(core: EngineCore, inp: zmq.Socket, out: zmq.Socket, encode, profiler: EngineProfiler | None) -> None:
    inbox = Inbox(msgspec.msgpack.Decoder(ToEngine).decode)
    loading: set[int] = set()  # adapters read for a LoadLoRA
    while True:
        busy = core.has_unfinished() or inbox.has_bulk
        if not busy:
            inp.poll(1 if loading else None)  # idle: wait for a message (a read in flight: 1 ms at most)
        while inp.poll(0):
            inbox.put(inp.recv())
        outputs, received, rejected, handled = [], {}, {}, False
        for msg in inbox.messages():
            handled = True
            if isinstance(msg, Add):
                for req in msg.requests:
                    if inbox.dropped(req.request_id):
                        continue
                    try:
                        core.add_request(req)
                        received[req.request_id] = time.monotonic()
                    except ValueError as e:  # the API process validates first; this is a backstop
                        rejected[req.request_id] = str(e)
            elif isinstance(msg, Abort):
                outputs += core.abort(msg.request_ids)
                inbox.aborted(msg.request_ids)
            elif isinstance(msg, Profile):
                out.send(encode(_profile(profiler, msg.start)))
            elif isinstance(msg, (LoadLoRA, UnloadLoRA)):
                done = _lora(core, msg, loading)
                if done is not None:
                    out.send(encode(done))
            elif isinstance(msg, Shutdown):
                return
        if not (busy or handled or loading):
            continue
        outputs += core.step()  # with nothing to run, an empty step just refreshes the stats
        for done in _loaded(core, loading):
            out.send(encode(done))
        rejected.update(core.take_rejected())
        if core.held and not (outputs or received or rejected):
            continue  # nothing launched (the step on the GPU is far from its end): nothing to tell
        out.send(encode(Outputs(outputs, core.stats(), time.monotonic(), received, rejected)))
