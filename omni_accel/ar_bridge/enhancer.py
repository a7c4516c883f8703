"""The prompt-enhancer stage: an LLM rewrites the user's prompt before the diffusion stage.

    enhancer = PromptEnhancer(make_engine("vllm", llm_path))
    for piece in enhancer.stream("a fox"): print(piece, end="", flush=True)   # the rewrite as it is written
    pipe(prompt=enhancer("a fox"))
"""

from __future__ import annotations

from typing import Iterator, Sequence

from ..errors import AccelError
from .engine import Engine

DEFAULT_TEMPLATE = (
    "Rewrite the image prompt below into one richer sentence: name the subject, setting, lighting, colours and "
    "style. Answer with the new prompt only.\nPrompt: {prompt}\nNew prompt:"
)


class PromptEnhancer:
    """``template`` holds ``{prompt}``; ``chat=True`` wraps it as a user turn of the tokenizer's chat template."""

    def __init__(self, engine: Engine, template: str = DEFAULT_TEMPLATE, *, max_tokens: int = 96,
                 temperature: float = 0.0, seed: int | None = None, chat: bool = False, keep_empty: bool = False):
        if "{prompt}" not in template:
            raise AccelError("the enhancer template must contain '{prompt}' where the user's prompt goes.")
        self.engine = engine
        self.template = template
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.seed = seed
        self.chat = chat
        self.keep_empty = keep_empty

    def render(self, prompt: str) -> str:
        text = self.template.replace("{prompt}", prompt)
        tok = getattr(self.engine, "tokenizer", None)
        if self.chat and tok is not None and getattr(tok, "chat_template", None):
            return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
        return text

    def _finish(self, original: str, rewritten: str) -> str:
        rewritten = rewritten.strip()
        return rewritten if rewritten or self.keep_empty else original  # an empty rewrite keeps the prompt

    def enhance(self, prompts: Sequence[str]) -> list[str]:
        """Rewrite every prompt (one batched engine call)."""
        outs = self.engine.generate([self.render(p) for p in prompts], self.max_tokens, self.temperature, self.seed)
        return [self._finish(p, o) for p, o in zip(prompts, outs)]

    def stream(self, prompt: str) -> Iterator[str]:
        """The rewrite of one prompt, piece by piece."""
        yield from self.engine.stream(self.render(prompt), self.max_tokens, self.temperature, self.seed)

    def __call__(self, prompt: str) -> str:
        return self.enhance([prompt])[0]
