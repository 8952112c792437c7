"""mrv2: a modular, GPU-native, async-first LLM inference engine."""

from mrv2.config import EngineConfig
from mrv2.contract.lora import LoRARequest
from mrv2.contract.model_state import ModelState
from mrv2.contract.params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from mrv2.contract.pooling import PoolingParams
from mrv2.engine.llm import LLM
from mrv2.engine.outputs import CompletionOutput, RequestOutput
from mrv2.hookspecs import hookimpl
from mrv2.runner.runner import Runner

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LoRARequest",
    "ModelState",
    "PoolingParams",
    "RequestOutput",
    "RequestOutputKind",
    "Runner",
    "SamplingParams",
    "StructuredOutputsParams",
    "hookimpl",
]
