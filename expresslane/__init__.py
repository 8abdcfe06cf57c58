"""expresslane: a latency-first LLM inference and serving engine."""

from expresslane.entrypoint import LLM
from expresslane.outputs import CompletionOutput, RequestMetrics, RequestOutput
from expresslane.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "__version__"]
