import json, os, sys, torch
sys.path.insert(0, "/work/main")
os.environ.setdefault("OMNI_ACCEL_PG_TIMEOUT", "60")
import omni_accel
from omni_accel.testing import tiny_pipeline, run
torch.set_num_threads(1)
res = {}
for fam, knobs in [("flux", dict(sp=2)), ("qwen_image", dict(cfg_parallel=2)), ("qwen_image", dict(sp=2))]:
    pipe, kw = tiny_pipeline(fam)
    kw = dict(kw, num_inference_steps=6)
    omni_accel.accelerate(pipe, cache="tea_cache", cache_config={"threshold": 0.3})
    ref = run(pipe, kw); ref_c = {k: v for k, v in pipe.omni_accel.last_call.as_dict().items() if k.startswith("cache.")}
    omni_accel.restore(pipe)
    try:
        omni_accel.accelerate(pipe, cache="tea_cache", cache_config={"threshold": 0.3}, **knobs)
        out = run(pipe, kw)
        c = {k: v for k, v in pipe.omni_accel.last_call.as_dict().items() if k.startswith("cache.")}
        omni_accel.restore(pipe)
        res[f"{fam} {knobs}"] = {"maxdiff_vs_single": float((out - ref).abs().max()), "counters": c, "single": ref_c}
    except Exception as e:
        res[f"{fam} {knobs}"] = {"error": repr(e)[:300]}
rank = int(os.environ.get("RANK", 0))
json.dump(res, open(f"/tmp/par_cache.rank{rank}.json", "w"), indent=1)
