"""Tokenizers built on the spot, with no files and no downloads, for the tiny test pipelines.

Every tokenizer here is byte-level: each UTF-8 byte of the text is one token, so any prompt encodes without a
trained vocabulary. ``kind`` picks the special tokens and padding conventions the family's pipeline expects
(CLIP's start/end tokens, T5's end-of-sequence, Qwen's chat markers and template).
"""

from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

# A chat template in the common ChatML shape, enough for pipelines that call apply_chat_template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SPECIALS = {
    "clip": {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
             "pad_token": "<|endoftext|>"},
    "t5": {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"},
    "qwen2": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None, "bos_token": None},
    "llama": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"},
}
_EXTRA_SPECIALS = {
    "qwen2": ["<|im_start|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
    "llama": ["[INST]", "[/INST]", "[IMG]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"],
}
KINDS = tuple(_SPECIALS)


def _byte_vocab() -> dict[str, int]:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    return {symbol: index for index, symbol in enumerate(sorted(alphabet))}


@functools.lru_cache(maxsize=None)
def _backend(kind: str) -> str:
    specials = _SPECIALS[kind]
    vocab = _byte_vocab()
    tokens = [t for t in dict.fromkeys(list(specials.values()) + _EXTRA_SPECIALS.get(kind, [])) if t]
    for token in tokens:
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(tokens)
    if kind == "clip":
        bos, eos = specials["bos_token"], specials["eos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A {eos}", special_tokens=[(bos, vocab[bos]), (eos, vocab[eos])]
        )
    elif kind in ("t5", "llama"):
        eos = specials["eos_token"]
        tok.post_processor = processors.TemplateProcessing(single=f"$A {eos}", special_tokens=[(eos, vocab[eos])])
    return tok.to_str()


def tiny_tokenizer(kind: str, model_max_length: int = 77) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with the special tokens of ``kind`` ("clip", "t5", "qwen2", "llama").

    Its vocabulary size is ``len(tokenizer)`` (a little over 256); size tiny text encoders to at least that.
    """
    if kind not in _SPECIALS:
        raise ValueError(f"kind={kind!r} is not known; use one of {', '.join(KINDS)}")
    backend = Tokenizer.from_str(_backend(kind))
    specials = {k: v for k, v in _SPECIALS[kind].items() if v}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        model_max_length=model_max_length,
        additional_special_tokens=_EXTRA_SPECIALS.get(kind, []),
        **specials,
    )
    if kind in ("qwen2", "llama"):
        tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.padding_side = "right"
    return tokenizer
