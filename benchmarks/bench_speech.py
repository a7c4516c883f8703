"""Omni speech on CPU: first-chunk latency and real-time factor, vLLM vs transformers engines (one run each).

    OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/bench_speech.py [--codes 100]

The model is the tiny random Qwen2.5-Omni of omni_accel.testing (head size 32, two layers per LLM), so this measures
the pipeline's per-step overhead more than FLOPs. The talker is greedy and makes exactly ``--codes`` codes (min_codes =
max_codes, so every engine speaks the same length; 50 codes = 1 s of audio). For each engine:
one warm-up request, then one whole (non-streamed) TTS request and one streamed one; RTF = wall seconds / audio
seconds (< 1 is faster than real time).
It also measures the token2wav DiT with regional torch.compile (speed and max error vs eager) and a step-cache
probe (every other DiT evaluation reused) for its error. Writes benchmarks/results/bench_speech_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

from omni_accel.ar_bridge.engine import vllm_available  # noqa: E402
from omni_accel.ar_bridge.speech import SpeechPipeline  # noqa: E402
from omni_accel.testing import save_tiny_model  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = "The quick brown fox jumps over the lazy dog."


def one_engine(path: str, engine: str, codes: int) -> dict:
    t0 = time.perf_counter()
    pipe = SpeechPipeline(path, engine=engine, chat=False)
    start_s = time.perf_counter() - t0
    try:
        pipe.generate("warm-up", max_codes=codes, sampling={}, min_codes=codes)
        whole = pipe.generate(TEXT, "Chelsie", max_codes=codes, sampling={}, min_codes=codes)
        audio_s = whole.waveform.numel() / whole.sample_rate
        stats: dict = {}
        t1 = time.perf_counter()
        streamed = list(pipe.stream(TEXT, "Chelsie", max_codes=codes, sampling={}, stats=stats, min_codes=codes))
        stream_s = time.perf_counter() - t1
        stream_audio_s = sum(c.numel() for c in streamed) / whole.sample_rate
        joined = torch.cat(streamed)
        same = joined.shape == whole.waveform.shape
        err = (joined - whole.waveform).abs().max().item() / whole.waveform.abs().max().item() if same else None
        return {"engine": pipe.engines, "start_s": round(start_s, 3), "codes": len(whole.codes),
                "audio_s": round(audio_s, 3),
                "whole": {**whole.timings, "rtf": round(whole.timings["total_s"] / audio_s, 4)},
                "streamed": {"first_chunk_s": stats["first_chunk_s"], "total_s": round(stream_s, 4),
                             "chunks": stats["chunks"], "rtf": round(stream_s / stream_audio_s, 4),
                             "joined_vs_whole_max_rel_err": err}}
    finally:
        pipe.close()


def token2wav_passes(path: str, codes: int) -> dict:
    """Eager vs regional compile of the DiT blocks, and the error of reusing every other DiT evaluation."""
    pipe = SpeechPipeline(path, engine="transformers", chat=False)
    t2w = pipe.token2wav
    code_list = torch.randint(0, 50, (codes,), generator=torch.Generator().manual_seed(0)).tolist()

    def timed() -> tuple[torch.Tensor, float]:
        t0 = time.perf_counter()
        out = t2w.wave(code_list, "Chelsie", seed=0)
        return out, time.perf_counter() - t0

    t2w.wave(code_list, "Chelsie")  # warm-up
    eager, eager_s = timed()
    # step-cache probe: the DiT's output from the previous evaluation stands in for every second evaluation
    state = {"n": 0, "last": None}

    def reuse(module, args, kwargs, output):
        state["n"] += 1
        if state["n"] % 2 == 0 and state["last"] is not None and state["last"].shape == output.shape:
            return state["last"]
        state["last"] = output
        return None

    handle = t2w.dit.register_forward_hook(reuse, with_kwargs=True)
    cached, _ = timed()
    handle.remove()
    t0 = time.perf_counter()
    t2w.compile()
    t2w.wave(code_list, "Chelsie")  # compiles
    compile_s = time.perf_counter() - t0
    compiled, compiled_s = timed()
    peak = eager.abs().max().item()
    return {"codes": codes, "eager_s": round(eager_s, 4), "compiled_s": round(compiled_s, 4),
            "compile_cold_s": round(compile_s, 2), "compile_speedup": round(eager_s / compiled_s, 3),
            "compile_max_rel_err": (compiled - eager).abs().max().item() / peak,
            "cache_every_other_eval_max_rel_err": (cached - eager).abs().max().item() / peak,
            "cache_note": "random weights: the error says nothing about audibility on a trained model"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codes", type=int, default=100, help="talker codes per request (50 = 1 s)")
    ap.add_argument("--engines", default="vllm,transformers")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_speech_cpu.json"))
    args = ap.parse_args()
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_model("qwen2_5_omni", os.path.join(tmp, "omni"))
        runs = []
        for engine in args.engines.split(","):
            if engine == "vllm" and not vllm_available():
                runs.append({"engine": "vllm", "skipped": "vllm not installed"})
                continue
            runs.append(one_engine(path, engine, args.codes))
            print(json.dumps(runs[-1]), flush=True)
        passes = token2wav_passes(path, args.codes)
        print(json.dumps(passes), flush=True)
    vllm_version = None
    if vllm_available():
        import vllm

        vllm_version = vllm.__version__
    result = {"benchmark": "bench_speech", "model": "tiny random Qwen2.5-Omni (omni_accel.testing)",
              "text": TEXT, "runs": runs, "token2wav": passes,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "vllm": vllm_version,
                           "python": sys.version.split()[0]},
              "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                          "torch_threads": torch.get_num_threads(), "load_avg": os.getloadavg()},
              "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
