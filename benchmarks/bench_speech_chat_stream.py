"""Streamed omni chat on the vLLM engines: when the first audio chunk comes relative to the text, and what the
pooling passes that let the talker run behind the thinker cost (median of a few runs per setting, CPU).

    OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/bench_speech_chat_stream.py \
        [--text-tokens 40 200] [--codes 100] [--every 4 8 16 32] [--repeat 5]

The model is the tiny random Qwen2.5-Omni of omni_accel.testing (so this measures per-step overhead more than
FLOPs). For each reply length in ``--text-tokens`` the thinker writes that many tokens (the prompt is chosen so the
tiny thinker does not stop earlier) and the greedy talker makes exactly ``--codes`` codes. For each ``states_every``
(reply tokens between the pooling passes over the prompt + reply so far) ``--repeat`` streamed chats are timed (the
median of each figure is kept): the first text delta, the thinker's last token, the first audio chunk, the total,
pooling passes and the tokens they ran; ``after the reply`` (states_every larger than the reply) is the talker
starting once the text is complete (one pass). Every run's text and codes are compared with the non-streamed
``generate()`` (which pools once) and the joined waveform's max error is given; ``prefix_states_max_abs_diff`` is
how far the states of a pass over the prompt + half the reply are from the same rows of a pass over the whole.
Writes benchmarks/results/bench_speech_chat_stream_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

from omni_accel.ar_bridge.speech import SpeechPipeline  # noqa: E402
from omni_accel.testing import save_tiny_model  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = "hello me joke there when tell a cat"  # the tiny thinker writes on to 200 tokens after it


def streamed_chat(pipe: SpeechPipeline, every: int, options: dict, whole) -> dict:
    pipe.states_every = every
    pooled: list[int] = []
    tokens: list[float] = []
    states, thinker_stream = pipe.thinker.states, pipe.thinker.stream

    def counted(ids, media=None):
        pooled.append(len(ids))
        return states(ids, media)

    def timed(*args, **kwargs):  # when the thinker writes each token (a piece of text may decode to nothing)
        for token in thinker_stream(*args, **kwargs):
            tokens.append(time.perf_counter())
            yield token

    pipe.thinker.states, pipe.thinker.stream = counted, timed
    texts: list[float] = []
    chunks: list[torch.Tensor] = []
    stats: dict = {}
    t0 = time.perf_counter()
    first_audio = None
    try:
        for chunk in pipe.stream(TEXT, "Ethan", stats=stats, on_text=lambda _: texts.append(time.perf_counter()),
                                 **options):
            first_audio = first_audio or time.perf_counter()
            chunks.append(chunk)
    finally:
        pipe.thinker.states, pipe.thinker.stream = states, thinker_stream
    total = time.perf_counter() - t0
    wave = torch.cat(chunks)
    return {"states_every": every if every < 10 ** 6 else "after the reply",
            "first_text_s": round(texts[0] - t0, 4), "last_token_s": round(tokens[-1] - t0, 4),
            "first_audio_s": round(first_audio - t0, 4), "total_s": round(total, 4),
            "audio_before_last_token": first_audio < tokens[-1],
            "pooling_passes": len(pooled), "pooled_tokens": sum(pooled),
            "same_text": stats["text"] == whole.text, "same_codes": stats["codes"] == whole.codes,
            "wave_max_abs_err": (wave - whole.waveform).abs().max().item() if wave.shape == whole.waveform.shape
            else None}


def median_run(runs: list[dict]) -> dict:
    """One setting's runs: the median of each timing, the rest from the runs (all must agree on text and codes)."""
    out = dict(runs[0], repeats=len(runs))
    for key in ("first_text_s", "last_token_s", "first_audio_s", "total_s"):
        out[key] = statistics.median(r[key] for r in runs)
    for key in ("audio_before_last_token", "same_text", "same_codes"):
        out[key] = all(r[key] for r in runs)
    out["wave_max_abs_err"] = max(r["wave_max_abs_err"] for r in runs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--text-tokens", type=int, nargs="+", default=[40, 200])
    ap.add_argument("--codes", type=int, default=100)
    ap.add_argument("--every", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_speech_chat_stream_cpu.json"))
    args = ap.parse_args()
    replies = []
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_model("qwen2_5_omni", os.path.join(tmp, "tiny"))
        with SpeechPipeline(path, engine="vllm") as pipe:
            prompt_tokens = len(pipe.prompt_ids(TEXT))
            for text_tokens in args.text_tokens:
                options = dict(mode="chat", max_codes=args.codes, min_codes=args.codes, max_text_tokens=text_tokens,
                               sampling={}, seed=3)
                whole = pipe.generate(TEXT, "Ethan", **options)
                t0 = time.perf_counter()
                pipe.generate(TEXT, "Ethan", **options)
                whole_s = time.perf_counter() - t0
                streamed_chat(pipe, args.every[0], options, whole)  # warm-up
                runs = [median_run([streamed_chat(pipe, every, options, whole) for _ in range(args.repeat)])
                        for every in [*args.every, 10 ** 6]]
                seen = pipe.prompt_ids(TEXT) + whole.thinker_ids[:-1]
                half = prompt_tokens + len(whole.thinker_ids) // 2
                prefix_diff = (pipe.thinker.states(seen[:half]) - pipe.thinker.states(seen)[:half]).abs().max().item()
                replies.append({"reply_tokens": len(whole.thinker_ids), "codes": len(whole.codes),
                                "whole_request_s": round(whole_s, 4), "prefix_states_max_abs_diff": prefix_diff,
                                "runs": runs})
    result = {"model": "tiny random Qwen2.5-Omni (omni_accel.testing)", "engine": "vllm",
              "prompt_tokens": prompt_tokens, "replies": replies,
              "threads": torch.get_num_threads(), "python": sys.version.split()[0], "torch": torch.__version__,
              "machine": platform.machine()}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
