"""`LLM`'s inspection methods (apply_model, collective_rpc, cuda_graph_sizes, shutdown, the resolved config), in
one process and over tensor-parallel ranks, against the checkpoint as transformers loads it."""

import threading

import pytest
import torch
from models import hf_greedy
from transformers import AutoModelForCausalLM

from expresslane import LLM, SamplingParams

ENGINE = dict(max_model_len=128, num_kv_blocks=16, scheduling_policy="fcfs")
PROMPT = [5, 77, 300, 12, 9, 400, 31]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def hf(llama_dir):
    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


def test_apply_model_in_one_process_hands_back_what_the_function_returns(llama_dir, hf):
    llm = LLM(str(llama_dir), **ENGINE)
    [embed] = llm.apply_model(lambda model: model.embed_tokens.weight)
    assert torch.equal(embed, hf.model.embed_tokens.weight)  # the engine's own tensor, loaded exactly
    assert llm.apply_model(lambda model: sum(p.numel() for p in model.parameters())) == [
        sum(p.numel() for p in hf.parameters())]  # merged projections hold every weight once
    assert (llm.config.device.device, llm.config.model.dtype) == ("cpu", "float32")  # "auto" resolved
    assert llm.cuda_graph_sizes == {"decode": (), "mixed": ()}  # on CPU nothing is captured
    # vLLM's collective_rpc: the worker is the model runner; a method by name, or a function of it
    [block_bytes] = llm.collective_rpc("kv_block_bytes")
    assert block_bytes == llm.engine.runner.kv_block_bytes() > 0
    assert llm.collective_rpc(lambda w, k: len(w.kv_caches) + k, args=(1,)) == [hf.config.num_hidden_layers + 1]
    assert llm.collective_rpc(lambda w, *, name: getattr(w.model, name) is not None, kwargs={"name": "layers"}) == [True]
    with pytest.raises(ValueError, match="timeout is not supported"):
        llm.collective_rpc("kv_block_bytes", timeout=1.0)
    llm.shutdown()
    llm.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="generate: this LLM was shut down"):
        llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)


def test_apply_model_over_tensor_parallel_ranks(llama_dir, hf):
    """Each rank's result, rank 0 first; a function that fails on one rank names it and leaves the
    group in step; one that cannot travel is refused before any rank runs it."""
    llm = LLM(str(llama_dir), tensor_parallel_size=2, **ENGINE)
    try:
        down = llm.apply_model(lambda model: model.layers[0].mlp.down_proj.weight.numel())
        assert down == [hf.model.layers[0].mlp.down_proj.weight.numel() // 2] * 2  # each rank its half
        assert llm.apply_model(lambda model: torch.distributed.get_rank()) == [0, 1]
        assert llm.collective_rpc(lambda worker: (torch.distributed.get_rank(), worker.device.type)) == \
            [(0, "cpu"), (1, "cpu")]
        assert llm.collective_rpc("kv_block_bytes") == [llm.collective_rpc("kv_block_bytes")[0]] * 2
        with pytest.raises(RuntimeError, match="collective_rpc: .* rank 1: IndexError"):
            llm.collective_rpc(lambda worker: ["rank 0 only"][torch.distributed.get_rank()])
        with pytest.raises(RuntimeError, match="rank 1: IndexError"):
            llm.apply_model(lambda model: ["rank 0 only"][torch.distributed.get_rank()])
        lock = threading.Lock()
        with pytest.raises(TypeError, match="cannot be sent to the tensor-parallel workers"):
            llm.apply_model(lambda model: lock)
        [out] = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == hf_greedy(llama_dir, PROMPT, 6)
    finally:
        llm.shutdown()
    assert not torch.distributed.is_initialized()  # the group was left
    llm.shutdown()
    with pytest.raises(RuntimeError, match="apply_model: this LLM was shut down"):
        llm.apply_model(lambda model: None)
