"""An image processor with the interface vLLM calls on Kimi-K2.5's remote vision processor.

Written by vllm-compat for its Kimi-K2.5 test checkpoints (Apache-2.0); it is not Moonshot's
code. A media item is a dict: ``{"type": "image", "image": <PIL image>}`` or
``{"type": "video_chunk", "video_chunk": [<PIL image>, ...]}`` (vLLM's vision chunks). Each
item is resized so that it holds at most ``in_patch_limit`` patches of ``patch_size`` pixels
(and at most ``patch_limit_on_one_side`` per side), padded with black to a multiple of
``merge_kernel_size * patch_size``, normalised and cut into patches. After the vision
tower merges ``merge_kernel_size`` x ``merge_kernel_size`` patches (and pools the frames of
a chunk), one item becomes ``(grid_h / k) * (grid_w / k)`` tokens.

Loading it runs this file, so transformers asks for ``trust_remote_code=True``.
"""

from __future__ import annotations

import io
import math
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature


def resized_size(width: int, height: int, *, patch_size: int, merge_kernel_size: int,
                 in_patch_limit: int, patch_limit_on_one_side: int) -> tuple[int, int, int, int]:
    """``(new_width, new_height, padded_width, padded_height)`` for one frame."""
    patches = max(1, width // patch_size) * max(1, height // patch_size)
    side = patch_limit_on_one_side * patch_size
    scale = min(1.0, math.sqrt(in_patch_limit / patches), side / width, side / height)
    new_w = min(max(1, int(width * scale)), side)
    new_h = min(max(1, int(height * scale)), side)
    unit = merge_kernel_size * patch_size
    return new_w, new_h, -(-new_w // unit) * unit, -(-new_h // unit) * unit


def _as_rgb(item: Any) -> Image.Image:
    item = getattr(item, "media", item)  # vLLM may wrap decoded media with its bytes
    if isinstance(item, (bytes, bytearray)):
        item = Image.open(io.BytesIO(item))
    elif isinstance(item, np.ndarray):
        item = Image.fromarray(item)
    elif isinstance(item, str):
        item = Image.open(item)
    if not isinstance(item, Image.Image):
        raise TypeError(f"expected an image, got {type(item).__name__}")
    return item if item.mode == "RGB" else item.convert("RGB")


class KimiK25VisionProcessor(BaseImageProcessor):
    model_input_names: ClassVar[list[str]] = ["pixel_values", "grid_thws"]

    def __init__(self, media_proc_cfg: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        cfg = dict(media_proc_cfg)  # the keys of preprocessor_config.json's media_proc_cfg
        if isinstance(cfg["merge_kernel_size"], (list, tuple)):
            cfg["merge_kernel_size"] = int(cfg["merge_kernel_size"][0])
        self.media_proc_cfg = cfg
        self.num_frames_per_chunk = int(cfg["temporal_merge_kernel_size"])

    def _frames(self, media: dict[str, Any]) -> list[Image.Image]:
        if media["type"] == "image":
            return [_as_rgb(media["image"])]
        if media["type"] == "video_chunk":
            return [_as_rgb(f) for f in media["video_chunk"]]
        raise ValueError(f"unsupported media type {media['type']!r}")

    def _size(self, media: dict[str, Any], frame: Image.Image) -> tuple[int, int, int, int]:
        cfg = self.media_proc_cfg
        limit = cfg["in_patch_limit"]
        if media["type"] == "video_chunk":
            limit = cfg["in_patch_limit_each_frame"] or limit
            if cfg["in_patch_limit_video"] is not None:
                limit = min(round(cfg["in_patch_limit_video"] / len(media["video_chunk"])), limit)
        return resized_size(*frame.size, patch_size=cfg["patch_size"],
                            merge_kernel_size=cfg["merge_kernel_size"], in_patch_limit=limit,
                            patch_limit_on_one_side=cfg["patch_limit_on_one_side"])

    def media_tokens_calculator(self, media: dict[str, Any]) -> int:
        """Placeholder tokens one media item takes in the prompt."""
        cfg = self.media_proc_cfg
        if cfg["fixed_output_tokens"] is not None:
            return int(cfg["fixed_output_tokens"])
        *_, padded_w, padded_h = self._size(media, self._frames(media)[0])
        unit = cfg["merge_kernel_size"] * cfg["patch_size"]
        return (padded_w // unit) * (padded_h // unit)

    def _patches(self, media: dict[str, Any]) -> tuple[np.ndarray, list[int]]:
        frames = self._frames(media)
        new_w, new_h, padded_w, padded_h = self._size(media, frames[0])
        ps = self.media_proc_cfg["patch_size"]
        canvas = np.zeros((len(frames), padded_h, padded_w, 3), dtype=np.uint8)
        for t, frame in enumerate(frames):
            resized = frame.resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
            canvas[t, :new_h, :new_w] = np.asarray(resized)
        mean = np.asarray(self.media_proc_cfg["image_mean"], dtype=np.float32)
        inv_std = 1.0 / np.asarray(self.media_proc_cfg["image_std"], dtype=np.float32)
        pixels = (canvas.astype(np.float32) / 255.0 - mean) * inv_std
        t, gh, gw = len(frames), padded_h // ps, padded_w // ps
        patches = pixels.reshape(t, gh, ps, gw, ps, 3).transpose(0, 1, 3, 5, 2, 4)
        return patches.reshape(t * gh * gw, 3, ps, ps), [t, gh, gw]

    def preprocess(self, medias: Any, return_tensors: Any = None, **kwargs: Any) -> BatchFeature:
        """``pixel_values`` [patches, 3, patch_size, patch_size] and ``grid_thws`` [items, 3]."""
        items = medias if isinstance(medias, (list, tuple)) else [medias]
        if not items:
            return BatchFeature(data={}, tensor_type=return_tensors)
        parts = [self._patches(m) for m in items]
        data = {"pixel_values": torch.from_numpy(np.concatenate([p for p, _ in parts])),
                "grid_thws": torch.tensor([g for _, g in parts], dtype=torch.int64)}
        return BatchFeature(data=data, tensor_type=return_tensors)
