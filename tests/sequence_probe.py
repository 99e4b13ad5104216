"""Run by tests/test_sequence.py: every model of the harness, with each sequence split over 2 processes (gloo) by
`distributed.sequence.Ulysses`, against the same model in one process. Per case, on rank 0, one JSON line: the
largest difference of the summed loss, of the outputs (eval mode), and of the gradients (each rank's gradient summed
over the ranks, as DeepSpeed does over the sequence ranks), relative to the largest value (of all parameters
together: a key projection's bias has a gradient of zero up to rounding, softmax being blind to it)."""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from harness.distributed.sequence import Ulysses  # noqa: E402
from harness.models import sequence  # noqa: E402
from harness.models.encoder import Encoder  # noqa: E402
from harness.models.patch import PatchConfig, PatchTST  # noqa: E402
from harness.models.seq2seq import Seq2Seq, Seq2SeqConfig  # noqa: E402
from harness.models.transformer import TransformerConfig, TransformerLM  # noqa: E402

IGNORE, PAD = -100, 0


class Case:
    """A model, a batch, how the batch splits (as a task's sequence_split and pad_values) and the summed loss."""

    def __init__(self, model, batch, split, pads, inputs, loss):
        self.model, self.batch, self.split, self.pads, self.inputs, self.loss = model, batch, split, pads, inputs, loss

    def sequence_split(self, batch):
        return self.split

    def pad_values(self):
        return self.pads


def padded(lengths, width, vocab, g):
    ids = torch.randint(1, vocab, (len(lengths), width), generator=g)
    for i, n in enumerate(lengths):
        ids[i, n:] = PAD
    return ids


def cases() -> dict[str, Case]:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    out = {}
    cfg = TransformerConfig(vocab_size=40, max_seq_len=16, d_model=16, n_layers=2, n_heads=4, d_ff=32)
    ids = torch.randint(0, 40, (3, 17), generator=g)
    out["lm"] = Case(TransformerLM(cfg), {"inputs": ids[:, :-1], "targets": ids[:, 1:]},
                     {"inputs": "positions", "targets": "positions"}, {},
                     lambda b: (b["inputs"],),
                     lambda y, b: F.cross_entropy(y.flatten(0, 1), b["targets"].flatten(), reduction="sum"))
    # encoder: 13 positions, as many as its position table (padded to 14 to split: past the table), sequences of
    # unequal length
    ids = padded([13, 9, 4], 13, 40, g)
    mask = ids != PAD
    targets = torch.where(mask & (torch.rand(ids.shape, generator=g) < 0.5), ids, torch.full_like(ids, IGNORE))
    pads = {"ids": PAD, "mask": False, "targets": IGNORE}
    split = {"ids": "positions", "mask": "positions", "targets": "positions", "labels": "rows", "values": "rows"}
    enc = TransformerConfig(vocab_size=40, max_seq_len=13, d_model=16, n_layers=2, n_heads=4, d_ff=32)
    out["protein mlm"] = Case(Encoder(enc, "mlm", 40), {"ids": ids, "mask": mask, "targets": targets}, split, pads,
                              lambda b: (b["ids"], b["mask"]),
                              lambda y, b: F.cross_entropy(y.flatten(0, 1), b["targets"].flatten(), reduction="sum"))
    values = torch.randn(3, generator=g)
    ridge = Encoder(enc, "regress", 1, pooling="attention", ridge=True)
    with torch.no_grad():
        ridge.ridge_table.normal_(generator=g)
        ridge.ridge_mix.fill_(0.3)
    out["protein regress, attention pooling, ridge"] = Case(
        ridge, {"ids": ids, "mask": mask, "values": values}, split, pads, lambda b: (b["ids"], b["mask"]),
        lambda y, b: F.mse_loss(y.squeeze(-1), b["values"], reduction="sum"))
    labels = torch.tensor([0, 2, 1])
    out["protein classify"] = Case(Encoder(enc, "classify", 3), {"ids": ids, "mask": mask, "labels": labels}, split,
                                   pads, lambda b: (b["ids"], b["mask"]),
                                   lambda y, b: F.cross_entropy(y, b["labels"], reduction="sum"))
    # translation: source and target of different lengths, both padded
    src, tgt = padded([11, 7, 3], 11, 30, g), padded([10, 6, 8], 10, 30, g)
    out["translation"] = Case(
        Seq2Seq(Seq2SeqConfig(vocab_size=30, d_model=16, n_layers=2, n_heads=4, d_ff=32, dropout=0.0)),
        {"src": src, "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:]},
        {"src": "positions", "tgt_in": "positions", "tgt_out": "positions"},
        {"src": PAD, "tgt_in": PAD, "tgt_out": PAD}, lambda b: (b["src"], b["tgt_in"], b["tgt_out"] != PAD),
        lambda y, b: F.cross_entropy(y.flatten(0, 1), b["tgt_out"].flatten(), ignore_index=PAD, reduction="sum"))
    patch = PatchTST(PatchConfig(lookback=32, horizon=8, patch_len=8, stride=4, d_model=16, n_layers=2, n_heads=4,
                                 d_ff=32))
    torch.nn.init.normal_(patch.head.proj.weight, std=0.02)  # zero at init: its gradient would be the only one
    out["prices"] = Case(patch, {"x": torch.randn(3, 32, 2, generator=g), "y": torch.randn(3, 8, 2, generator=g)},
                         {"y": "rows"}, {}, lambda b: (b["x"],), lambda y, b: (y - b["y"]).pow(2).sum())
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def main() -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)  # its all-to-all runs on its comm
    rank, size = dist.get_rank(), dist.get_world_size()
    split = Ulysses(dist.group.WORLD, rank, size, zero_stage=0)
    for name, case in cases().items():
        compare(name, case, split, rank, size)
    # the probe can fail: a naive split, where every rank numbers its positions from 0
    offset, sequence.offset = sequence.offset, lambda local_len: 0
    compare("lm, positions from 0 on every rank", cases()["lm"], split, rank, size)
    sequence.offset = offset
    dist.destroy_process_group()


def compare(name: str, case: Case, split: Ulysses, rank: int, size: int) -> None:
    """One case split over the ranks against one process: rank 0 prints the largest relative differences."""
    model = case.model
    ref_loss = case.loss(model(*case.inputs(case.batch)), case.batch)
    ref_grads = torch.autograd.grad(ref_loss, list(model.parameters()))
    local = split.batch(case, case.batch)
    with sequence.split_over(split):
        loss = case.loss(model(*case.inputs(local)), local)
        grads = torch.autograd.grad(loss, list(model.parameters()))
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = [g.clone() for g in grads]
    for g in grads:
        dist.all_reduce(g)
    model.eval()  # outputs: every rank's positions (or rows) joined, against one process's
    ref_out = model(*case.inputs(case.batch))
    with torch.no_grad(), sequence.split_over(split):
        mine = model(*case.inputs(local))
    how = "rows" if ref_out.shape[0] != mine.shape[0] or ref_out.dim() == 2 else "positions"
    parts = [None] * size
    dist.all_gather_object(parts, mine)
    joined = torch.cat(parts, 0 if how == "rows" else 1)[:, :ref_out.shape[1]] if how == "positions" else \
        torch.cat(parts, 0)
    if rank == 0:
        flat = torch.cat([g.flatten() for g in grads]), torch.cat([r.flatten() for r in ref_grads])
        print(json.dumps({"case": name, "loss": rel(total, ref_loss.detach()),
                          "outputs": rel(joined, ref_out.detach()), "grad": rel(*flat)}), flush=True)


if __name__ == "__main__":
    main()
