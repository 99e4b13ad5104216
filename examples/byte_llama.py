"""Write a Llama config and a byte-level tokenizer shaped like the harness's built-in `lm` model, so the two can be
compared on the same task, data and DeepSpeed file (no weights: `model.hf` on its config.json initialises it).

    python examples/byte_llama.py runs/byte-llama --d-model 128 --n-layers 2 --n-heads 4
    python -m harness bench sweep --run configs/runs/lm_compare.toml --vary 'model.hf="",runs/byte-llama/config.json'

`--weights 100MB` also writes random weights in checkpoint shards of at most that size (`save_pretrained`), so
`model.hf` on the directory loads them with `from_pretrained`, as a pretrained model would be. With `--base-only`
they are the base model's alone (`LlamaModel`: no output layer, names without the `model.` prefix), as a checkpoint
pretrained under another head: the harness's partitioned reader declines it and transformers' loader builds it.

Same width, depth, heads and sequence length as the built-in model; its SwiGLU feed-forward has 3 matrices where
the built-in GELU one has 2, so its width is 2/3 of 4 x d_model (the usual Llama choice): the parameter count
stays within a few percent.
"""
from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-layers", type=int, default=2)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--weights", metavar="SHARD_SIZE", help="also write random weights in shards of this size")
    ap.add_argument("--base-only", action="store_true", help="those weights without the output layer (LlamaModel's)")
    args = ap.parse_args()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel, PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 byte symbols of GPT-2's byte-level encoding
    vocab = {s: i for i, s in enumerate(sorted(alphabet))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per byte
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=args.d_model, num_hidden_layers=args.n_layers,
                         num_attention_heads=args.n_heads, num_key_value_heads=args.n_heads,
                         intermediate_size=int(2 / 3 * 4 * args.d_model), max_position_embeddings=args.seq_len,
                         tie_word_embeddings=False, eos_token_id=vocab["<eos>"], pad_token_id=vocab["<eos>"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    fast.save_pretrained(out)
    if args.weights:
        (LlamaModel if args.base_only else LlamaForCausalLM)(config).save_pretrained(out, max_shard_size=args.weights)
    print(f"wrote {out / 'config.json'}{' and weights' if args.weights else ''} and its tokenizer ({len(vocab)} tokens)")


if __name__ == "__main__":
    main()
