"""The inference engine: a pure library (no NATS, no asyncio) with an offline and a step API."""

from common.guided import GuidedSpec
from workers.engine.args import EngineArgs
from workers.engine.engine import LLMEngine
from workers.engine.llm import LLM
from workers.engine.outputs import EngineStats, RequestDelta, RequestOutput
from workers.engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "EngineArgs",
    "EngineStats",
    "GuidedSpec",
    "LLMEngine",
    "RequestDelta",
    "RequestOutput",
    "SamplingParams",
]
