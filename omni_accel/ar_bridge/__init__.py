"""AR bridge: LLM stages beside the diffusion stage, on vLLM (in-process) or transformers.

* ``make_engine("vllm" | "transformers", model, ...)`` -> an :class:`Engine` (encode / generate / stream / close).
* ``accelerate(pipe, text_encoder="vllm")`` -> the pipeline's LLM text encoder runs on the engine (text_encoder.py).
* :class:`PromptEnhancer` rewrites prompts (streamable); :class:`StagePipeline` overlaps AR and diffusion stages.
See docs/ar_bridge.md.
"""

from .engine import Engine, TransformersEngine, VLLMEngine, make_engine, vllm_available
from .enhancer import DEFAULT_TEMPLATE, PromptEnhancer
from .stages import StageComparison, StagePipeline, StageStats
from .testing import save_tiny_llm, tiny_pipeline_for_vllm
from .speech import SpeechCancelled, SpeechPipeline, SpeechResult, speech

__all__ = ["Engine", "TransformersEngine", "VLLMEngine", "make_engine", "vllm_available", "PromptEnhancer",
           "DEFAULT_TEMPLATE", "StagePipeline", "StageStats", "StageComparison", "save_tiny_llm", "tiny_pipeline_for_vllm",
           "SpeechPipeline", "SpeechResult", "SpeechCancelled", "speech"]
