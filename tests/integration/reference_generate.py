"""The engine's own greedy output, with no Ray and no HTTP in between (run as a subprocess).

usage: python reference_generate.py MODEL_PATH OUT_JSON < requests.json
Each request is {"prompt": str} or {"messages": [...]}, with "max_tokens".
"""

import json
import sys


def main() -> None:
    from vllm import LLM, SamplingParams

    requests = json.load(sys.stdin)
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=2048, enforce_eager=True)
    results = []
    for r in requests:  # one at a time, as the endpoint test sends them
        params = SamplingParams(temperature=0.0, max_tokens=r["max_tokens"])
        if "messages" in r:
            out = llm.chat(r["messages"], params, use_tqdm=False)[0]
        else:
            out = llm.generate([r["prompt"]], params, use_tqdm=False)[0]
        results.append({"text": out.outputs[0].text, "prompt_tokens": len(out.prompt_token_ids),
                        "completion_tokens": len(out.outputs[0].token_ids)})
    with open(sys.argv[2], "w") as f:  # stdout carries vLLM's logs
        json.dump(results, f)


if __name__ == "__main__":
    main()
