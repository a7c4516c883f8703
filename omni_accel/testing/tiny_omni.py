"""A tiny random-weight Qwen2.5-Omni (thinker, talker, token2wav DiT + BigVGAN), saved offline.

    path = omni_accel.testing.save_tiny_model("qwen2_5_omni", tmp_path / "omni")
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path)      # transformers' reference
    processor = Qwen2_5OmniProcessor.from_pretrained(path)

Sizes are the smallest that every consumer accepts: attention head size 32 (vLLM's CPU kernels need >= 32),
two layers per LLM, a byte-level tokenizer with the family's special tokens, a talker codebook of 64 codes, and a
BigVGAN whose upsampling (8 * 6 * 5 = 240 samples per mel frame) keeps the family's 24 kHz / 100 frames per second
timing. The weights are random: the audio is noise, but every stage runs the real code path.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

HEAD_DIM = 32
THINKER_WIDTH = 64

SPEAKERS = ("Chelsie", "Ethan")

# thinker-vocabulary specials, in id order after the 256 byte tokens
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
             "<|IMAGE|>", "<|VIDEO|>", "<|vision_bos|>", "<|vision_eos|>", "<|vision_pad|>", "<|tts_pad|>",
             "<|tts_bos|>", "<|tts_eos|>"] + [f"<|spk_{s.lower()}|>" for s in SPEAKERS]
_ROLE_TOKENS = {"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
                "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
                "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
# talker codebook: codes 0..55 are audio, then the codec specials (same layout as the real 8192-code book)
CODEC = {"vocab": 64, "pad": 56, "bos": 57, "eos": 58, "mask": 60}
SYSTEM_PROMPT = ("You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
                 "auditory and visual inputs, as well as generating text and speech.")


def tiny_omni_tokenizer():
    """Byte-level tokenizer with Qwen2.5-Omni's special tokens (built locally, no files)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from .tokenizers import CHATML_TEMPLATE, _byte_vocab

    vocab = _byte_vocab()
    for token in _SPECIALS:
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(_SPECIALS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, model_max_length=2048, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens=dict(_ROLE_TOKENS),
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _mrope() -> dict:
    # sections sum to head_dim / 2; for text-only input the three position rows are equal, i.e. plain RoPE
    return {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}


def tiny_omni_config(tokenizer) -> Any:
    from transformers import Qwen2_5OmniConfig

    tid = tokenizer.convert_tokens_to_ids
    text = dict(vocab_size=len(tokenizer), hidden_size=THINKER_WIDTH, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048, rope_parameters=_mrope(),
                tie_word_embeddings=False, pad_token_id=tid("<|endoftext|>"),
                eos_token_id=tid("<|im_end|>"))
    audio = dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=1, encoder_ffn_dim=64, d_model=32,
                 output_dim=THINKER_WIDTH, max_source_positions=1500, n_window=100)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=1, out_hidden_size=THINKER_WIDTH,
                  fullatt_block_indexes=[0], window_size=112, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2)
    thinker = dict(text_config=text, audio_config=audio, vision_config=vision, audio_token_index=tid("<|AUDIO|>"),
                   image_token_index=tid("<|IMAGE|>"), video_token_index=tid("<|VIDEO|>"),
                   audio_start_token_id=tid("<|audio_bos|>"), audio_end_token_id=tid("<|audio_eos|>"),
                   user_token_id=tid("u"), pad_token_id=tid("<|endoftext|>"),
                   # not declared by the config class, but read by get_rope_index (the published config has them)
                   vision_start_token_id=tid("<|vision_bos|>"), vision_end_token_id=tid("<|vision_eos|>"))
    talker = dict(vocab_size=CODEC["vocab"], embedding_size=THINKER_WIDTH, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD_DIM,
                  max_position_embeddings=2048, rope_parameters=_mrope(),
                  tts_text_start_token_id=tid("<|tts_bos|>"), tts_text_end_token_id=tid("<|tts_eos|>"),
                  tts_text_pad_token_id=tid("<|tts_pad|>"), tts_codec_start_token_id=CODEC["bos"],
                  tts_codec_end_token_id=CODEC["eos"], tts_codec_pad_token_id=CODEC["pad"],
                  tts_codec_mask_token_id=CODEC["mask"], audio_token_index=tid("<|AUDIO|>"),
                  image_token_index=tid("<|IMAGE|>"), video_token_index=tid("<|VIDEO|>"),
                  vision_start_token_id=tid("<|vision_bos|>"), vision_end_token_id=tid("<|vision_eos|>"),
                  audio_start_token_id=tid("<|audio_bos|>"), audio_end_token_id=tid("<|audio_eos|>"),
                  pad_token_id=CODEC["pad"], eos_token_id=CODEC["eos"])
    dit = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=HEAD_DIM, ff_mult=2, emb_dim=32,
               max_position_embeddings=4096, block_size=24, look_ahead_layers=[1], look_backward_layers=[0],
               repeats=2, num_embeds=CODEC["vocab"], mel_dim=20, dropout=0.0, enc_emb_dim=16, enc_dim=16,
               enc_channels=[32, 32, 32, 32, 96], enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1],
               enc_attention_channels=16, enc_res2net_scale=2, enc_se_channels=16)
    bigvgan = dict(mel_dim=20, upsample_initial_channel=32, resblock_kernel_sizes=[3],
                   resblock_dilation_sizes=[[1, 3, 5]], upsample_rates=[8, 6, 5], upsample_kernel_sizes=[16, 12, 10])
    return Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker,
                             token2wav_config={"dit_config": dit, "bigvgan_config": bigvgan},
                             enable_audio_output=True)


def _speakers(tokenizer, config, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed + 1)
    dit = config.token2wav_config.dit_config
    return {name: {"bos_token": tokenizer.convert_tokens_to_ids(f"<|spk_{name.lower()}|>"),
                   "cond": torch.randn(dit.enc_emb_dim, generator=gen),
                   "ref_mel": torch.randn(1, 48, dit.mel_dim, generator=gen)}
            for name in SPEAKERS}


def _save_processor_files(tokenizer, path: str) -> None:
    """preprocessor_config.json in the layout of the published checkpoint (Whisper features + Qwen2-VL images).

    ``Qwen2_5OmniProcessor.from_pretrained(path)`` reads it; building the processor object needs torchvision (its
    video processor), which the text and speech paths here do not use -- they need only the tokenizer.
    """
    from transformers import Qwen2VLImageProcessorPil, WhisperFeatureExtractor

    merged = dict(Qwen2VLImageProcessorPil().to_dict())
    merged.update(WhisperFeatureExtractor(feature_size=128).to_dict())
    merged.pop("mel_filters", None)  # recomputed from the sizes on load
    merged.update(processor_class="Qwen2_5OmniProcessor", image_processor_type="Qwen2VLImageProcessor",
                  feature_extractor_type="WhisperFeatureExtractor")
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(merged, f, indent=1, default=str)


def save_tiny_omni(path: str | os.PathLike, seed: int = 0) -> str:
    """Write the tiny Qwen2.5-Omni to ``path``: config.json, model.safetensors, spk_dict.pt, tokenizer, processor."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    path = str(path)
    tokenizer = tiny_omni_tokenizer()
    config = tiny_omni_config(tokenizer)
    torch.manual_seed(seed)
    model = Qwen2_5OmniForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    torch.save(_speakers(tokenizer, config, seed), os.path.join(path, "spk_dict.pt"))
    tokenizer.save_pretrained(path)
    _save_processor_files(tokenizer, path)
    return path
