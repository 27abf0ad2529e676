"""The models the project writes: deterministic weights, tokenizers that cover every id."""

import hashlib
import json

import pytest

from serve_app.models import EOS_ID, SHAPES, TINY_CONFIG, write_model, write_tokenizer


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_model_is_deterministic(tmp_path):
    a = write_model("tiny", tmp_path / "a", seed=3)
    b = write_model("tiny", tmp_path / "b", seed=3)
    c = write_model("tiny", tmp_path / "c", seed=4)
    assert _digest(a / "model.safetensors") == _digest(b / "model.safetensors")
    assert _digest(a / "model.safetensors") != _digest(c / "model.safetensors")
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["head_dim"] == 64  # the vLLM CPU kernels reject smaller heads


def test_tiny_weights_match_config(tmp_path):
    from safetensors import safe_open

    folder = write_model("tiny", tmp_path / "t")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        emb = f.get_tensor("model.embed_tokens.weight")
        keys = set(f.keys())
    assert tuple(emb.shape) == (TINY_CONFIG["vocab_size"], TINY_CONFIG["hidden_size"])
    assert f"model.layers.{TINY_CONFIG['num_hidden_layers'] - 1}.mlp.down_proj.weight" in keys


def test_tokenizer_covers_every_id(tmp_path):
    from tokenizers import Tokenizer

    write_tokenizer(tmp_path, 600)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 600
    for i in range(600):
        assert tok.id_to_token(i) is not None
    assert tok.decode(list(range(600)), skip_special_tokens=False)
    # Text round-trips, one token per byte.
    ids = tok.encode("héllo wörld").ids
    assert tok.decode(ids) == "héllo wörld"
    assert len(ids) == len("héllo wörld".encode())
    assert tok.id_to_token(EOS_ID) == "<|end_of_text|>"


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_shapes_are_config_only(tmp_path, shape):
    folder = write_model(shape, tmp_path / shape)
    assert not list(folder.glob("*.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    assert len(tok["model"]["vocab"]) == cfg["vocab_size"]
