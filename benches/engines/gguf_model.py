"""Build a Hugging Face Llama model directory for vLLM from a SmolLM2 GGUF file.

Usage: gguf_model.py MODEL.gguf OUTDIR [--tiny]

Writes tokenizer.json (byte-level BPE rebuilt from the GGUF's vocabulary and merges, with SmolLM2's
pre-tokenizer: single digits, then GPT-2 byte-level), tokenizer_config.json (special tokens and the
GGUF's chat template), generation_config.json and config.json. Without --tiny it also writes
model.safetensors: every tensor dequantised to bf16, with llama.cpp's rotary permutation of the q/k
projections undone. With --tiny the config is a 4-layer, 256-wide Llama sharing the tokenizer and no
weights are written: serve it with --load-format dummy.
"""
import json
import os
import sys

import numpy as np
from gguf import GGUFReader

CONTROL = 3  # llama.cpp token type of special tokens


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    tiny = "--tiny" in sys.argv[1:]
    if len(args) != 2:
        sys.exit(__doc__)
    src, out = args
    os.makedirs(out, exist_ok=True)
    reader = GGUFReader(src)

    def scalar(key):
        return reader.fields[key].contents()

    def strings(key):
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    vocab = strings("tokenizer.ggml.tokens")
    field = reader.fields["tokenizer.ggml.token_type"]
    types = [int(field.parts[i][0]) for i in field.data]
    merges = strings("tokenizer.ggml.merges")
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, (t, kind) in enumerate(zip(vocab, types)) if kind == CONTROL
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, dict(type="ByteLevel", **byte_level)]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": {t: i for i, t in enumerate(vocab)}, "merges": merges},
    }
    write(out, "tokenizer.json", tokenizer)
    bos = int(scalar("tokenizer.ggml.bos_token_id"))
    eos = int(scalar("tokenizer.ggml.eos_token_id"))
    unk = int(scalar("tokenizer.ggml.unknown_token_id"))
    write(out, "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False,
        "bos_token": vocab[bos], "eos_token": vocab[eos], "pad_token": vocab[eos], "unk_token": vocab[unk],
        "model_max_length": 8192, "clean_up_tokenization_spaces": False,
        "chat_template": scalar("tokenizer.chat_template")})
    write(out, "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos})

    arch = "llama."
    heads = int(scalar(arch + "attention.head_count"))
    kv_heads = int(scalar(arch + "attention.head_count_kv"))
    hidden = int(scalar(arch + "embedding_length"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": int(scalar(arch + "feed_forward_length")),
        "num_hidden_layers": int(scalar(arch + "block_count")),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
        "hidden_act": "silu", "max_position_embeddings": int(scalar(arch + "context_length")),
        "rms_norm_eps": float(scalar(arch + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(scalar(arch + "rope.freq_base")), "vocab_size": len(vocab),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "bfloat16",
        "attention_bias": False, "mlp_bias": False}
    if tiny:
        config.update(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
    write(out, "config.json", config)
    if not tiny:
        write_weights(reader, out, heads, kv_heads)
    print(f"gguf_model.py: {'tiny config' if tiny else 'model'} + tokenizer ({len(vocab)} tokens) -> {out}")


def write(out, name, obj):
    with open(os.path.join(out, name), "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=None if name == "tokenizer.json" else 1)


def write_weights(reader, out, heads, kv_heads):
    import torch
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    # llama.cpp's converter reorders each head's q/k rows from HF's two rotary halves (h, 2, d/2) to
    # interleaved pairs (h, d/2, 2); this is the inverse.
    def halves(w, n):
        return w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    layer = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    state = {}
    for t in reader.tensors:
        shape = [int(x) for x in reversed(t.shape)]
        w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        parts = t.name.split(".")
        if parts[0] == "blk":
            name = f"model.layers.{parts[1]}.{layer[parts[2]]}.weight"
            if parts[2] == "attn_q":
                w = halves(w, heads)
            elif parts[2] == "attn_k":
                w = halves(w, kv_heads)
        else:
            name = top[t.name]
        state[name] = torch.from_numpy(np.ascontiguousarray(w)).to(torch.bfloat16)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    main()
