"""Model directories a serving engine can load with no hub access: config plus tokenizer.

The GPU machine has no network, so ``vllm serve`` cannot fetch a model. This writes, per
shape, a directory an engine loads with ``--load-format dummy`` (seeded random weights: two
launches of the same shape get the same weights): the architecture's ``config.json``, and a
byte-level BPE tokenizer whose vocabulary has exactly the config's ``vocab_size`` ids, so
the OpenAI server tokenizes and detokenizes every id a dummy model can sample.

The tokenizer is built, not trained: 256 byte symbols, then merges that grow words over a
27-letter alphabet (``a``-``z`` and the byte-level space ``Ġ``) level by level until the
vocabulary is full, plus two special tokens. Deterministic, no corpus, a few seconds.

    python -m benchmarks.offline_model --out build/models            # every shape
    python -m benchmarks.offline_model --out build/models qwen3-0.6b
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "vocab_size": 151936,
        "torch_dtype": "bfloat16",
        "attention_bias": False,
    },
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "vocab_size": 128256,
        "torch_dtype": "bfloat16",
        "attention_bias": False,
    },
    "llama-3.2-3b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "vocab_size": 128256,
        "torch_dtype": "bfloat16",
        "attention_bias": False,
    },
}
"""The published shapes of Qwen3-0.6B, Llama-3-8B and Llama-3.2-3B (weights are never
needed; Llama-3.2-3B's ``rope_scaling`` is left out: it changes no weight or KV shape)."""

EOS, BOS = "<|endoftext|>", "<|begin_of_text|>"
_ALPHABET = "abcdefghijklmnopqrstuvwxyz\u0120"  # Ġ: the byte-level form of a space


def build_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` with exactly ``vocab_size`` ids (the two
    special tokens last). Raises ``ValueError`` for a vocabulary under 300 ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if vocab_size < 300:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level vocabulary")
    byte_symbols = pre_tokenizers.ByteLevel.alphabet()
    vocab: dict[str, int] = {s: i for i, s in enumerate(sorted(byte_symbols))}
    merges: list[tuple[str, str]] = []
    room = vocab_size - 2
    level = list(_ALPHABET)
    while len(vocab) < room:
        grown = []
        for word, letter in itertools.product(level, _ALPHABET):
            if len(vocab) >= room:
                break
            token = word + letter
            if token in vocab:
                continue
            vocab[token] = len(vocab)
            merges.append((word, letter))
            grown.append(token)
        level = grown
    for special in (EOS, BOS):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS, BOS])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok


def write_model_dir(out: Path, shape: str) -> Path:
    """Write ``out/<shape>/`` (config, generation config, tokenizer files) and return it.
    Raises ``KeyError`` for a shape not in ``SHAPES``."""
    config = dict(SHAPES[shape])
    tok = build_tokenizer(int(config["vocab_size"]))
    eos_id, bos_id = tok.token_to_id(EOS), tok.token_to_id(BOS)
    config.update(eos_token_id=eos_id, bos_token_id=bos_id)
    path = out / shape
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": bos_id, "eos_token_id": eos_id}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tok.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "model_max_length": int(config["max_position_embeddings"]),
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write into")
    parser.add_argument("shapes", nargs="*", choices=[[], *SHAPES], help="default: all")
    args = parser.parse_args(argv)
    for shape in args.shapes or SHAPES:
        print(write_model_dir(args.out, shape))


if __name__ == "__main__":
    main()
