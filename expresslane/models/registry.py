"""Architecture name (config.json `architectures`) -> model class."""

from __future__ import annotations

from expresslane.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from expresslane.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from expresslane.models.gpt_oss import GptOssForCausalLM
from expresslane.models.llama import (LlamaForCausalLM, MinistralForCausalLM, MistralForCausalLM, Phi3ForCausalLM,
                                      Qwen2ForCausalLM, Qwen3ForCausalLM, base_model)
from expresslane.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM

MODELS = {cls.__name__: cls for cls in (LlamaForCausalLM, MistralForCausalLM, MinistralForCausalLM, Qwen2ForCausalLM,
                                        Qwen3ForCausalLM, Phi3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM,
                                        Gemma2ForCausalLM, Gemma3ForCausalLM, DeepseekV2ForCausalLM,
                                        DeepseekV3ForCausalLM, GptOssForCausalLM)}
# base-model checkpoints (no LM head), as embedding models ship them: `--runner pooling`
MODELS.update({cls.__name__: cls for cls in map(base_model, (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
                                                             Qwen3ForCausalLM))})


def model_class(hf_config) -> type:
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in MODELS:
            return MODELS[arch]
    raise ValueError(f"unsupported architecture {archs or '(none in config.json)'}; "
                     f"supported: {', '.join(sorted(MODELS))}")
