"""Generate with several processes: sequence / CFG / tensor / VAE parallelism through omni_accel.

    torchrun --nproc_per_node=4 examples/parallel_generate.py --model PATH --sp 2 --cfg-parallel 2 \
        --prompt "a red fox in the snow" --negative-prompt "blurry" --true-cfg-scale 4
    torchrun --nproc_per_node=2 examples/parallel_generate.py --tiny flux --sp 2        # no weights needed
    torchrun --nproc_per_node=4 examples/parallel_generate.py --tiny qwen_image --sp 2 --cfg-parallel 2
    python examples/parallel_generate.py --tiny qwen_image        # one process: the reference image

The product cfg_parallel x sp x tp must equal --nproc_per_node (vae_parallel must divide it). Every rank runs the
whole pipeline call on the same inputs and ends with the same image; rank 0 saves it. The tiny pipelines bring
their own call arguments (Qwen-Image's: a negative prompt and true_cfg_scale=4, so --cfg-parallel 2 applies);
the flags here override them.
"""

from __future__ import annotations

import argparse
import time

import torch

import omni_accel
import omni_accel.distributed as dist_util


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="local diffusers pipeline folder (DiffusionPipeline.from_pretrained)")
    src.add_argument("--tiny", metavar="FAMILY", help="a tiny random-weight pipeline (omni_accel.testing)")
    p.add_argument("--prompt", default="a red fox in the snow")
    p.add_argument("--negative-prompt", default=None)
    p.add_argument("--true-cfg-scale", type=float, default=None, help="Qwen-Image / FLUX true CFG scale")
    p.add_argument("--guidance", type=float, default=None, help="guidance_scale")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--sp", type=int, default=1)
    p.add_argument("--ulysses", type=int, default=None)
    p.add_argument("--ring", type=int, default=None)
    p.add_argument("--cfg-parallel", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--vae-parallel", type=int, default=1)
    p.add_argument("--compile", action="store_true")
    p.add_argument("-o", "--output", default="parallel.png")
    args = p.parse_args()

    if dist_util.torchrun_env():  # NCCL on GPU (pins this rank's GPU before .to()), gloo on CPU
        dist_util.init()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if args.tiny:
        from omni_accel.testing import tiny_pipeline

        pipe, kwargs = tiny_pipeline(args.tiny)
    else:
        from diffusers import DiffusionPipeline

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
        if device.type == "cpu":
            dtype = torch.float32
        pipe = DiffusionPipeline.from_pretrained(args.model, torch_dtype=dtype)
        kwargs = {"output_type": "pil"}
    pipe.to(device)
    kwargs = dict(kwargs, prompt=args.prompt)
    for key, value in (("negative_prompt", args.negative_prompt), ("true_cfg_scale", args.true_cfg_scale),
                       ("guidance_scale", args.guidance), ("num_inference_steps", args.steps),
                       ("height", args.height), ("width", args.width)):
        if value is not None:
            kwargs[key] = value
    if args.tiny:
        kwargs["output_type"] = "pil"

    omni_accel.accelerate(pipe, sp=args.sp, ulysses=args.ulysses, ring=args.ring, cfg_parallel=args.cfg_parallel,
                          tp=args.tp, vae_parallel=args.vae_parallel, compile=args.compile)
    t0 = time.perf_counter()
    out = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(args.seed))
    seconds = time.perf_counter() - t0
    images = out.frames[0] if hasattr(out, "frames") else out.images
    if dist_util.is_main_process():
        image = images[0]
        if hasattr(image, "save"):
            image.save(args.output)
        else:
            from diffusers.utils import export_to_video

            export_to_video(images, args.output.rsplit(".", 1)[0] + ".mp4")
        print(f"saved {args.output} in {seconds:.2f} s on {dist_util.world_size()} processes")
        print(pipe.omni_accel.report())
    dist_util.shutdown()


if __name__ == "__main__":
    main()
