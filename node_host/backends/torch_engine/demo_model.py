"""A tiny LLM made on the spot, so a fresh machine runs the demo and the tests with no download.

`ensure_tiny_qwen2(path)`: a random-weight Qwen2-architecture causal LM (hidden 64, 2 layers, 4 heads,
2 KV heads, MLP twice the hidden size) with a byte-level BPE tokenizer trained offline on the text below and a ChatML chat
template, saved with `save_pretrained`, so `AutoModelForCausalLM`/`AutoTokenizer.from_pretrained(path)`
load it exactly as they load real weights. Its output is gibberish: it exercises the serving path,
not language. (The sklearn engine's demo scorer is node_host/backends/sklearn_engine/demo_scorer.py.)

It is idempotent (an existing model is left alone) and atomic (built in a temporary sibling, then
renamed into place), so two workers of one model starting together cannot see a half-written model.
A spec opts in with `backend.config.demo: true`; the worker creates the model at `model.path` if
nothing is there. Same seed and hidden size, same model.

`hidden_size` (default 64) sets the width; the 4 heads make the head size a quarter of it. vLLM's CPU
attention refuses a head size of 16 ("Unsupported CPU attention configuration: head_dim=16"), so a model
for a real vLLM is made with `hidden_size=256` (head size 64, which it accepts). An existing model is
left alone whatever its size: the marker file records the size it was made with.

    python -m node_host.backends.torch_engine.demo_model PATH [--hidden-size 256]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

MARKER = "sie-demo.json"  # written last inside a tiny LLM directory: its presence means complete
DEFAULT_HIDDEN_SIZE = 64
_HEADS = 4
_KV_HEADS = 2

_CORPUS = """\
SIE is a traffic director and execution plane for clusters of heterogeneous models. It places models on
GPUs, admits and queues requests, weights traffic by each model's load, keeps priority tiers, evicts
before memory runs out, and reports one metrics schema for every model. Envoy carries the requests; a
control plane feeds it weights computed from the telemetry of sidecars; node hosts run the workers.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Hello, how are you today? I am fine, thank you. What is the weather like? It is sunny and warm.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000. Punctuation: , . ; : ! ? ( ) [ ] { } " ' - _ / \\ @ # $ % & *.
def main(): return 0  # code is text too
Every morning the baker opened the small shop on the corner of the market square. Bread, cakes and
pastries filled the shelves; children pressed their faces against the window while their parents talked
about the weather, the harvest, the price of flour and the news from the city. In the evening the
lights went out one by one, the river carried the last boats home, and the stars came out over the hills.
Questions, answers, requests and responses: latency, throughput, memory, priority, eviction, placement.
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April May June July.
"""

_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no unknown tokens
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None
    )
    fast.chat_template = _CHAT_TEMPLATE
    return fast


def _atomic_dir(path: Path, build) -> Path:
    """Run build(tmp_dir) in a sibling temp dir, then rename it to `path` (or keep the winner's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, path)
        except OSError:
            if not path.exists():
                raise
            # Someone else finished first; theirs is identical (same seed).
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def ensure_tiny_qwen2(path: str | Path, seed: int = 0, hidden_size: int = DEFAULT_HIDDEN_SIZE) -> Path:
    """Create a tiny random-weight Qwen2 model with its tokenizer at `path` unless one is there.
    `hidden_size` must be a positive multiple of 8 (4 heads of an even head size, for rotary embeddings)."""
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size <= 0 or hidden_size % 8:
        raise ValueError(f"hidden_size must be a positive multiple of 8, got {hidden_size!r}")
    path = Path(path)
    if (path / MARKER).is_file():
        return path
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(
            f"{path} exists and is not a demo model (no {MARKER}); point model.path at an empty or new "
            "directory, or drop backend.config.demo to serve the weights that are there"
        )
    if path.exists():
        path.rmdir()

    def build(tmp: Path) -> None:
        import torch
        from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

        tokenizer = _build_tokenizer(vocab_size=1024)
        config = Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=2,
            num_attention_heads=_HEADS,
            num_key_value_heads=_KV_HEADS,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
        )
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).eval()
        model.generation_config = GenerationConfig(
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
        )
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        marker = {"kind": "tiny-qwen2", "seed": seed, "note": "random weights: output is gibberish"}
        if hidden_size != DEFAULT_HIDDEN_SIZE:  # the default model's files stay as they always were
            marker["hidden_size"] = hidden_size
        (tmp / MARKER).write_text(json.dumps(marker) + "\n")

    return _atomic_dir(path, build)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m node_host.backends.torch_engine.demo_model",
        description="Create a tiny random-weight Qwen2 model (and its tokenizer) at PATH unless one is there.",
    )
    parser.add_argument("path", metavar="PATH", help="the model directory to create")
    parser.add_argument(
        "--hidden-size",
        type=int,
        default=DEFAULT_HIDDEN_SIZE,
        help="model width, a multiple of 8 (head size = width / 4); 256 for vLLM's CPU attention, which "
        f"refuses a head size of 16 (default {DEFAULT_HIDDEN_SIZE})",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        print(ensure_tiny_qwen2(args.path, seed=args.seed, hidden_size=args.hidden_size))
    except (ValueError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
