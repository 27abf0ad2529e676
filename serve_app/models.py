"""Models the project writes itself, so nothing is ever downloaded.

Two kinds:

* ``tiny``: a small Llama-architecture model with real safetensors weights, deterministic from a
  seed. It is the embedded default served on CPU and the model every integration test uses.
  head_dim is 64 because the vLLM CPU attention kernels reject smaller heads.
* full-size *shapes* (``llama-3.1-8b``, ``qwen2.5-7b``, ``llama-3.1-70b``): config-only folders
  (``config.json`` + tokenizer, no weights) for ``load_format: dummy`` on GPU hosts. Throughput with
  dummy weights and fixed output lengths equals that of trained weights of the same shape.

Every folder carries a byte-level tokenizer whose vocabulary covers every id the model can emit
(``vocab_size`` ids exactly), so detokenizing random output never fails. Ordinary text is encoded
one byte per token, which also makes "a prompt of exactly N tokens" easy to build in benchmarks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Special tokens sit right after the 256 byte tokens; their ids are fixed so configs can name them.
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
EOT_TOKEN = "<|eot_id|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, EOT_TOKEN]
BYTE_TOKENS = 256
BOS_ID, EOS_ID, EOT_ID = BYTE_TOKENS, BYTE_TOKENS + 1, BYTE_TOKENS + 2

# A plain chat template (Llama-3-like markers) so /v1/chat/completions works on every model here.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start|>{{ message['role'] }}\n{{ message['content'] }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "vocab_size": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
}

_LLAMA_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
}

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": _LLAMA_8B,
    "llama-3.1-70b": {
        **_LLAMA_8B,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    },
}

MODEL_KINDS = ["tiny", *SHAPES]


def _byte_level_alphabet() -> list[str]:
    """The 256 printable stand-ins GPT-2's byte-level scheme uses for raw bytes, in byte order."""
    from tokenizers import pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel.alphabet() is unordered; order it by the byte each symbol stands for.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    ordered = [mapping[b] for b in range(256)]
    assert set(ordered) == set(alphabet), "byte-level alphabet changed in tokenizers"
    return ordered


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """Write a byte-level BPE tokenizer with exactly ``vocab_size`` ids into ``folder``.

    Ids 0..255 are the bytes, then the special tokens, then filler words (`` w<i>``) up to
    ``vocab_size`` so any id a model emits decodes to text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if vocab_size < BYTE_TOKENS + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {BYTE_TOKENS + len(SPECIAL_TOKENS)}")
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(_byte_level_alphabet())}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"Ġw{len(vocab)}"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS_TOKEN,
                "eos_token": EOS_TOKEN,
                "add_bos_token": False,
                "model_max_length": 1_000_000,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN}, indent=2)
    )


def write_generation_config(folder: Path) -> None:
    """Stop on end-of-text and end-of-turn, as instruct models do."""
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, EOT_ID]}, indent=2)
    )


def write_tiny_model(folder: Path, seed: int = 0) -> Path:
    """Write the tiny Llama (real safetensors weights, deterministic from ``seed``) to ``folder``.

    Weights are drawn with a wide normal so greedy decoding produces varied text rather than one
    token repeated. Idempotent: an existing folder with the same seed is left as it is.
    """
    import torch
    from safetensors.torch import save_file

    marker = folder / ".serve_app_model.json"
    if marker.exists() and json.loads(marker.read_text()).get("seed") == seed:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    cfg = TINY_CONFIG
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def normal(*shape: int, std: float = 0.08) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).contiguous()

    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": normal(vocab, hidden, std=1.0),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": normal(vocab, hidden, std=0.5),
    }
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        tensors[p + "self_attn.q_proj.weight"] = normal(heads * head_dim, hidden)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = normal(hidden, heads * head_dim)
        tensors[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = normal(hidden, inter)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    write_generation_config(folder)
    write_tokenizer(folder, vocab)
    marker.write_text(json.dumps({"kind": "tiny", "seed": seed}))
    return folder


def write_shape(folder: Path, shape: str) -> Path:
    """Write a config-only folder of a full-size shape, for ``load_format: dummy``."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {sorted(SHAPES)}")
    cfg = SHAPES[shape]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    write_generation_config(folder)
    write_tokenizer(folder, cfg["vocab_size"])
    (folder / ".serve_app_model.json").write_text(json.dumps({"kind": shape}))
    return folder


def write_model(kind: str, folder: Path, seed: int = 0) -> Path:
    """Write the model ``kind`` (``tiny`` or a shape name) into ``folder`` and return it."""
    if kind == "tiny":
        return write_tiny_model(folder, seed=seed)
    return write_shape(folder, kind)
