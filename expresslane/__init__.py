"""expresslane: a latency-first LLM inference and serving engine.

`LLM` is imported lazily so that torch-free parts (scheduler, KV cache manager,
sampling params) can be imported without torch.
"""

from expresslane.contract import LoRARequest
from expresslane.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestMetrics, RequestOutput
from expresslane.pooling_params import PoolingParams
from expresslane.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "PoolingParams", "RequestOutput", "CompletionOutput",
           "RequestMetrics", "EmbeddingRequestOutput", "EmbeddingOutput", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from expresslane.entrypoint import LLM
        return LLM
    raise AttributeError(f"module 'expresslane' has no attribute {name!r}")
