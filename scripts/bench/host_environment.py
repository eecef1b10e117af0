"""Where a benchmark ran: GPUs, package versions, the repository's commit.

Read without importing torch or touching CUDA (GPUs through NVML, versions from package metadata): a
CUDA context in the load generator would take GPU memory from the server it measures.
"""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("specdec", "openai", "httpx", "torch", "transformers", "flashinfer-python", "fastapi", "uvicorn")


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_names() -> list[str]:
    """Names of the visible NVIDIA GPUs; empty without NVML (nvidia-ml-py) or a driver."""
    try:
        import pynvml as nvml

        nvml.nvmlInit()
        try:
            return [str(nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(i)))
                    for i in range(nvml.nvmlDeviceGetCount())]
        finally:
            nvml.nvmlShutdown()
    except Exception:  # no NVML or no GPU: a CPU machine
        return []


def git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(extra_packages: tuple[str, ...] = ()) -> dict:
    """The host, the versions of PACKAGES and `extra_packages` (None: not installed) and the commit."""
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"gpus": gpu_names(), "cpu": platform.processor() or platform.machine(),
            "platform": platform.platform(), "python": platform.python_version(),
            "versions": {name: package_version(name) for name in (*PACKAGES, *extra_packages)},
            "git_commit": git("rev-parse", "HEAD"), "git_uncommitted_changes": None if status is None else bool(status),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S")}
