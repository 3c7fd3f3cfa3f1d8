"""Small local Hugging Face model files for the models vLLM's own tests name.

vLLM's ``ModelConfig`` reads ``config.json`` (and for some paths the tokenizer files) of the
model a test names. CI has no hub access, so ``write_hub_cache(dir)`` lays out a hub cache
(``models--org--name/snapshots/<rev>/`` + ``refs/main``) with configs carrying the public
architectures' shape fields, and a tiny byte-level BPE tokenizer built with ``tokenizers``
(the real vocabularies are not needed: the tests pass token ids, not text). Point
``HF_HUB_CACHE`` at the directory and set ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_REV = "0" * 40

_OPT = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "activation_function": "relu",
    "do_layer_norm_before": True,
    "enable_bias": True,
    "layer_norm_elementwise_affine": True,
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "max_position_embeddings": 2048,
    "vocab_size": 50272,
    "torch_dtype": "float16",
}

_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "facebook/opt-125m": {
        **_OPT,
        "hidden_size": 768,
        "ffn_dim": 3072,
        "num_attention_heads": 12,
        "num_hidden_layers": 12,
        "word_embed_proj_dim": 768,
    },
    "facebook/opt-350m": {
        **_OPT,
        "hidden_size": 1024,
        "ffn_dim": 4096,
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "word_embed_proj_dim": 512,
        "do_layer_norm_before": False,
    },
    "Qwen/Qwen1.5-7B": {
        **_QWEN2,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "num_hidden_layers": 32,
        "max_position_embeddings": 32768,
    },
    "Qwen/Qwen3-0.6B": {
        **_QWEN2,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "head_dim": 128,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "num_hidden_layers": 28,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
    },
    "Qwen/Qwen3-Next-80B-A3B-Instruct": {
        **_QWEN2,
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": 2048,
        "intermediate_size": 5120,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "num_hidden_layers": 48,
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
        "mlp_only_layers": [],
        "partial_rotary_factor": 0.25,
        "max_position_embeddings": 262144,
        "rope_theta": 10000000.0,
    },
    "Qwen/Qwen2.5-VL-3B-Instruct": {
        **_QWEN2,
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "num_hidden_layers": 36,
        "max_position_embeddings": 128000,
        "image_token_id": 151655,
        "video_token_id": 151656,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "out_hidden_size": 2048,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
            "in_chans": 3,
        },
    },
    "hmellor/tiny-random-LlamaForCausalLM": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 16,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 2,
        "max_position_embeddings": 2048,
        "vocab_size": 32000,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    },
    "llava-hf/llava-1.5-7b-hf": {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "ignore_index": -100,
        "image_token_index": 32000,
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "image_seq_length": 576,
        "pad_token_id": 32001,
        "torch_dtype": "float16",
        "text_config": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "num_hidden_layers": 32,
            "max_position_embeddings": 4096,
            "vocab_size": 32064,
            "rms_norm_eps": 1e-5,
            "torch_dtype": "float16",
        },
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": 1024,
            "image_size": 336,
            "intermediate_size": 4096,
            "num_attention_heads": 16,
            "num_hidden_layers": 24,
            "patch_size": 14,
            "projection_dim": 768,
            "vocab_size": 32000,
        },
    },
}


def _tokenizer_files(vocab_size: int) -> dict[str, str]:
    """A minimal byte-level BPE tokenizer (``tokenizer.json``) and its config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for special in ("<s>", "</s>", "<pad>", "<unk>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "model_max_length": 1 << 20,
    }
    del vocab_size  # the tests pass token ids; only the tokenizer's presence matters
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(config)}


def write_hub_cache(root: Path) -> Path:
    """Write every model of ``CONFIGS`` into the hub cache at ``root`` (idempotent)."""
    root.mkdir(parents=True, exist_ok=True)
    for repo, config in CONFIGS.items():
        base = root / ("models--" + repo.replace("/", "--"))
        snap = base / "snapshots" / _REV
        snap.mkdir(parents=True, exist_ok=True)
        (base / "refs").mkdir(exist_ok=True)
        (base / "refs" / "main").write_text(_REV)
        (snap / "config.json").write_text(json.dumps(config, indent=1))
        vocab = int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size"))
        for name, text in _tokenizer_files(vocab).items():
            (snap / name).write_text(text)
    return root
