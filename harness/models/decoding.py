"""Greedy and beam-search decoding for the encoder-decoder (`harness.models.seq2seq`), batched, with a cache.

The model is used only through its top-level call (see `seq2seq.py`): `model(src=src)` encodes once, then
`model(tgt_in=tok, memory=m, src_mask=s, cache=c)` runs one decoder position. That call may be a DeepSpeed
engine under ZeRO-3, where every forward gathers parameters collectively, so ranks must make the SAME number
of decoder calls: the loop goes on while any rank still has work (`any_active`, an all-reduce in
`harness.tasks.translation`), and a rank whose batch is done keeps calling the model on its finished state
and discards the result. One process passes nothing and stops as soon as its batch is done.

Beam search keeps K hypotheses per sentence; a finished one (it emitted EOS) stays in the beam with its score
frozen and competes with the live ones by length-normalised score, the GNMT penalty
lp(n) = ((5 + n) / 6) ** alpha (alpha = 0 turns it off; n counts generated tokens, EOS included). With K = 1
the only candidates at each step are one hypothesis' continuations, all of the same length, so beam search
reduces to the greedy argmax exactly (tested).
"""
from __future__ import annotations

from typing import Callable

import torch


def gnmt_penalty(length: torch.Tensor, alpha: float) -> torch.Tensor:
    return ((5.0 + length.float()) / 6.0) ** alpha


def _local(active: bool) -> bool:
    return active


@torch.no_grad()
def generate(model, src: torch.Tensor, *, bos: int, eos: int, pad: int, max_len: int, beam_size: int = 1,
             length_penalty: float = 0.6, any_active: Callable[[bool], bool] = _local) -> list[list[int]]:
    """Token ids of the best hypothesis per source row (B, S), EOS and what follows removed."""
    if beam_size == 1:
        return greedy(model, src, bos=bos, eos=eos, pad=pad, max_len=max_len, any_active=any_active)
    return beam_search(model, src, bos=bos, eos=eos, pad=pad, max_len=max_len, beam_size=beam_size,
                       length_penalty=length_penalty, any_active=any_active)


@torch.no_grad()
def greedy(model, src: torch.Tensor, *, bos: int, eos: int, pad: int, max_len: int,
           any_active: Callable[[bool], bool] = _local) -> list[list[int]]:
    memory, src_mask = model(src=src)  # (B, S, C), (B, S)
    B = src.shape[0]
    tokens = torch.full((B, 1), bos, dtype=torch.long, device=src.device)  # (B, 1 + generated)
    done = torch.zeros(B, dtype=torch.bool, device=src.device)
    cache, step = None, 0
    while any_active(step < max_len and not bool(done.all())):  # sync point (all-reduce) under several ranks
        logits, new_cache = model(tgt_in=tokens[:, -1:], memory=memory, src_mask=src_mask, cache=cache)
        if step < max_len and not done.all():  # else: a call only to keep in step with the other ranks
            nxt = _allowed(logits[:, -1], bos, pad).argmax(-1).masked_fill(done, pad)  # (B,)
            tokens, cache = torch.cat([tokens, nxt[:, None]], dim=1), new_cache
            done |= nxt == eos
            step += 1
    return [_strip(row, eos, pad) for row in tokens[:, 1:].tolist()]


@torch.no_grad()
def beam_search(model, src: torch.Tensor, *, bos: int, eos: int, pad: int, max_len: int, beam_size: int,
                length_penalty: float = 0.6, any_active: Callable[[bool], bool] = _local) -> list[list[int]]:
    K = beam_size
    memory, src_mask = model(src=src)
    B, dev = src.shape[0], src.device
    memory, src_mask = memory.repeat_interleave(K, dim=0), src_mask.repeat_interleave(K, dim=0)  # (B*K, S, ...)
    tokens = torch.full((B * K, 1), bos, dtype=torch.long, device=dev)
    # All K beams start identical: only the first is live, or the beam would fill with K copies of one path.
    scores = torch.full((B, K), float("-inf"), device=dev)
    scores[:, 0] = 0.0                                         # (B, K) summed log-probabilities
    lengths = torch.zeros(B, K, dtype=torch.long, device=dev)  # generated tokens, EOS included
    done = torch.zeros(B, K, dtype=torch.bool, device=dev)
    cache, step = None, 0
    while any_active(step < max_len and not bool(done.all())):  # sync point (all-reduce) under several ranks
        logits, new_cache = model(tgt_in=tokens[:, -1:], memory=memory, src_mask=src_mask, cache=cache)
        if not (step < max_len and not done.all()):
            continue  # a call only to keep in step with the other ranks
        logp = _allowed(logits[:, -1].float().log_softmax(-1), bos, pad).view(B, K, -1)  # (B, K, V)
        V = logp.shape[-1]
        # A finished hypothesis has exactly one continuation, padding, at no cost; its length stays.
        logp = torch.where(done[..., None], torch.full_like(logp, float("-inf")), logp)
        logp[..., pad] = torch.where(done, 0.0, logp[..., pad])
        cand = scores[..., None] + logp                                    # (B, K, V)
        cand_len = lengths[..., None] + (~done)[..., None].long()          # (B, K, 1)
        ranked = (cand / gnmt_penalty(cand_len, length_penalty)).view(B, K * V)
        top = ranked.topk(K, dim=-1).indices                               # (B, K) into K*V
        beam, tok = top // V, top % V
        scores = cand.view(B, K * V).gather(1, top)
        lengths = cand_len.expand(B, K, V).reshape(B, K * V).gather(1, top)
        done = done.gather(1, beam) | (tok == eos)
        rows = (beam + torch.arange(B, device=dev)[:, None] * K).view(-1)   # (B*K,) parent row of each new beam
        tokens = torch.cat([tokens[rows], tok.view(-1, 1)], dim=1)
        cache = {"self": [(k[rows], v[rows]) for k, v in new_cache["self"]], "cross": new_cache["cross"]}
        step += 1
    best = (scores / gnmt_penalty(lengths, length_penalty)).argmax(-1)      # (B,)
    picked = tokens.view(B, K, -1)[torch.arange(B, device=dev), best, 1:]
    return [_strip(row, eos, pad) for row in picked.tolist()]


@torch.no_grad()
def hf_generate(model, src: torch.Tensor, *, bos: int, eos: int, pad: int, max_len: int, beam_size: int = 1,
                length_penalty: float = 0.6, synced: bool = False) -> list[list[int]]:
    """The same for a Hugging Face seq2seq model, by its own `generate` (greedy or its beam search, whose
    `length_penalty` divides by length ** alpha rather than GNMT's penalty). `synced` (transformers' `synced_gpus`):
    ranks sharing a sharded model (ZeRO-3, tensor parallel) step together, a finished rank making forward passes
    until every rank is done. A DeepSpeed engine is called through its module, whose hooks still gather."""
    module = getattr(model, "module", model)
    out = module.generate(input_ids=src, attention_mask=src != pad, num_beams=beam_size, do_sample=False,
                          length_penalty=length_penalty, max_new_tokens=max_len, decoder_start_token_id=bos,
                          eos_token_id=eos, pad_token_id=pad, synced_gpus=synced, use_cache=True)
    return [_strip(row, eos, pad) for row in out[:, 1:].tolist()]


def _allowed(scores: torch.Tensor, bos: int, pad: int) -> torch.Tensor:
    """(N, V) -> the same with begin and padding ruled out: a live hypothesis never emits them."""
    scores = scores.clone()
    scores[:, [bos, pad]] = float("-inf")
    return scores


def _strip(ids: list[int], eos: int, pad: int) -> list[int]:
    out = []
    for i in ids:
        if i == eos:
            break
        if i != pad:
            out.append(i)
    return out
