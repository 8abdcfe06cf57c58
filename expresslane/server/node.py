"""A node other than node 0 (``--node-rank N > 0``): it runs its share of the tensor-parallel
ranks as worker processes and no server. Ranks ``N * per_node .. (N + 1) * per_node - 1``,
with ``per_node = tensor_parallel_size / nnodes``, meet node 0 at ``--dist-init-addr``
(SGLang's flags and meanings). The model directory must exist at the same path on every
node. Exits when its workers do (node 0 stopped, or a worker failed).
"""

from __future__ import annotations

import logging
import signal

from expresslane.config import EngineConfig
from expresslane.runner.tensor_parallel import device_type, spawn_workers

log = logging.getLogger(__name__)


def run_worker_node(config: EngineConfig) -> int:
    p = config.parallel
    per_node = p.tensor_parallel_size // p.nnodes
    first = p.node_rank * per_node
    ranks = [(first + i, i) for i in range(per_node)]
    procs = spawn_workers(ranks, per_node, p.tensor_parallel_size, p.dist_init_addr, device_type(config))
    log.warning("node %d/%d: ranks %d..%d of %d, meeting node 0 at %s", p.node_rank, p.nnodes, first,
                first + per_node - 1, p.tensor_parallel_size, p.dist_init_addr)

    def stop(signum, frame):  # workers ignore SIGTERM (child_process.py): only rank 0 stops them gracefully
        for proc in procs:
            proc.kill()

    signal.signal(signal.SIGTERM, stop)
    codes = [proc.wait() for proc in procs]
    return max(codes, key=abs, default=0)
