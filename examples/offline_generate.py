"""Offline generation with the LLM API (default model: SmolLM2-135M-Instruct on the CPU)."""

from mrv2 import LLM, SamplingParams

llm = LLM(max_model_len=1024)
questions = ["What is the capital of France?", "Name three primary colors."]
params = SamplingParams(temperature=0.0, max_tokens=48)
for question, output in zip(questions, llm.chat(
        [[{"role": "user", "content": q}] for q in questions], params), strict=True):
    print(f"Q: {question}\nA: {output.outputs[0].text.strip()}\n")

sampled = llm.generate("Once upon a time", SamplingParams(temperature=0.8, top_p=0.95, seed=42,
                                                          max_tokens=32))
print(sampled[0].outputs[0].text)
