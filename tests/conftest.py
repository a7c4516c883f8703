"""Helpers shared by the tests: tiny model folders, server processes, a CPU stand-in for cuDNN FP8 attention."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest


def saved_tiny_pipeline(tmp_path_factory, family: str) -> str:
    """A folder holding ``tiny_pipeline(family)`` saved with save_pretrained (for commands that take --model)."""
    from omni_accel.testing import tiny_pipeline

    pipe, _ = tiny_pipeline(family)
    path = tmp_path_factory.mktemp(f"tiny_{family}")
    pipe.save_pretrained(path)
    return str(path)


def stop_process_group(proc: subprocess.Popen, wait_s: float) -> None:
    """SIGTERM the process group started with ``start_new_session=True``; SIGKILL it if it outlives ``wait_s``."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def running_demo(tmp_path, *args: str, start_timeout_s: float = 120):
    """``omni-accel demo --port <free> *args`` in its own process group, from the repository root; yields its URL
    once it answers, stops it afterwards. Its output goes to tmp_path/demo.log (shown if it exits early)."""
    import httpx

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = os.path.join(str(tmp_path), "demo.log")
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1", NO_PROXY="127.0.0.1,localhost")
    with open(log_path, "w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "omni_accel", "demo", "--port", str(port), *args], cwd=root,
                                env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        url = f"http://127.0.0.1:{port}/"
        try:
            t0 = time.time()
            while True:
                if proc.poll() is not None:
                    log.flush()
                    with open(log_path) as fh:
                        raise AssertionError(f"demo exited {proc.returncode}: {fh.read()[-3000:]}")
                try:
                    if httpx.get(url, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.time() - t0 < start_timeout_s, f"demo did not start in {start_timeout_s} s"
                time.sleep(0.5)
            yield url
        finally:
            stop_process_group(proc, 15)


@pytest.fixture
def cudnn_fp8_on_cpu(monkeypatch):
    """attention='fp8' routed as on a Hopper GPU with cuDNN's FP8 SDPA, on the CPU (where the op emulates cuDNN's
    arithmetic), for the tiny pipelines' 16-wide heads."""
    from omni_accel.kernels import attention as attn
    from omni_accel.kernels import fp8_attention as fa

    monkeypatch.setattr(attn, "_fp8_refusal", lambda device: None)
    monkeypatch.setattr(fa, "implementation_for", lambda device: "cudnn")
    monkeypatch.setattr(fa, "_HEAD_DIMS", (16, 32, 64, 128))
