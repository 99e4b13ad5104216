"""SentencePiece tokenizers, trained on a task's training split only and stored with its prepared data.

Ids are fixed across tasks: 0 = padding, 1 = unknown, 2 = begin, 3 = end of sequence; a task's own symbols
(e.g. "<mask>", "<cls>") follow, then the learned pieces.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Iterable

PAD, UNK, BOS, EOS = 0, 1, 2, 3


class Tokenizer:
    def __init__(self, processor):
        self.sp = processor
        self.pad_id, self.unk_id, self.bos_id, self.eos_id = PAD, UNK, BOS, EOS

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        import sentencepiece as spm

        return cls(spm.SentencePieceProcessor(model_file=str(path)))

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts)

    def encode_target_batch(self, texts: list[str]) -> list[list[int]]:
        return self.encode_batch(texts)  # one joint vocabulary for both sides

    def decode(self, ids: Iterable[int]) -> str:
        """Special ids (padding, begin, end) are dropped."""
        return self.sp.decode([int(i) for i in ids if int(i) not in (PAD, BOS, EOS)])

    def piece_id(self, piece: str) -> int:
        i = self.sp.piece_to_id(piece)
        if i == UNK and piece != self.sp.id_to_piece(UNK):
            raise KeyError(f"{piece!r} is not in the vocabulary")
        return i


def train_tokenizer(texts: Iterable[str], path: Path, vocab_size: int, model_type: str = "unigram",
                    user_symbols: tuple[str, ...] = (), character_coverage: float = 1.0) -> Tokenizer:
    """Train on `texts` in this process and write the model to `path` (a .model file).

    `vocab_size` is an upper bound: a small corpus gets fewer pieces, so models take `Tokenizer.vocab_size`.
    """
    import sentencepiece as spm

    model = io.BytesIO()
    spm.set_random_generator_seed(0)  # the same text, the same tokenizer: its 2M-sentence sample of a larger one too
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size, model_type=model_type,
        character_coverage=character_coverage, pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS,
        user_defined_symbols=list(user_symbols), hard_vocab_limit=False,  # a small corpus gets a smaller vocabulary
        add_dummy_prefix=model_type != "char",  # char models (residues) map one character to one id
        input_sentence_size=2_000_000, shuffle_input_sentence=True, num_threads=1, minloglevel=2)
    Path(path).write_bytes(model.getvalue())
    return Tokenizer.load(path)
