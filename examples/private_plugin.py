"""A private model plugin registered in code, without packaging (contrib_models/llama shows the
packaged form). The "private" model here is the default SmolLM2 checkpoint relabelled with an
architecture name no public plugin knows, served by the Llama model class and a ModelState
subclass of our own that counts the steps it prepares."""

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mrv2 import LLM, ModelState, SamplingParams, hookimpl
from mrv2.contract.batch import InputBatch
from mrv2.model_loader.default_model import ensure_default_model
from mrv2.plugins import get_plugin_manager


class CountingState(ModelState):
    """Default decoder-only behaviour, plus a step counter."""

    steps = 0

    def prepare_inputs(self, batch: InputBatch) -> dict[str, Any]:
        CountingState.steps += 1
        return super().prepare_inputs(batch)


class MyPlugin:
    """Registers the in-house architecture; the model class is imported lazily."""

    @hookimpl
    def mrv2_register_models(self, register: Any) -> None:
        register("MyInHouseForCausalLM", "mrv2_llama.model:LlamaForCausalLM",
                 model_state=f"{__name__}:CountingState")


if __name__ == "__main__":
    get_plugin_manager().register(MyPlugin(), name="my-plugin")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "in-house"
        shutil.copytree(ensure_default_model(), model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        config["architectures"] = ["MyInHouseForCausalLM"]
        (model_dir / "config.json").write_text(json.dumps(config))
        llm = LLM(str(model_dir), max_model_len=512)
        out = llm.generate("The sky is", SamplingParams(temperature=0, max_tokens=8))
        print(out[0].outputs[0].text, f"({CountingState.steps} steps prepared)")
