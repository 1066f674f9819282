"""A tiny GGUF model for the llama.cpp server in the tests: random weights, a real byte-level BPE tokenizer.

What: `write_model(path)` writes a llama-architecture GGUF file (2 layers, 64-wide, 4 heads, 512
context, float32) whose tokenizer is GPT-2 style byte-level BPE: the 256 byte tokens, merges learned
here from a small built-in text (so common words and JSON punctuation are single tokens), and
ChatML's special tokens, with a ChatML chat template. The weights are random (seeded), so the model's
text is noise (biased so that numbers end and free text is not JSON: see `write_model`), but
everything a server does around it is real: tokenising, sampling, grammars for
structured output, streaming, usage counts.
Why: the real engine in the tests (`llama-cpp-python[server]`) needs a model, and nothing may be
downloaded; the file is about 1 MB and written in well under a second.
Run with the interpreter that has the `gguf` package (the llama.cpp venv: `make llama-setup`):
`.tools/llama-venv/bin/python tests/llamacpp_model.py OUT.gguf`.
"""

from __future__ import annotations

import sys
from collections import Counter

CORPUS = """The quarterly revenue of the company was reported in the ledger. Answer with a single JSON object.
{"amount": 85.5, "account": "6001", "ok": true, "voucher": {"amount": 12, "account": "6051"}}
Hello, how are you? This is a test of the gateway and the model server. The answer is yes or no."""
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
N_EMBD, N_HEAD, N_LAYER, N_FF, N_CTX, N_MERGES = 64, 4, 2, 128, 512, 64


def byte_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (tokens are written in it)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))


def learn_merges(text: str, table: dict[int, str], count: int) -> list[tuple[str, str]]:
    """Byte-level BPE on `text`'s words (a space starts a word, as GPT-2 splits)."""
    words = Counter()
    for i, w in enumerate(text.replace("\n", " ").split(" ")):
        if w:
            raw = (" " + w if i else w).encode()
            words[tuple(table[b] for b in raw)] += 1
    merges: list[tuple[str, str]] = []
    for _ in range(count):
        pairs = Counter()
        for word, n in words.items():
            for a, b in zip(word, word[1:]):
                pairs[(a, b)] += n
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        merged = Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return merges


def write_model(path: str, seed: int = 0) -> None:
    import gguf
    import numpy as np

    table = byte_unicode()
    merges = learn_merges(CORPUS, table, N_MERGES)
    tokens = [table[b] for b in range(256)] + [a + b for a, b in merges]
    tokens = list(dict.fromkeys(tokens))
    types = [gguf.TokenType.NORMAL] * len(tokens)
    tokens += SPECIALS
    types += [gguf.TokenType.CONTROL] * len(SPECIALS)
    n_vocab = len(tokens)
    eos = tokens.index("<|im_end|>")

    w = gguf.GGUFWriter(path, "llama")
    w.add_name("adapter-gateway-test-tiny")
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> "np.ndarray":
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    ones = np.ones(N_EMBD, dtype=np.float32)
    # Dimension 0 of every embedding is large, so it dominates the normalised state and column 0 of the
    # output matrix acts as a per-token bias: random, except that digits and exponents are unlikely and
    # `}` and `,` likely. A grammar-constrained number then ends after a digit or two instead of running
    # to the context's end, and free text is mostly `}` (never valid JSON by chance).
    embd = weight(n_vocab, N_EMBD)
    embd[:, 0] = 4.0
    out = weight(n_vocab, N_EMBD)
    out[:, 0] = rng.standard_normal(n_vocab).astype(np.float32) * 0.3
    for i, tok in enumerate(tokens):
        if tok in SPECIALS:
            continue
        if all(c in "0123456789eE.+" for c in tok):
            out[i, 0] = -2.0
        elif tok in ("}", ","):
            out[i, 0] = 1.0
    w.add_tensor("token_embd.weight", embd)
    for i in range(N_LAYER):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{name}.weight", weight(N_EMBD, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_gate.weight", weight(N_FF, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_up.weight", weight(N_FF, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_down.weight", weight(N_EMBD, N_FF))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", out)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    write_model(sys.argv[1])
