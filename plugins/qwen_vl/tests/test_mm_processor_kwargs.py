"""``--mm-processor-kwargs`` (vLLM's): settings of the checkpoint's image processor, applied
when the engine builds the family's input processor (here Qwen2.5-VL's ``max_pixels``: fewer
image tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from mrv2.config import EngineConfig
from mrv2.engine.request_inputs import make_input_processor
from mrv2.testing import random_image
from mrv2_qwen_vl.testing import make_tiny_qwen_vl

PROCESSOR = "mrv2_qwen_vl.processor:QwenVLInputProcessor"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen_vl(tmp_path_factory.mktemp("qwen_vl"))


def _image_tokens(model: Path, **kwargs: object) -> int:
    hf = transformers.AutoConfig.from_pretrained(model)
    config = EngineConfig.from_kwargs(**kwargs)
    processor = make_input_processor(PROCESSOR, str(model), hf, None, config)
    assert processor is not None
    ids, _ = processor.process([5, hf.image_token_id, 6], {"image": random_image(224, 224, 0)})
    return sum(1 for t in ids if t == hf.image_token_id)


def test_max_pixels_bounds_the_image_tokens(model: Path) -> None:
    default = _image_tokens(model)
    fewer = _image_tokens(model, mm_processor_kwargs={"max_pixels": 8 * 28 * 28})
    assert default == 64 and fewer <= 8  # (the checkpoint's max_pixels: 64 merged tokens)


def test_unknown_setting_is_refused(model: Path) -> None:
    with pytest.raises(ValueError, match="mm_processor_kwargs: the image processor "
                                         r"Qwen2VLImageProcessor\w* has no setting 'bogus'"):
        _image_tokens(model, mm_processor_kwargs={"bogus": 1})
