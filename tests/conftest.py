"""Helpers shared by the tests that start real server processes."""

import os
import signal
import subprocess


def stop_process_group(proc: subprocess.Popen, wait_s: float) -> None:
    """SIGTERM the process group started with ``start_new_session=True``; SIGKILL it if it outlives ``wait_s``."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
