"""The image-processor files of a Kimi-K2.5 test checkpoint.

vLLM builds Kimi-K2.5's processing info at engine start, text-only runs included, and loads
the image processor named by ``preprocessor_config.json`` (remote code through
``auto_map``; vLLM 0.26+ swaps in its own fused processor when numba is installed, reading
the same ``media_proc_cfg``).
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

_FILES = resources.files(__package__) / "files"
SOURCE = "kimi_k25_vision_processing.py"

# Kimi-K2.5's preprocessing settings (the values third-party ports use for the checkpoint).
MEDIA_PROC_CFG: dict[str, Any] = {
    "in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5], "merge_kernel_size": 2, "fixed_output_tokens": None,
    "patch_limit_on_one_side": 512, "in_patch_limit_each_frame": 4096,
    "in_patch_limit_video": None, "sample_fps": 2.0, "max_num_frames_each_video": None,
    "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff",
}


def preprocessor_config() -> dict[str, Any]:
    return {
        "auto_map": {"AutoImageProcessor": "kimi_k25_vision_processing.KimiK25VisionProcessor"},
        "image_processor_type": "KimiK25VisionProcessor",
        "media_proc_cfg": dict(MEDIA_PROC_CFG),
    }


def write_image_processor(directory: str | os.PathLike[str]) -> None:
    d = Path(directory)
    (d / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=2) + "\n")
    (d / SOURCE).write_text((_FILES / SOURCE).read_text())
