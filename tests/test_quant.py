"""Quantized checkpoints (FP8, AWQ, GPTQ): the loaders against float32 references computed
here from the raw checkpoint tensors (bit layouts written out independently of
expresslane.quant), and the engine's greedy tokens against transformers running the
dequantized weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from expresslane import LLM, SamplingParams
from expresslane.quant import QuantLinear
from expresslane.quant.int4 import pack_cols, pack_rows
from models import _hf_model
from quant_models import GROUP, fake_quant_rows, quantize_dir, reference_weight

FORMATS = ["fp8", "fp8-tensor", "fp8-block", "awq", "gptq", "gptq-desc"]


def test_pack_orders_are_the_formats():
    """The well-known words: AWQ packs columns 0..7 as 0x75316420, GPTQ rows 0..7 as 0x76543210,
    and a symmetric GPTQ (v1) zero point 8 is stored as 7 in every nibble."""
    vals = torch.arange(8, dtype=torch.int32)
    assert pack_cols(vals[None, :], (0, 2, 4, 6, 1, 3, 5, 7)).item() == 0x75316420
    assert pack_rows(vals[:, None]).item() == 0x76543210
    assert pack_cols(torch.full((1, 8), 7)).item() == 0x77777777
    assert pack_cols(torch.full((1, 8), 15)).item() == -1  # int32 bit pattern 0xFFFFFFFF


def _checkpoint_layers(model_dir) -> dict[str, dict[str, torch.Tensor]]:
    """HF module name -> its tensors (quantized linears only)."""
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in load_file(model_dir / "model.safetensors").items():
        module, _, part = name.rpartition(".")
        if module.split(".")[-1].endswith("_proj") and part != "bias":
            layers.setdefault(module, {})[part] = t
    return layers


@pytest.fixture(scope="module")
def quant_dirs(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    return {fmt: quantize_dir(llama_dir, root / fmt, fmt.removesuffix("-desc"), desc_act=fmt.endswith("-desc"))
            for fmt in FORMATS}


@pytest.fixture(scope="module")
def references(quant_dirs):
    return {fmt: {m: reference_weight(p, fmt.removesuffix("-desc")) for m, p in _checkpoint_layers(d).items()}
            for fmt, d in quant_dirs.items()}


def _merged(refs: dict[str, torch.Tensor], layer: str, parts: list[str]) -> torch.Tensor:
    return torch.cat([refs[f"{layer}.{p}"] for p in parts])


@pytest.mark.parametrize("fmt", FORMATS)
def test_loader_matches_float32_reference(quant_dirs, references, fmt):
    llm = LLM(str(quant_dirs[fmt]), num_kv_blocks=64)
    [model] = llm.apply_model(lambda model: model)
    refs = references[fmt]
    checked = 0
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        for module, want in ((layer.self_attn.qkv_proj, _merged(refs, f"{p}.self_attn", ["q_proj", "k_proj", "v_proj"])),
                             (layer.self_attn.o_proj, refs[f"{p}.self_attn.o_proj"]),
                             (layer.mlp.gate_up_proj, _merged(refs, f"{p}.mlp", ["gate_proj", "up_proj"])),
                             (layer.mlp.down_proj, refs[f"{p}.mlp.down_proj"])):
            assert isinstance(module, QuantLinear) and module.method.name == fmt.split("-")[0]
            got = module.dequantized_weight()
            if fmt == "fp8-block":
                # requantized per channel: within one e4m3 rounding (3 mantissa bits: half a step is
                # 2^-4 of the value) or, for subnormals, half the smallest step 2^-9 of the row scale
                row_scale = want.abs().amax(1, keepdim=True) / 448
                assert ((got - want).abs() <= want.abs() * 2**-4 + row_scale * 2**-9 + 1e-12).all()
            else:  # the same integers and scales in float32: exact
                assert torch.equal(got, want), f"layer {i}: {(got - want).abs().max()}"
            checked += 1
    assert checked == 4 * len(model.layers)


def _reference_model(llm_dir, refs: dict[str, torch.Tensor], fake_quant_inputs: bool):
    """transformers' float32 model with the dequantized weights (and per-token FP8 inputs for W8A8)."""
    model = _hf_model(llm_dir)
    saved = {}
    hooks = []
    for name, module in model.named_modules():
        if name in refs:
            saved[name] = module.weight.data.clone()
            module.weight.data.copy_(refs[name])
            if fake_quant_inputs:
                hooks.append(module.register_forward_pre_hook(lambda m, args: (fake_quant_rows(args[0]),)))
    return model, saved, hooks


PROMPTS = [[(11 * i + 5 * j) % 500 for j in range(n)] for i, n in enumerate((1, 9, 33, 70, 130))]


def _per_channel(w: torch.Tensor) -> torch.Tensor:
    """What the engine keeps of a block-wise FP8 weight: requantized with one scale per row."""
    scale = w.abs().amax(1, keepdim=True) / 448
    return (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


@pytest.mark.parametrize("fmt", FORMATS)
def test_engine_greedy_matches_dequantized_transformers(llama_dir, quant_dirs, references, fmt):
    refs = references[fmt]
    if fmt == "fp8-block":
        refs = {name: _per_channel(w) for name, w in refs.items()}
    model, saved, hooks = _reference_model(llama_dir, refs, fake_quant_inputs=fmt.startswith("fp8"))
    try:
        want = []
        for p in PROMPTS:
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
            want.append(out[0, len(p):].tolist())
    finally:
        for h in hooks:
            h.remove()
        for name, module in model.named_modules():
            if name in saved:
                module.weight.data.copy_(saved[name])
    llm = LLM(str(quant_dirs[fmt]), max_num_batched_tokens=48, num_kv_blocks=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_fp8_at_load_equals_the_fp8_checkpoint(llama_dir, quant_dirs):
    """--quantization fp8 on the float model builds the same weights as the per-channel checkpoint
    (whose scales are stored in the model dtype, float32 here)."""
    [a] = LLM(str(llama_dir), quantization="fp8", num_kv_blocks=64).apply_model(lambda model: model)
    [b] = LLM(str(quant_dirs["fp8"]), quantization="fp8", num_kv_blocks=64).apply_model(lambda model: model)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and pa.dtype == pb.dtype and torch.equal(pa.float(), pb.float()), na
    assert a.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(quantization="awq"), "needs a checkpoint in that format"),
    (dict(quantization="int8"), "quantization must be one of"),
])
def test_bad_quantization_is_refused(llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(llama_dir), **kwargs)


def test_quantization_must_match_the_checkpoint(quant_dirs):
    with pytest.raises(ValueError, match="quantized with 'awq'"):
        LLM(str(quant_dirs["awq"]), quantization="gptq")


@pytest.mark.parametrize("fmt", ["fp8", "awq", "gptq"])
def test_make_model_writes_the_format_from_the_same_weights(tmp_path, fmt):
    """make-model --quantization X: the format's tensors and quantization_config, quantized from
    the very weights of the unquantized preset (same seed), loadable by the engine."""
    import json

    from expresslane.cli.main import main
    from expresslane.models.presets import make_model

    plain = make_model("tiny", tmp_path / "plain")
    assert main(["make-model", "tiny", str(tmp_path / fmt), "--quantization", fmt]) == 0
    config = json.loads((tmp_path / fmt / "config.json").read_text())
    kind = {"fp8": "compressed-tensors"}.get(fmt, fmt)
    assert config["quantization_config"]["quant_method"] == kind
    floats, quant = load_file(plain / "model.safetensors"), load_file(tmp_path / fmt / "model.safetensors")
    assert_rounded_to_format(floats, quant, "model.layers.1.mlp.down_proj", fmt)
    assert quant["model.embed_tokens.weight"].dtype == floats["model.embed_tokens.weight"].dtype
    llm = LLM(str(tmp_path / fmt), num_kv_blocks=32, max_model_len=256)
    [out] = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3, ignore_eos=True),
                         use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def assert_rounded_to_format(floats: dict, quant: dict, name: str, fmt: str) -> None:
    """The checkpoint `quant`'s weight `name`, dequantized, is the float one rounded to the format."""
    want = floats[f"{name}.weight"].float()
    got = reference_weight({k.removeprefix(name + "."): v for k, v in quant.items() if k.startswith(name + ".")},
                           fmt if fmt == "fp8" else f"{fmt}-128")
    if fmt == "fp8":  # one e4m3 rounding per weight (half a step: 2^-4 relative), subnormals 2^-9 of the scale
        bound = want.abs() * 2**-4 + want.abs().amax(1, keepdim=True) / 448 * 2**-9
    else:  # a group's step s: AWQ (asymmetric, s = (max - min) / 15) within one step, since its rounded
        # zero point can push the largest value half a step past 15 where it is clipped; GPTQ
        # (symmetric, s = max|w| / 7, zero 8) within half a step. Scales are fp16: 2^-11 relative.
        groups = want.t().reshape(-1, 128, want.shape[0])
        lo, hi = groups.amin(1).clamp(max=0), groups.amax(1).clamp(min=0)
        step = ((hi - lo) / 15 if fmt == "awq" else groups.abs().amax(1) / 7).repeat_interleave(128, 0).t()
        bound = step * (1.0 if fmt == "awq" else 0.5) + want.abs() * 2**-10 + 1e-7
    assert ((got - want).abs() <= bound).all()


@pytest.mark.parametrize("fmt", ["fp8", "awq", "gptq"])
def test_quantize_writes_a_model_dir_in_the_format(tmp_path, fmt):
    """`expresslane quantize` of the shipped trained model: every decoder projection rounded to the
    format, the rest and the tokenizer as they were, a quantization_config; the engine loads it and
    completes the README's prompt. A second run refuses to overwrite."""
    import json

    from expresslane.cli.main import main
    from expresslane.models.model_dir import DEFAULT_MODEL

    out = tmp_path / fmt
    assert main(["quantize", str(DEFAULT_MODEL), str(out), "--quantization", fmt]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == {"fp8": "compressed-tensors"}.get(fmt, fmt)
    assert (out / "tokenizer.json").read_bytes() == (DEFAULT_MODEL / "tokenizer.json").read_bytes()
    floats, quant = load_file(DEFAULT_MODEL / "model.safetensors"), load_file(out / "model.safetensors")
    for layer in (0, 8):
        for proj in ("self_attn.k_proj", "mlp.down_proj"):
            assert_rounded_to_format(floats, quant, f"model.layers.{layer}.{proj}", fmt)
    assert torch.equal(quant["model.embed_tokens.weight"], floats["model.embed_tokens.weight"])
    llm = LLM(str(out), num_kv_blocks=32, max_model_len=256)
    [done] = llm.generate(["class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):"],
                          SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert done.outputs[0].text.startswith("\n        self.items.append(item")
    assert main(["quantize", str(DEFAULT_MODEL), str(out), "--quantization", fmt]) == 2


def _folds(model) -> list[bool]:
    """Per layer: whether the fused norms / SiLU-and-mul quantize the next projection's input."""
    return [flag for layer in model.layers for flag in (layer.input_layernorm.fp8_out,
                                                         layer.post_attention_layernorm.fp8_out, layer.mlp.fp8_act)]


def test_fp8_fold_keeps_the_greedy_tokens(llama_dir):
    """The triton backend (interpreter on CPU): the fused RMSNorms and SiLU-and-mul hand qkv,
    gate|up and down their input already quantized (an Fp8Activation; o_proj quantizes its
    own), and the engine's greedy tokens and logprobs equal those with the fold turned off
    (the same bytes: tests/test_quant_kernels.py)."""
    from expresslane.quant.fp8 import Fp8Activation

    llm = LLM(str(llama_dir), quantization="fp8", attention_backend="triton", max_num_batched_tokens=16,
              max_num_seqs=2, max_model_len=64, num_kv_blocks=16)
    [model] = llm.apply_model(lambda model: model)
    assert all(_folds(model))
    seen = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            module.register_forward_pre_hook(
                lambda m, args, name=name: seen.setdefault(name.rpartition(".")[2], set()).add(type(args[0])))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)

    def run():
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    folded = run()
    assert seen == {"qkv_proj": {Fp8Activation}, "o_proj": {torch.Tensor}, "gate_up_proj": {Fp8Activation},
                    "down_proj": {Fp8Activation}}
    for layer in model.layers:
        layer.input_layernorm.fp8_out = layer.post_attention_layernorm.fp8_out = layer.mlp.fp8_act = False
    seen.clear()
    assert run() == folded
    assert all(types == {torch.Tensor} for types in seen.values())


@pytest.mark.parametrize("backend, quantization", [("torch", "fp8"), ("triton", None), ("triton", "awq")])
def test_fp8_fold_only_for_fp8_on_the_fused_path(llama_dir, backend, quantization):
    """Unquantized, INT4 and torch-backend models keep plain activations."""
    from expresslane.attention.registry import get_backend
    from expresslane.models.model_dir import load_hf_config
    from expresslane.models.registry import model_class
    from expresslane.quant import QuantConfig
    from expresslane.quant.fp8 import Fp8Method
    from expresslane.quant.int4 import Int4Method

    cfg = load_hf_config(llama_dir)
    backend = get_backend(backend, cfg.num_attention_heads, cfg.num_key_value_heads, 16, torch.device("cpu"))
    method = {"fp8": Fp8Method(serialized=False), "awq": Int4Method("awq", GROUP), None: None}[quantization]
    model = model_class(cfg)(cfg, backend, QuantConfig(method) if method else None)
    assert not any(_folds(model))
