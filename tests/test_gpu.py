"""The same engine on CUDA (torch backend): greedy tokens still equal transformers'."""

import pytest
import torch

from expresslane import LLM, SamplingParams
from models import hf_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[(7 * i + 3 * j) % 500 for j in range(n)] for i, n in enumerate((1, 17, 64, 150, 300, 33))]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe"])
def test_cuda_float32_greedy_matches_transformers(model_dirs, arch):
    torch.backends.cuda.matmul.allow_tf32 = False
    llm = LLM(str(model_dirs[arch]), device="cuda", dtype="float32", max_num_batched_tokens=64, num_kv_blocks=256)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == hf_greedy(model_dirs[arch], p, 8)


def test_cuda_bfloat16_runs_and_sizes_kv_from_memory(llama_dir):
    llm = LLM(str(llama_dir), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.05)
    [out] = llm.generate(["hello"], SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.7, seed=1),
                         use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 5
    assert llm.config.cache.num_kv_blocks > 1000  # sized from free GPU memory, not the CPU budget


def test_cuda_graphs_and_eager_agree(llama_dir):
    """Decode and small mixed steps through captured graphs (padding included) equal eager steps."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:5]]  # 5 seqs: replayed in the batch-8 graph
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    graphs = LLM(str(llama_dir), device="cuda", dtype="float32", num_kv_blocks=256)
    assert 8 in graphs.cuda_graph_sizes["decode"] and graphs.cuda_graph_sizes["mixed"]
    eager = LLM(str(llama_dir), device="cuda", dtype="float32", num_kv_blocks=256, enforce_eager=True)
    assert eager.cuda_graph_sizes == {"decode": (), "mixed": ()}
    a = [o.outputs[0].token_ids for o in graphs.generate(prompts, sp, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in eager.generate(prompts, sp, use_tqdm=False)]
    assert a == b


def test_torch_backend_on_cuda_still_matches(llama_dir):
    llm = LLM(str(llama_dir), device="cuda", dtype="float32", attention_backend="torch", num_kv_blocks=256)
    [out] = llm.generate([{"prompt_token_ids": PROMPTS[3]}], SamplingParams(temperature=0, max_tokens=8,
                                                                          ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(llama_dir, PROMPTS[3], 8)


def test_speculation_through_captured_graphs_keeps_greedy_output(llama_dir):
    """Verify steps and the draft's forwards (its catch-up pass, the chain of greedy proposals 2..k)
    replay captured graphs; float32, the model as its own draft (its proposals accepted), two
    requests ending apart (fewer proposals near the end): the tokens of plain decoding, and a
    sampling request beside them finishes. (Prompt lookup's verify step is the same; a random
    model's output never repeats its prompt, so it would not propose here.)"""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[1:3]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (23, 14)]
    plain = LLM(str(llama_dir), device="cuda", dtype="float32", num_kv_blocks=256)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    del plain
    llm = LLM(str(llama_dir), device="cuda", dtype="float32", num_kv_blocks=256, num_speculative_tokens=4,
              speculative_disable_by_batch_size=8, speculative_model=str(llama_dir))
    assert llm.cuda_graph_sizes["mixed"] and llm.engine.runner.proposer.chain_graphs.graphs  # captured
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    stats = llm.engine.core.stats()
    assert stats.spec_num_drafts > 0
    assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens  # (near-ties aside)
    sampled = llm.generate(prompts[:1], SamplingParams(temperature=0.8, max_tokens=9, ignore_eos=True), use_tqdm=False)
    assert len(sampled[0].outputs[0].token_ids) == 9


def test_steps_that_sample_nothing_are_waited_for(llama_dir, monkeypatch):
    """A step of prefill chunks alone samples no token, yet landing it waits for its end: the
    host keeps at most one step queued behind the running one (unbounded, a request arriving
    next waited behind a whole long prompt's chunks: 237 ms on the H200)."""
    from expresslane.runner.step_result import StepResult
    landed = []
    get = StepResult.get

    def get_and_check(self):
        out = get(self)
        landed.append((out[0] == {}, self._event is not None and self._event.query()))
        return out

    monkeypatch.setattr(StepResult, "get", get_and_check)
    llm = LLM(str(llama_dir), device="cuda", dtype="float32", max_num_batched_tokens=64, num_kv_blocks=256)
    llm.generate([{"prompt_token_ids": PROMPTS[4]}], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                 use_tqdm=False)
    empty = [done for nothing, done in landed if nothing]
    assert len(empty) >= 4 and all(done for _, done in landed)


@pytest.mark.gpu
def test_penalty_kernel_equals_the_torch_ops_on_cuda():
    from expresslane.contract import NewRequest
    from expresslane.runner.penalties import Penalties

    gen = torch.Generator().manual_seed(0)
    cpu, cuda = Penalties(8, 128256, torch.device("cpu")), Penalties(8, 128256, torch.device("cuda"))
    rows = [5, 1, 6]
    for row, (p, f, r) in zip(rows, [(0.5, 0.3, 1.2), (-1.0, 0.0, 0.8), (0.0, 2.0, 1.0)]):
        new = NewRequest(f"r{row}", SamplingParams(presence_penalty=p, frequency_penalty=f, repetition_penalty=r),
                         num_prompt_tokens=500, token_ids=torch.randint(0, 128256, (2000,), generator=gen).tolist())
        cpu.add(row, new)
        cuda.add(row, new)
    logits = torch.randn(4, 128256, generator=gen)
    want, got = logits.clone(), logits.cuda()
    cpu.apply(want, rows + [2])
    cuda.apply(got, rows + [2])  # the Triton kernel
    assert torch.equal(got.cpu(), want)


def test_prompt_logprobs_on_cuda_match_transformers(llama_dir):
    """Steps that score a prompt run eagerly beside captured graphs: in chunks, next to a decoding
    request, the prompt's logprobs still equal transformers' log-softmax (float32)."""
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    ids = PROMPTS[4]  # 300 tokens: five chunks of 64
    llm = LLM(str(llama_dir), device="cuda", dtype="float32", max_num_batched_tokens=64, num_kv_blocks=256)
    outs = llm.generate([{"prompt_token_ids": PROMPTS[1]}, {"prompt_token_ids": ids}],
                        [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                         SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)], use_tqdm=False)
    plp = outs[1].prompt_logprobs
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    assert plp[0] is None and len(plp) == len(ids)
    got = torch.tensor([plp[i][ids[i]].logprob for i in range(1, len(ids))])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())
    assert outs[0].outputs[0].token_ids == hf_greedy(llama_dir, PROMPTS[1], 16)  # its neighbour unchanged
