"""omni_accel.sleep / wake_up: memory released, and the same output after waking (compiled graphs and LoRA kept)."""

import psutil
import pytest
import torch

import omni_accel
from omni_accel import AccelError
from omni_accel.testing import run, tiny_pipeline


def test_sleep_spills_a_cpu_pipeline_and_wake_gives_the_same_output():
    from omni_accel.builtin import BUILTIN_DEFAULTS, load_builtin

    pipe = load_builtin()
    kwargs = dict(BUILTIN_DEFAULTS, prompt="a red circle on a blue background", num_inference_steps=2,
                  output_type="pt")
    before = run(pipe, kwargs)
    rss = psutil.Process().memory_info().rss
    report = omni_accel.sleep(pipe)
    released = rss - psutil.Process().memory_info().rss
    assert report["where"] == "disk" and report["released_bytes"] > 40 * 2**20  # the 25 MB fp16 folder in fp32
    assert released > 0.6 * report["released_bytes"], (released, report)
    assert omni_accel.is_sleeping(pipe) and pipe.transformer.proj_out.weight.numel() == 0
    woke = omni_accel.wake_up(pipe)
    assert woke["was_sleeping"] and not omni_accel.is_sleeping(pipe)
    assert torch.equal(run(pipe, kwargs), before)


# a compiled pipeline with a LoRA adapter sleeps and wakes without recompiling: tests/test_lora.py (one compile)


def test_sleep_refusals_and_waking_an_awake_model():
    pipe, _ = tiny_pipeline("flux")
    with pytest.raises(AccelError) as err:
        omni_accel.sleep(pipe, level=2)
    assert str(err.value) == ("sleep level=2 is not supported; use level=1 (weights to host memory, or to a file for a "
                              "CPU pipeline, and back on wake_up()).")
    assert omni_accel.wake_up(pipe) == {"was_sleeping": False, "seconds": 0.0}
    omni_accel.sleep(pipe)
    with pytest.raises(AccelError, match=r"^this model is already asleep; call omni_accel.wake_up\(\) first.$"):
        omni_accel.sleep(pipe)
    omni_accel.wake_up(pipe)
    with pytest.raises(AccelError, match="^sleep\\(\\) takes a diffusers pipeline, a speech pipeline or a torch "
                                         "module; got str.$"):
        omni_accel.sleep("model")
