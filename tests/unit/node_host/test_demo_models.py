"""Demo models: created once, atomically, loadable by the same code that loads real weights."""

from __future__ import annotations

import os

import pytest

from node_host.backends.sklearn_engine.demo_scorer import demo_scorer_corpus, ensure_demo_scorer
from node_host.backends.torch_engine.demo_model import MARKER, ensure_tiny_qwen2


def test_tiny_qwen2_is_idempotent_and_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "models" / "tiny"
    assert ensure_tiny_qwen2(path) == path
    stamp = os.stat(path / "model.safetensors").st_mtime_ns
    assert ensure_tiny_qwen2(path) == path
    assert os.stat(path / "model.safetensors").st_mtime_ns == stamp  # second call changed nothing
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny"]  # no temp dir left behind

    model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    config = model.config
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("qwen2", 64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.vocab_size == len(tokenizer)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token is not None
    text = "Hello, SIE! é"
    assert tokenizer.decode(tokenizer.encode(text)) == text  # byte-level: any text round-trips
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>assistant\n")


def test_tiny_qwen2_refuses_a_directory_that_is_not_a_demo(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"real")
    with pytest.raises(FileExistsError, match=MARKER):
        ensure_tiny_qwen2(tmp_path)


def test_demo_scorer_is_idempotent_and_separates_classes(tmp_path):
    sio = pytest.importorskip("skops.io")
    path = ensure_demo_scorer(tmp_path / "scorer.skops")
    stamp = os.stat(path).st_mtime_ns
    assert ensure_demo_scorer(path) == path and os.stat(path).st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == ["scorer.skops"]
    assert sio.get_untrusted_types(file=path) == []  # the safe format, with nothing beyond skops' trusted types
    pipeline = sio.load(path)
    texts, labels = demo_scorer_corpus(seed=1, n=200)  # a fresh sample, not the training one
    accuracy = (pipeline.predict(texts) == labels).mean()
    assert accuracy > 0.9
    good, bad = pipeline.predict_proba(["great service love it", "terrible rude awful"])[:, 1]
    assert good > 0.5 > bad
