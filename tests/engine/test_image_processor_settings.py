"""Where a checkpoint keeps its image processor's settings: transformers 5 saves a processor's
``processor_config.json`` with an ``image_processor`` section (and no ``preprocessor_config.json``),
older checkpoints a flat ``preprocessor_config.json``; ``load_image_processor`` and
``preprocessor_config`` read either, the nested section first (HF's own order)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mrv2.contract.input_processor import load_image_processor, preprocessor_config

SETTINGS = {"image_processor_type": "SiglipImageProcessor", "size": {"height": 56, "width": 56},
            "image_mean": [0.25, 0.5, 0.75], "image_std": [0.5, 0.5, 0.5], "do_resize": True,
            "do_normalize": True, "do_rescale": True, "rescale_factor": 1 / 255}


def test_nested_settings_of_transformers_5(tmp_path: Path) -> None:
    (tmp_path / "processor_config.json").write_text(json.dumps(
        {"processor_class": "SiglipProcessor", "image_processor": SETTINGS}))
    assert preprocessor_config(tmp_path)["size"] == {"height": 56, "width": 56}
    processor = load_image_processor(tmp_path, "SiglipImageProcessor")
    assert processor.size == {"height": 56, "width": 56}
    assert list(processor.image_mean) == [0.25, 0.5, 0.75]
    # the nested section first, as HF reads them; a flat file beside it is the fallback
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {**SETTINGS, "size": {"height": 28, "width": 28}}))
    assert preprocessor_config(tmp_path)["size"] == {"height": 56, "width": 56}
    assert load_image_processor(tmp_path, "SiglipImageProcessor").size["height"] == 56


def test_flat_settings_and_none(tmp_path: Path) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(SETTINGS))
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "X"}))
    assert preprocessor_config(tmp_path)["image_mean"] == [0.25, 0.5, 0.75]
    assert load_image_processor(tmp_path, "SiglipImageProcessor").size["width"] == 56
    empty = tmp_path / "empty"
    empty.mkdir()
    assert preprocessor_config(empty) == {} and preprocessor_config(None) == {}
    with pytest.raises(FileNotFoundError, match=r"no image processor settings in .*empty.* "
                                                r"\(processor_config.json's image_processor "
                                                r"section or preprocessor_config.json\)"):
        load_image_processor(empty, "SiglipImageProcessor")
