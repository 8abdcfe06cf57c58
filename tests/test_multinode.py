"""Two "nodes" on one machine over loopback: node 1 is `expresslane serve --node-rank 1`
(workers only), node 0 the offline engine; tensor_parallel_size 2 over nnodes 2 (one rank
per node) gives the tokens of one process."""

import subprocess
import sys

from test_equivalence import GREEDY, LENGTHS, PROMPTS
from test_tensor_parallel import weight_numel

from expresslane import LLM
from expresslane.runner.tensor_parallel import free_port

PICKED = [0, 4, 8, 12] + list(range(len(LENGTHS), len(PROMPTS)))
CASE = dict(max_num_batched_tokens=64, max_model_len=512, num_kv_blocks=32, enable_prefix_caching=True)


def _generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in PICKED], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_two_nodes_over_loopback_match_one_process(model_dirs):
    model = str(model_dirs["qwen2"])
    ref = _generate(LLM(model, **CASE))
    addr = f"127.0.0.1:{free_port()}"
    dist = ["--tensor-parallel-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    node1 = subprocess.Popen([sys.executable, "-m", "expresslane.cli.main", "serve", model, *dist, "--node-rank", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        llm = LLM(model, tensor_parallel_size=2, nnodes=2, node_rank=0, dist_init_addr=addr, **CASE)
        try:
            got = _generate(llm)
            held = weight_numel(llm)
        finally:
            llm.shutdown()
        assert node1.wait(timeout=60) == 0, node1.stdout.read().decode(errors="replace")[-3000:]
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    assert got == ref
    assert len(held) == 2 and held[0] == held[1]  # rank 1 lives on "node 1" and holds its half


def test_node_rank_needs_an_address():
    out = subprocess.run([sys.executable, "-m", "expresslane.cli.main", "serve", "--tensor-parallel-size", "2",
                          "--nnodes", "2", "--node-rank", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "dist_init_addr" in out.stderr
