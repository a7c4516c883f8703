"""Tiny random-weight pipelines of every supported family, built offline in well under a second.

    pipe, kwargs = omni_accel.testing.tiny_pipeline("flux")
    image = omni_accel.testing.run(pipe, kwargs, seed=0)  # a fresh generator each call: comparable outputs
    out, report = omni_accel.testing.run_accelerated(pipe, kwargs, attention="math")  # accelerate, run, restore

``kwargs`` holds the call arguments (prompt, tiny size, 2 steps, output_type) but no generator, so the same dict
can be reused; ``run`` adds a fresh seeded generator and returns the output as a float32 CPU tensor.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ..errors import AccelError

# family -> module under omni_accel/testing/ with build(seed, **overrides) -> (pipe, call_kwargs)
TINY_BUILDERS = {
    "flux": "tiny_flux",
    "flux_kontext": "tiny_flux",
    "flux2": "tiny_flux2",
    "qwen_image": "tiny_qwen_image",
    "qwen_image_edit": "tiny_qwen_image",
    "qwen_image_edit_plus": "tiny_qwen_image",
    "wan": "tiny_wan",
    "wan_i2v": "tiny_wan",
    "wan22": "tiny_wan",
    "sd3": "tiny_sd3",
    "z_image": "tiny_z_image",
}


def tiny_pipeline(family: str, seed: int = 0, **overrides: Any) -> tuple[Any, dict]:
    """A tiny random-weight pipeline of ``family`` and the kwargs for a short call (no downloads).

    ``overrides`` go to the transformer config (e.g. ``num_layers=3``) or replace call kwargs when they name one
    (e.g. ``height=48``); the builder of each family documents which it accepts.
    """
    if family not in TINY_BUILDERS:
        raise AccelError(f"family={family!r} has no tiny pipeline. Known: {', '.join(TINY_BUILDERS)}.")
    module = importlib.import_module(f"{__name__}.{TINY_BUILDERS[family]}")
    return module.build(family, seed=seed, **overrides)


def run(pipe: Any, call_kwargs: dict, seed: int = 0, **extra: Any) -> torch.Tensor:
    """Call ``pipe`` with ``call_kwargs`` and a fresh generator seeded ``seed``; the output as float32 on CPU."""
    kwargs = dict(call_kwargs, **extra)
    kwargs["generator"] = torch.Generator("cpu").manual_seed(seed)
    return output_tensor(pipe(**kwargs))


def record_modulation_takes(monkeypatch: Any) -> list[bool]:
    """Every modulation linear call's outcome from now on (pytest's ``monkeypatch`` undoes the recording): True where
    the linear took an output computed ahead (modulation_prefetch.py's slots, which the prefetch and the modulation
    table fill), False where it computed itself."""
    from .. import modulation_prefetch

    outcomes: list[bool] = []
    take = modulation_prefetch._take

    def recording_take(x, weight):
        out = take(x, weight)
        outcomes.append(out is not None)
        return out

    monkeypatch.setattr(modulation_prefetch, "_take", recording_take)
    return outcomes


class RerunGraphBackend:
    """A stand-in for CUDA graph capture (cuda_graphs.GraphBackend) on the CPU: ``capture`` runs the function once and
    counts it; a replay runs it again and copies the results into the captured outputs."""

    def __init__(self):
        self.captures = 0

    def capture(self, fn):
        self.captures += 1
        outputs = fn()
        leaves = [t for t in torch.utils._pytree.tree_flatten(outputs)[0] if isinstance(t, torch.Tensor)]

        def replay():
            fresh = [t for t in torch.utils._pytree.tree_flatten(fn())[0] if isinstance(t, torch.Tensor)]
            for static, new in zip(leaves, fresh):
                static.copy_(new)

        return outputs, replay


def output_tensor(result: Any) -> torch.Tensor:
    """The images (or video frames) of a pipeline output as one float32 CPU tensor."""
    images = result.frames if getattr(result, "frames", None) is not None else result.images
    if isinstance(images, list):
        images = torch.stack([torch.as_tensor(__import__("numpy").asarray(i)) for i in images])
    return torch.as_tensor(images).detach().float().cpu()


TINY_MODELS = {"qwen2_5_omni": ("tiny_omni", "save_tiny_omni")}  # family -> (module, saver) of saved checkpoints


def save_tiny_model(family: str, path: Any, seed: int = 0) -> str:
    """Write a tiny random-weight checkpoint of ``family`` to ``path`` (loadable by ``from_pretrained(path)``)."""
    if family not in TINY_MODELS:
        raise AccelError(f"family={family!r} has no tiny saved model. Known: {', '.join(TINY_MODELS)}.")
    module, saver = TINY_MODELS[family]
    return getattr(importlib.import_module(f"{__name__}.{module}"), saver)(path, seed=seed)


def run_accelerated(pipe: Any, call_kwargs: dict, seed: int = 0, **accelerate_kwargs: Any) -> tuple[torch.Tensor, dict]:
    """``accelerate(pipe, **accelerate_kwargs)``, one seeded ``run``, the report, then ``restore``: (output, report).
    The pipeline comes back plain even when the run fails."""
    import omni_accel

    omni_accel.accelerate(pipe, **accelerate_kwargs)
    try:
        out = run(pipe, call_kwargs, seed=seed)
        report = pipe.omni_accel.report()
    finally:
        omni_accel.restore(pipe)
    return out, report


def run_compiled_twice(pipe: Any, call_kwargs: dict, **accelerate_kwargs: Any) -> tuple[torch.Tensor, dict]:
    """``accelerate(pipe, **accelerate_kwargs)`` (a ``compile`` knob among them) on fresh dynamo state, two seeded
    runs, then ``restore``: (first output, dynamo's counts). The counts say whether the compiled pipeline traced
    without graph breaks and whether the second call recompiled: ``graphs_first_call``, ``graphs_second_call``,
    ``graph_breaks``."""
    import omni_accel
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    omni_accel.accelerate(pipe, **accelerate_kwargs)
    try:
        out = run(pipe, call_kwargs)
        graphs_first = counters["stats"]["unique_graphs"]
        run(pipe, call_kwargs)
        graphs_second = counters["stats"]["unique_graphs"]
    finally:
        omni_accel.restore(pipe)
    return out, {"graphs_first_call": graphs_first, "graphs_second_call": graphs_second,
                 "graph_breaks": sum(counters["graph_break"].values())}


def check_route_takes_every_call(pipe: Any, call_kwargs: dict, calls: list, **accelerate_kwargs: Any) -> dict:
    """For a kernel routed by the attention pass whose stand-in appends to ``calls``: ``accelerate(pipe,
    **accelerate_kwargs)`` sends every block's attention call of every step to it with the plain pipeline's output
    (within 1e-5), and ``restore`` brings back the exact plain output with no call routed. Returns the report's
    attention entry (a FLUX-family pipeline: its dual and single blocks each attend once per step)."""
    import omni_accel

    plain = run(pipe, call_kwargs)
    omni_accel.accelerate(pipe, **accelerate_kwargs)
    (applied,) = [a for a in pipe.omni_accel.report()["applied"] if a["pass"] == "attention"]
    routed = run(pipe, call_kwargs)
    blocks = len(pipe.transformer.transformer_blocks) + len(pipe.transformer.single_transformer_blocks)
    assert len(calls) == blocks * call_kwargs["num_inference_steps"], (len(calls), blocks)
    assert torch.allclose(routed, plain, atol=1e-5)
    omni_accel.restore(pipe)
    calls.clear()
    assert torch.equal(run(pipe, call_kwargs), plain) and not calls
    return applied


def check_sdpa_fallback(op: Any, refused_shapes: Any, records: list, kernel: str) -> None:
    """A routed kernel's op whose package cannot be imported: SDPA computes the call (equal to SDPA's own output)
    twice, the shape is kept once with the import error as the reason, and one warning names ``kernel``."""
    import torch.nn.functional as F

    q, k, v = (torch.randn(1, 24, 4, 32, dtype=torch.bfloat16) for _ in range(3))
    expected = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              scale=0.2).transpose(1, 2)
    for _ in range(2):
        out = op(q, k, v, 0.2)
        assert torch.equal(out, expected) and out.is_contiguous()
    (why,) = refused_shapes().values()
    assert why.startswith("ImportError") or why.startswith("ModuleNotFoundError"), why
    warnings = [r.getMessage() for r in records if f"{kernel} failed" in r.getMessage()]
    assert len(warnings) == 1 and "SDPA computes this shape from now on" in warnings[0], warnings
