"""Where a result came from: the code's commit and the device it ran on, as rows and manifests record them."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]  # the checkout (site-packages when installed: commit unknown)


def git_commit() -> str:
    """Short commit of the code that ran, ``-dirty`` when it had uncommitted changes."""
    try:
        sha = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    """The GPU's name on CUDA, else the CPU's."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()
