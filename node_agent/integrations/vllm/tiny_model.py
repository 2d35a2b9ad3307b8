"""A random-weight Llama and a word-level tokenizer written to a directory.

Tests and benchmarks need a real model vLLM can load offline: this writes a
``LlamaConfig`` with random weights (``save_pretrained``, safetensors) and a
``tokenizers`` WordLevel tokenizer whose words are ``w0 .. w{vocab-1}``, so a
prompt of N tokens is ``" ".join(f"w{i}" for i in ids)``. Nothing is downloaded.

Usage: ``python -m node_agent.integrations.vllm.tiny_model DIR [--layers 4 --hidden 256
--heads 4 --kv-heads 2 --vocab 1024 --seed 0]``: models of other seeds have the
same shape and other weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def write_model(out: str | Path, layers: int = 4, hidden: int = 256, heads: int = 4,
                kv_heads: int = 2, vocab: int = 1024, max_positions: int = 16384,
                seed: int = 0) -> Path:
    """Write the model and tokenizer into ``out`` (idempotent: skipped when present)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(out)
    marker = path / "flexkv-tiny-model.json"
    spec = {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
            "vocab": vocab, "max_positions": max_positions, "seed": seed, "init": 0.1}
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return path
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False, torch_dtype="bfloat16",
        initializer_range=0.1,  # larger than the default so greedy outputs depend on the KV
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    words = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(4, vocab):
        words[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": max_positions,
        "add_bos_token": False, "add_eos_token": False,
    }))
    marker.write_text(json.dumps(spec))
    return path


def prompt_ids(n: int, seed: int, vocab: int = 1024) -> list[int]:
    """``n`` deterministic token ids in ``[4, vocab)`` (no special tokens)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(4, vocab) for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(write_model(a.out, a.layers, a.hidden, a.heads, a.kv_heads, a.vocab, seed=a.seed))


if __name__ == "__main__":
    main()
