"""GLM-4.1V / GLM-4.5V prompts with images: the checkpoint's HF image processor, placeholder
expansion.

A prompt carries one ``<|image|>`` (``config.image_token_id``) per image where the chat
template puts it (``<|begin_of_image|><|image|><|end_of_image|>``), as HF's ``Glm4vProcessor``
takes it. The checkpoint's image processor (``Glm4vImageProcessor``: the image resized to
multiples of ``patch_size * merge_size`` with its pixel count, counted twice for the two
temporal frames, within ``size.shortest_edge`` .. ``size.longest_edge``; rescaled, normalized
by CLIP's mean and std, cut into merge-block ordered patches with the frame repeated over
``temporal_patch_size``; its PIL backend where torchvision is absent) gives each image's patch
rows and ``(1, h, w)`` grid; the placeholder becomes ``h * w / merge**2`` image tokens, the
image's :class:`~mrv2.contract.requests.MultiModalItem` (its content hash over the pixels).

Videos (``multi_modal_data["video"]``) are refused with a ValueError naming the field: GLM's
video prompts (a timestamp after each frame's image run) are not built here yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import accumulate
from typing import Any

from mrv2.contract.input_processor import (
    InputProcessor,
    content_hash,
    run_image_processor,
    splice_placeholders,
)
from mrv2.contract.requests import MultiModalItem

__all__ = ["Glm4vInputProcessor"]


class Glm4vInputProcessor(InputProcessor):
    """GLM-4.1V's and GLM-4.5V's :class:`~mrv2.contract.input_processor.InputProcessor`
    (module doc)."""

    def __init__(self, model_dir: str, hf_config: Any, tokenizer: Any, config: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer, config)
        self.load_images(model_dir, "Glm4vImageProcessor")
        self.image_token_id = int(hf_config.image_token_id)
        self.merge = int(hf_config.vision_config.spatial_merge_size)

    def process(self, prompt_token_ids: list[int], mm_data: Mapping[str, Any]
                ) -> tuple[list[int], list[MultiModalItem]]:
        """Expand each ``<|image|>`` placeholder and make the images' items (module doc)."""
        if mm_data.get("video") is not None:
            raise ValueError("multi_modal_data.video: videos are not supported for GLM-4.1V / "
                             "GLM-4.5V yet; send the frames as images")
        rest = {key: value for key, value in mm_data.items() if key != "video"}
        images, places = self.images_and_places(prompt_token_ids, rest, self.image_token_id,
                                                "<|image|>")
        if not images:
            return list(prompt_token_ids), []
        out = run_image_processor(self.require_images(), images)
        pixels = out["pixel_values"]
        grids = [(int(t), int(h), int(w)) for t, h, w in out["image_grid_thw"].tolist()]
        firsts = list(accumulate((t * h * w for t, h, w in grids), initial=0))

        def expand(n: int, offset: int) -> tuple[list[int], MultiModalItem]:
            rows = pixels[firsts[n]: firsts[n + 1]].contiguous()
            t, h, w = grids[n]
            length = t * h * w // self.merge**2
            item = MultiModalItem("image", {"pixel_values": rows, "grid_thw": grids[n]},
                                  content_hash(grids[n], rows), offset, length)
            return [self.image_token_id] * length, item

        return splice_placeholders(prompt_token_ids, places, expand)
