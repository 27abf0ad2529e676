"""The tiny LoRA adapter the project writes, and the reading of an adapter folder's config."""

import hashlib
import json

import pytest

from serve_app.adapter_files import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    read_adapter_config,
    write_tiny_adapter,
)
from serve_app.models import TINY_CONFIG, write_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_model("tiny", tmp_path_factory.mktemp("m") / "tiny")


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_adapter_is_peft_lora_with_the_model_shapes(tiny, tmp_path):
    from safetensors import safe_open

    folder = write_tiny_adapter(tmp_path / "a", tiny, seed=1, rank=8)
    cfg = read_adapter_config(folder)
    assert cfg["r"] == 8 and cfg["peft_type"] == "LORA"
    assert set(cfg["target_modules"]) == {"q_proj", "v_proj"}
    hidden = TINY_CONFIG["hidden_size"]
    with safe_open(str(folder / ADAPTER_WEIGHTS), "pt") as f:
        keys = set(f.keys())
        a = f.get_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
        b = f.get_tensor("base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight")
    assert tuple(a.shape) == (8, hidden)
    assert tuple(b.shape) == (TINY_CONFIG["num_key_value_heads"] * TINY_CONFIG["head_dim"], 8)
    assert len(keys) == 2 * 2 * TINY_CONFIG["num_hidden_layers"]
    assert float(a.abs().sum()) > 0  # real weights, not zeros


def test_adapter_of_a_config_only_shape_has_its_grouped_query_shapes(tmp_path):
    """The 8B shape's folder (config.json, no weights: `serve-app make-model llama-3.1-8b`) is
    enough for a rank-16 adapter (issue 39's GPU bench): q_proj's B is heads x head_dim tall,
    v_proj's only the KV heads' (grouped-query attention, 8 of 32)."""
    from safetensors import safe_open

    from serve_app.models import SHAPES

    base = write_model("llama-3.1-8b", tmp_path / "m")
    cfg = SHAPES["llama-3.1-8b"]
    folder = write_tiny_adapter(tmp_path / "a", base, seed=3, rank=16)
    assert read_adapter_config(folder)["r"] == 16
    layer = "base_model.model.model.layers.{}.self_attn.{}.lora_{}.weight"
    with safe_open(str(folder / ADAPTER_WEIGHTS), "pt") as f:
        assert len(f.keys()) == 2 * 2 * cfg["num_hidden_layers"]
        shape = lambda *k: tuple(f.get_slice(layer.format(*k)).get_shape())  # noqa: E731
        assert shape(0, "q_proj", "A") == shape(31, "v_proj", "A") == (16, cfg["hidden_size"])
        assert shape(0, "q_proj", "B") == (cfg["num_attention_heads"] * cfg["head_dim"], 16)
        assert shape(31, "v_proj", "B") == (cfg["num_key_value_heads"] * cfg["head_dim"], 16)


def test_tiny_adapter_is_deterministic_by_seed(tiny, tmp_path):
    a = write_tiny_adapter(tmp_path / "a", tiny, seed=1)
    b = write_tiny_adapter(tmp_path / "b", tiny, seed=1)
    c = write_tiny_adapter(tmp_path / "c", tiny, seed=2)
    assert _digest(a / ADAPTER_WEIGHTS) == _digest(b / ADAPTER_WEIGHTS)
    assert _digest(a / ADAPTER_WEIGHTS) != _digest(c / ADAPTER_WEIGHTS)


@pytest.mark.parametrize("content, message", [
    (None, "has no adapter_config.json"),
    ("{not json", "not readable JSON"),
    (json.dumps({"peft_type": "PROMPT_TUNING", "r": 8, "target_modules": ["q_proj"]}),
     "only LORA"),
    (json.dumps({"peft_type": "LORA", "target_modules": ["q_proj"]}), "`r`"),
    (json.dumps({"peft_type": "LORA", "r": 8}), "target_modules"),
])
def test_bad_adapter_folders_say_what_is_wrong(tmp_path, content, message):
    if content is not None:
        (tmp_path / ADAPTER_CONFIG).write_text(content)
    with pytest.raises(ValueError, match=message):
        read_adapter_config(tmp_path)


def test_a_missing_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        read_adapter_config(tmp_path / "nowhere")
