"""One process of tests/test_compile_cache.py: compile the tiny FLUX pipeline on fresh inductor caches, either saving
what it compiled (``save``) or loading a saved file first (``load``); prints a JSON line of what happened."""

import json
import sys

import torch

import omni_accel
from omni_accel.errors import AccelError
from omni_accel.testing import run, tiny_pipeline


def main(mode: str, path: str) -> None:
    from torch._dynamo.utils import counters

    report = {}
    if mode == "save":
        try:
            omni_accel.save_compile_cache(path)
        except AccelError as exc:  # nothing compiled yet in this process
            report["early_save_error"] = str(exc)
    else:
        report["loaded"] = omni_accel.load_compile_cache(path)
    pipe, kwargs = tiny_pipeline("flux")
    omni_accel.accelerate(pipe, compile=True)
    out = run(pipe, kwargs)
    if mode == "save":
        report["bytes"] = omni_accel.save_compile_cache(path)
    report["fxgraph_cache_hit"] = counters["inductor"]["fxgraph_cache_hit"]
    report["fxgraph_cache_miss"] = counters["inductor"]["fxgraph_cache_miss"]
    torch.save(out, f"{path}.{mode}.pt")
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
