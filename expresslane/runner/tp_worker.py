"""A tensor-parallel rank other than 0: loads its slice, runs rank 0's commands.

    python -m expresslane.runner.tp_worker --rank R --local-rank L --local-world-size M --world-size N \\
        --init-addr HOST:PORT --device-type cpu|cuda
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist

from expresslane.child_process import exit_with_parent, ignore_stop_signals
from expresslane.runner.tensor_parallel import ReceivingSampler, init_group, rank_config, run_command
from expresslane.distributed.group import TPGroup
from expresslane.models.model_dir import load_hf_config
from expresslane.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)


@torch.inference_mode()
def run_worker(rank: int, local_rank: int, local_world_size: int, world_size: int, init_addr: str,
               dev_type: str) -> None:
    ignore_stop_signals()  # the engine stops it
    exit_with_parent()
    if dev_type == "cpu":  # the node's ranks share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    control = init_group(rank, world_size, init_addr, dev_type)
    msg = [None]
    dist.broadcast_object_list(msg, src=0, group=control)
    config, model_dir = msg[0]
    tp = TPGroup(rank, world_size, expert_parallel=config.parallel.enable_expert_parallel)
    runner = ModelRunner(rank_config(config, local_rank), load_hf_config(model_dir), Path(model_dir), tp)
    runner.sampler = ReceivingSampler(tp)
    log.info("tensor-parallel rank %d/%d ready on %s", rank, world_size, runner.device)
    while True:
        dist.broadcast_object_list(msg, src=0, group=control)
        method, args = msg[0]
        if method == "shutdown":
            break
        run_command(runner, control, method, args)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--local-rank", type=int, required=True)
    p.add_argument("--local-world-size", type=int, required=True, help="ranks on this node")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--init-addr", required=True)
    p.add_argument("--device-type", choices=("cpu", "cuda"), required=True)
    p.add_argument("--log-level", default=os.environ.get("EXPRESSLANE_WORKER_LOG_LEVEL", "WARNING"))
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s rank{args.rank} %(name)s: %(message)s")
    run_worker(args.rank, args.local_rank, args.local_world_size, args.world_size, args.init_addr, args.device_type)


if __name__ == "__main__":
    main()
