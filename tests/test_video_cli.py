"""`omni-accel generate --video`: MP4 out of the built-in video model (a stand-in with tiny Wan weights here, the
trained one once it ships) or any Wan folder, with the acceleration flags generate takes; clear errors."""

import json

import pytest
from conftest import saved_tiny_pipeline

from omni_accel.cli import main
from omni_accel.testing import tiny_pipeline
from omni_accel.video_io import decode_mp4

PROMPT = "a red circle moving from left to right on a blue background"


@pytest.fixture(scope="module")
def tiny_wan_dir(tmp_path_factory):
    return saved_tiny_pipeline(tmp_path_factory, "wan")


@pytest.fixture
def builtin_video_stand_in(monkeypatch):
    """omni_accel.builtin with load_builtin_video returning the tiny Wan pipeline: what the CLI asks of it."""
    import torch

    import omni_accel.builtin as real

    calls = {}

    def load_builtin_video(path=None, dtype=torch.float32, device="cpu"):
        calls.update(dtype=dtype, device=device)
        return tiny_pipeline("wan")[0]

    monkeypatch.setattr(real, "load_builtin_video", load_builtin_video)
    monkeypatch.setattr(real, "BUILTIN_VIDEO_DEFAULTS", {"height": 32, "width": 48, "num_frames": 9,
                                                         "num_inference_steps": 2, "guidance_scale": 1.0,
                                                         "max_sequence_length": 21})
    monkeypatch.delenv("OMNI_ACCEL_MODEL", raising=False)
    return calls


def test_video_without_model_uses_the_builtin_video_model_and_writes_mp4(builtin_video_stand_in, tmp_path, capsys,
                                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default output name lands here
    assert main(["generate", "--video", PROMPT, "--device", "cpu", "--report", "json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    frames, fps = decode_mp4((tmp_path / "out.mp4").read_bytes())
    assert frames.shape == (9, 32, 48, 3) and fps == 8  # BUILTIN_VIDEO_DEFAULTS and BUILTIN_VIDEO_FPS
    assert report["saved"] == {"path": "out.mp4", "kind": "video", "frames": 9, "fps": 8, "size": [48, 32]}
    assert report["last_call"]["transformer_forwards"] == 2  # guidance 1.0: one forward per step
    assert builtin_video_stand_in["device"] == "cpu"


def test_video_takes_the_acceleration_flags_and_frames_fps(builtin_video_stand_in, tmp_path, capsys):
    out = tmp_path / "clip.mp4"
    assert main(["generate", "--video", PROMPT, "--device", "cpu", "--frames", "5", "--fps", "4", "--steps", "3",
                 "--attention", "sdpa", "--cache", "tea_cache", "--cache-config", '{"threshold": 0}', "--fuse-qkv",
                 "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "attention(sdpa)" in text and "cache(tea_cache)" in text and "fuse_qkv" in text
    assert "5 frames at 4 fps" in text
    frames, fps = decode_mp4(out.read_bytes())
    assert frames.shape[0] == 5 and fps == 4


def test_any_wan_folder_writes_mp4_gif_or_first_frame(tiny_wan_dir, tmp_path):
    from PIL import Image

    base = ["generate", PROMPT, "--model", tiny_wan_dir, "--device", "cpu", "--height", "32", "--width", "32",
            "--frames", "5", "--steps", "2"]
    assert main(base + ["-o", str(tmp_path / "w.mp4")]) == 0
    frames, fps = decode_mp4((tmp_path / "w.mp4").read_bytes())
    assert frames.shape == (5, 32, 32, 3) and fps == 16  # a folder without its own rate: 16 fps (Wan 2.1's)
    assert main(base + ["--fps", "10", "-o", str(tmp_path / "w.gif")]) == 0
    with Image.open(tmp_path / "w.gif") as gif:
        assert gif.n_frames == 5 and gif.info["duration"] == 100
    assert main(base + ["-o", str(tmp_path / "w.png")]) == 0
    with Image.open(tmp_path / "w.png") as png:
        assert png.size == (32, 32)


def test_missing_builtin_video_model_names_the_training_command(tmp_path, capsys, monkeypatch):
    import omni_accel.builtin as builtin

    monkeypatch.setattr(builtin, "builtin_video_model_path", lambda: str(tmp_path / "video_model"))
    monkeypatch.delenv("OMNI_ACCEL_MODEL", raising=False)
    assert main(["generate", "--video", PROMPT, "--device", "cpu", "-o", str(tmp_path / "x.mp4")]) == 2
    err = capsys.readouterr().err
    assert "built-in video model folder" in err and "does not exist" in err
    assert "python -m omni_accel.builtin.train_video --out" in err and "--model PATH" in err
    assert not (tmp_path / "x.mp4").exists()


@pytest.mark.parametrize("flags, message", [
    (["--fps", "0"], "error: --fps 0 is invalid: it must be a positive integer."),
    (["--frames", "0"], "error: --frames 0 is invalid: it must be a positive integer."),
])
def test_bad_video_flags_exit_2(tmp_path, capsys, flags, message):
    assert main(["generate", "--video", PROMPT, "--device", "cpu", "--model", str(tmp_path / "absent"),
                 "-o", str(tmp_path / "x.mp4"), *flags]) == 2
    assert message in capsys.readouterr().err


def test_video_with_an_image_model_is_refused(tmp_path, capsys):
    pipe, _ = tiny_pipeline("flux")
    pipe.save_pretrained(tmp_path / "flux")
    assert main(["generate", "--video", PROMPT, "--model", str(tmp_path / "flux"), "--device", "cpu",
                 "-o", str(tmp_path / "x.mp4")]) == 2
    err = capsys.readouterr().err
    assert "error: --video: --model" in err and "is a FluxPipeline, which makes images" in err


def test_bench_takes_video_and_reports_block_caches(tiny_wan_dir, capsys):
    """omni-accel bench on a Wan folder with a cache that counts blocks, not steps (mag_cache; cache_dit alike)."""
    assert main(["bench", PROMPT, "--video", "--model", tiny_wan_dir, "--device", "cpu", "--height", "32", "--width",
                 "32", "--frames", "5", "--steps", "4", "--warmup", "0", "--repeats", "1", "--cache", "mag_cache"]) == 0
    out = capsys.readouterr().out
    assert "output 1x5x3x32x32" in out and "cache=mag_cache: " in out and "block forwards run" in out
