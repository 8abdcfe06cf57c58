"""INT4 experts (AWQ and GPTQ checkpoints of Mixtral and Qwen3-MoE; vLLM's moe_wna16): the
loader against float32 references computed from the raw checkpoint tensors (quant_models'
independent bit layouts), and the engine's greedy tokens against transformers running the
dequantized weights, through chunked prefill."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from expresslane import LLM, SamplingParams
from expresslane.layers.moe import SparseMoE
from expresslane.quant.int4_experts import Int4Experts
from models import hf_greedy
from quant_models import quantize_dir, reference_weight

GROUP = 16  # the tiny Qwen3-MoE's experts have 48 intermediate channels
CASES = [(arch, fmt) for arch in ("mixtral", "qwen3_moe") for fmt in ("awq", "gptq")]
_INT4_PARTS = ("qweight", "qzeros", "scales", "g_idx")


@pytest.fixture(scope="module")
def moe_quant(model_dirs, tmp_path_factory):
    """(arch, fmt) -> (quantized dir, its dequantized float32 twin)."""
    root = tmp_path_factory.mktemp("quant_moe")
    out = {}
    for arch, fmt in CASES:
        qdir = quantize_dir(model_dirs[arch], root / f"{arch}-{fmt}", fmt, group=GROUP)
        out[arch, fmt] = qdir, _dequantized_dir(qdir, fmt, root / f"{arch}-{fmt}-float")
    return out


def _references(qdir: Path, fmt: str) -> dict[str, torch.Tensor]:
    """HF module name -> float32 [N, K] of every INT4 projection in the checkpoint."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in load_file(qdir / "model.safetensors").items():
        module, _, part = name.rpartition(".")
        if part in _INT4_PARTS:
            parts.setdefault(module, {})[part] = t
    return {module: reference_weight(p, f"{fmt}-{GROUP}") for module, p in parts.items()}


def _dequantized_dir(qdir: Path, fmt: str, dst: Path) -> Path:
    """The float32 checkpoint that a quantized one stands for (transformers runs it)."""
    dst.mkdir()
    for f in qdir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    tensors = {n: t for n, t in load_file(qdir / "model.safetensors").items() if n.rpartition(".")[2] not in _INT4_PARTS}
    tensors |= {f"{module}.weight": w.contiguous() for module, w in _references(qdir, fmt).items()}
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("arch,fmt", CASES)
def test_experts_load_the_checkpoint_exactly(moe_quant, arch, fmt):
    qdir, _ = moe_quant[arch, fmt]
    refs = _references(qdir, fmt)
    [model] = LLM(str(qdir), num_kv_blocks=64).apply_model(lambda model: model)
    gate, up, down = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    checked = 0
    for i, layer in enumerate(model.layers):
        if not isinstance(layer.mlp, SparseMoE):
            continue
        moe = layer.mlp
        assert isinstance(moe.w13, Int4Experts) and isinstance(moe.w2, Int4Experts)
        for e in range(moe.num_experts):
            p = f"model.layers.{i}.{block}.experts.{e}"
            assert torch.equal(moe.w13[e], torch.cat([refs[f"{p}.{gate}"], refs[f"{p}.{up}"]]))
            assert torch.equal(moe.w2[e], refs[f"{p}.{down}"])
            checked += 1
    assert checked == moe.num_experts * sum(isinstance(layer.mlp, SparseMoE) for layer in model.layers) > 0


PROMPTS = [[(13 * i + 7 * j) % 500 for j in range(n)] for i, n in enumerate((1, 11, 40, 90))]


@pytest.mark.parametrize("arch,fmt", CASES)
def test_engine_greedy_matches_dequantized_transformers(moe_quant, arch, fmt):
    qdir, float_dir = moe_quant[arch, fmt]
    want = [hf_greedy(float_dir, p, 8) for p in PROMPTS]
    llm = LLM(str(qdir), max_num_batched_tokens=32, num_kv_blocks=128)  # long prompts: chunked
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_fp8_moe_is_refused_by_name(model_dirs):
    with pytest.raises(ValueError, match="not supported for mixture-of-experts models; use an unquantized, AWQ or GPTQ"):
        LLM(str(model_dirs["mixtral"]), quantization="fp8")


def test_desc_act_experts_are_refused(model_dirs, tmp_path):
    qdir = quantize_dir(model_dirs["qwen3_moe"], tmp_path / "q", "gptq", desc_act=True, group=GROUP)
    with pytest.raises(ValueError, match="desc_act"):
        LLM(str(qdir), num_kv_blocks=64)


def test_a_fused_block_on_int4_experts_equals_the_reference_block():
    """SparseMoE's fused path (routing and the grouped GEMMs, Triton's interpreter on CPU) on
    INT4 experts loaded through `load_expert`, against the same block's torch path."""
    pytest.importorskip("triton")
    from expresslane.distributed.group import TPGroup
    from expresslane.quant.int4 import Int4Method, gptq_tensors

    gen = torch.Generator().manual_seed(0)
    hidden, inter, experts = 64, 48, 5
    blocks = [SparseMoE(hidden, inter, experts, 2, True, TPGroup.single(), fused, Int4Method("gptq", GROUP, 1))
              for fused in (False, True)]
    router = torch.randn(experts, hidden, generator=gen)
    for e in range(experts):
        for part, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            tensors = gptq_tensors(torch.randn(shape, generator=gen) / shape[1] ** 0.5, GROUP)
            for block in blocks:
                for name, t in tensors.items():
                    block.load_expert(e, part, name, t)
    for block in blocks:
        block.gate.weight.data.copy_(router)
    x = torch.randn(9, hidden, generator=gen)
    slots = torch.arange(9)
    ref, out = (block(x, slots) for block in blocks)
    out = out.sum(1)  # the fused block on one rank leaves each token's k expert rows to the next norm
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), (out - ref).abs().max()
    assert torch.equal(blocks[0].expert_tokens, blocks[1].expert_tokens) and int(blocks[1].expert_tokens.sum()) == 18


@pytest.mark.parametrize("int4", [False, True])
def test_decode_floor_counts_only_the_routed_share_of_experts(int4):
    """A batch-1 decode reads top_k / E of the experts, stacked bf16 weights or INT4 experts
    (a module of packed weights, scales and zeros), and every other weight whole."""
    from expresslane.bench.floors import decode_weight_bytes
    from expresslane.distributed.group import TPGroup
    from expresslane.quant.int4 import Int4Method

    hidden, inter, experts, top_k = 32, 48, 8, 2
    moe = SparseMoE(hidden, inter, experts, top_k, True, TPGroup.single(), False,
                    Int4Method("gptq", GROUP, 1) if int4 else None)
    model = torch.nn.Sequential(torch.nn.Embedding(10, hidden), moe)
    expert_bytes = sum(p.numel() * p.element_size() for w in (moe.w13, moe.w2)
                       for p in (w.parameters() if int4 else (w,)))
    gate_bytes = moe.gate.weight.numel() * moe.gate.weight.element_size()
    assert expert_bytes > 0
    assert decode_weight_bytes(model) == int(gate_bytes + expert_bytes * top_k / experts)
    assert decode_weight_bytes(model, batch=64) == int(gate_bytes + expert_bytes * (1 - (1 - top_k / experts) ** 64))
