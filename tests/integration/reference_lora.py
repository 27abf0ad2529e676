"""vLLM's own greedy output with LoRA adapters, with no Ray and no HTTP (run as a subprocess).

usage: python reference_lora.py MODEL_PATH OUT_JSON < spec.json
spec: {"prompts": [str], "max_tokens": int, "max_lora_rank": int, "ignore_eos": bool,
       "adapters": {name: path}}. Output: {name or "": [text per prompt]} ("" is the base).
"""

import json
import sys


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    spec = json.load(sys.stdin)
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=2048, enforce_eager=True,
              enable_lora=True, max_loras=1, max_lora_rank=spec["max_lora_rank"])
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"],
                            ignore_eos=spec.get("ignore_eos", False))
    results: dict[str, list[str]] = {}
    targets = {"": None, **{name: LoRARequest(name, i + 1, path)
                           for i, (name, path) in enumerate(sorted(spec["adapters"].items()))}}
    for name, lora in targets.items():
        outs = llm.generate(spec["prompts"], params, lora_request=lora, use_tqdm=False)
        results[name] = [o.outputs[0].text for o in outs]
    with open(sys.argv[2], "w") as f:  # stdout carries vLLM's logs
        json.dump(results, f)


if __name__ == "__main__":
    main()
