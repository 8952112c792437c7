"""Drive the Runner with your own scheduling: build SchedulerOutputs step by step.

The runner owns the device state table; you own KV block ids and token counts. Each step names
how many tokens every scheduled request computes; a request samples when it reaches the end of
its known tokens. Sampled tokens stay on the device for the next step; ``result()`` brings them
to the CPU one step late (a list per request: one token, or more while verifying drafts).
"""

from mrv2 import EngineConfig, Runner, SamplingParams
from mrv2.contract.requests import NewRequest, SchedulerOutput

config = EngineConfig.from_kwargs(max_model_len=256, num_gpu_blocks_override=64, block_size=16)
runner = Runner.from_config(config)  # no model given: the default SmolLM2
tokenizer_dir = runner.model_dir

from mrv2.engine.tokenizer import Tokenizer  # noqa: E402

tokenizer = Tokenizer(tokenizer_dir)
prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}])
blocks = list(range(-(-(len(prompt) + 32) // runner.block_size)))  # enough for 32 new tokens
request = NewRequest("r0", prompt, SamplingParams(temperature=0.0), seed=0, block_ids=blocks)

# Step 1: the whole prompt. Later steps: one token each (the one sampled last step, read on the
# device). Launch step N+1 before reading step N.
pending = runner.execute(SchedulerOutput({"r0": len(prompt)}, new_requests=[request]))
tokens: list[int] = []
for _ in range(31):
    following = runner.execute(SchedulerOutput({"r0": 1}))
    tokens.extend(pending.result()["r0"])
    pending = following
    if tokens[-1] == tokenizer.eos_token_id:
        break
print(tokenizer.decode(tokens))
runner.remove_requests(["r0"])
