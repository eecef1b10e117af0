"""Training sequences (prompt + target response) in compact shards, and padded batches of them.

A shard is one safetensors file:

    tokens       int32 [total]    every sample's prompt and response ids, back to back
    offsets      int64 [n + 1]    sample i is tokens[offsets[i]:offsets[i + 1]]
    prompt_lens  int32 [n]        the first prompt_lens[i] ids are the prompt (no loss)
    problem_ids  int32 [n]        which source problem the sample answers (held-out splits go by problem)

plus string metadata (target name, sampling settings). The loss mask is derived: the response
positions, prompt_len .. len - 1.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SHARD_GLOB = "shard-*.safetensors"


def shard_path(root: str | os.PathLike, index: int) -> Path:
    return Path(root) / f"shard-{index:05d}.safetensors"


@dataclass
class TokenSamples:
    tokens: torch.Tensor  # int32 [total]
    offsets: torch.Tensor  # int64 [n + 1]
    prompt_lens: torch.Tensor  # int32 [n]
    problem_ids: torch.Tensor  # int32 [n]

    @classmethod
    def from_lists(cls, samples: list[tuple[list[int], list[int], int]]) -> "TokenSamples":
        """samples: (prompt ids, response ids, problem id) each."""
        flat = [t for prompt, response, _ in samples for t in (*prompt, *response)]
        lens = torch.tensor([len(p) + len(r) for p, r, _ in samples], dtype=torch.long)
        offsets = torch.zeros(len(samples) + 1, dtype=torch.long)
        offsets[1:] = lens.cumsum(0)
        return cls(torch.tensor(flat, dtype=torch.int32), offsets,
                   torch.tensor([len(p) for p, _, _ in samples], dtype=torch.int32),
                   torch.tensor([pid for _, _, pid in samples], dtype=torch.int32))

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        """(token ids int64 [len], prompt length) of sample i."""
        return self.tokens[self.offsets[i]:self.offsets[i + 1]].long(), int(self.prompt_lens[i])

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def subset(self, indices) -> "TokenSamples":
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        lengths = self.lengths[idx]
        offsets = torch.zeros(len(idx) + 1, dtype=torch.long)
        offsets[1:] = lengths.cumsum(0)
        tokens = torch.cat([self.tokens[self.offsets[i]:self.offsets[i + 1]] for i in idx.tolist()]) if len(idx) \
            else self.tokens[:0]
        return TokenSamples(tokens, offsets, self.prompt_lens[idx], self.problem_ids[idx])

    def split_by_problem(self, num_heldout_problems: int, seed: int = 0) -> tuple["TokenSamples", "TokenSamples"]:
        """(train, held-out): every sample of a held-out problem goes to held-out."""
        problems = self.problem_ids.unique()
        order = torch.randperm(len(problems), generator=torch.Generator().manual_seed(seed))
        is_heldout = torch.isin(self.problem_ids, problems[order[:num_heldout_problems]])
        return (self.subset(torch.nonzero(~is_heldout).flatten().tolist()),
                self.subset(torch.nonzero(is_heldout).flatten().tolist()))

    def save(self, path: str | os.PathLike, metadata: dict | None = None) -> None:
        """Atomic: a reader never sees a partly written shard."""
        path = Path(path)
        tmp = path.with_name(f".tmp-{path.name}")
        tensors = {"tokens": self.tokens, "offsets": self.offsets, "prompt_lens": self.prompt_lens,
                   "problem_ids": self.problem_ids}
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata={"specdec": json.dumps(metadata or {})})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TokenSamples":
        with safe_open(str(path), framework="pt") as f:
            return cls(*(f.get_tensor(k) for k in ("tokens", "offsets", "prompt_lens", "problem_ids")))


def shard_metadata(path: str | os.PathLike) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return json.loads((f.metadata() or {}).get("specdec", "{}"))


def load_samples(root: str | os.PathLike) -> TokenSamples:
    """Every finished shard under `root`, concatenated in shard order."""
    files = sorted(Path(root).glob(SHARD_GLOB))
    if not files:
        raise FileNotFoundError(f"no training shards ({SHARD_GLOB}) in {root}")
    parts = [TokenSamples.load(f) for f in files]
    starts = torch.tensor([0] + [len(p.tokens) for p in parts[:-1]]).cumsum(0)
    offsets = torch.cat([parts[0].offsets[:1]] + [p.offsets[1:] + s for p, s in zip(parts, starts)])
    return TokenSamples(torch.cat([p.tokens for p in parts]), offsets, torch.cat([p.prompt_lens for p in parts]),
                        torch.cat([p.problem_ids for p in parts]))


@dataclass
class Batch:
    input_ids: torch.Tensor  # int64 [B, L], right-padded with pad_id
    loss_mask: torch.Tensor  # bool [B, L]: response positions (never padding)
    lengths: torch.Tensor  # int64 [B]


def collate(samples: TokenSamples, indices, max_length: int, pad_id: int = 0, pad_multiple: int = 1) -> Batch:
    """Right-padded batch; sequences longer than max_length are cut (a causal target needs no
    attention mask for right padding: real positions never see later ones). The width is rounded
    up to pad_multiple so that few distinct shapes occur (kernel plans are cached per shape)."""
    rows = [samples[int(i)] for i in indices]
    lengths = torch.tensor([min(len(ids), max_length) for ids, _ in rows])
    width = -(-int(lengths.max()) // pad_multiple) * pad_multiple
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for r, ((ids, prompt_len), n) in enumerate(zip(rows, lengths.tolist())):
        input_ids[r, :n] = ids[:n]
        loss_mask[r, prompt_len:n] = True
    return Batch(input_ids, loss_mask, lengths)


def epoch_batches(lengths: torch.Tensor, batch_size: int, seed: int, epoch: int,
                  window_batches: int = 32) -> list[list[int]]:
    """The batches of one epoch, a pure function of (seed, epoch) so a resumed run continues the
    same order: shuffle, sort by length inside windows of `window_batches` batches (less padding),
    cut into batches, shuffle the batches."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=g)
    batches = []
    window = batch_size * window_batches
    for s in range(0, len(order), window):
        part = order[s:s + window]
        part = part[lengths[part].argsort(stable=True)]
        batches += [part[i:i + batch_size].tolist() for i in range(0, len(part), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
