"""Training sequences (prompt + target response) in compact shards, and padded batches of them.

A shard is one safetensors file:

    tokens       int32 [total]    every sample's prompt and response ids, back to back
    offsets      int64 [n + 1]    sample i is tokens[offsets[i]:offsets[i + 1]]
    prompt_lens  int32 [n]        the first prompt_lens[i] ids are the prompt (no loss)
    problem_ids  int32 [n]        which source problem the sample answers (held-out splits go by problem)
    domain_ids   int32 [n]        the sample's domain: an index into the metadata's "domains" names

plus string metadata (target name, sampling settings, domain names). The loss mask is derived: the
response positions, prompt_len .. len - 1. Shards written before domains were stored have no
`domain_ids`: their samples are all answers to MATH problems (DEFAULT_DOMAIN).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SHARD_GLOB = "shard-*.safetensors"
DEFAULT_DOMAIN = "math"  # of samples stored without a domain


def heldout_key(prompt_ids: list[int], seed: int) -> float:
    """Where a prompt falls in [0, 1) for the held-out choice: a hash of (seed, its token ids), so the
    same prompt gets the same key in every run, whatever list, order or recipe it came in."""
    digest = hashlib.blake2b(f"{seed}:{','.join(map(str, prompt_ids))}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0 ** 64


def shard_path(root: str | os.PathLike, index: int) -> Path:
    return Path(root) / f"shard-{index:05d}.safetensors"


@dataclass
class TokenSamples:
    tokens: torch.Tensor  # int32 [total]
    offsets: torch.Tensor  # int64 [n + 1]
    prompt_lens: torch.Tensor  # int32 [n]
    problem_ids: torch.Tensor  # int32 [n]
    domain_ids: torch.Tensor  # int32 [n], indices into `domains`
    domains: tuple[str, ...] = (DEFAULT_DOMAIN,)

    @classmethod
    def from_lists(cls, samples: list[tuple[list[int], list[int], int]],
                   domains: list[str] | None = None) -> "TokenSamples":
        """samples: (prompt ids, response ids, problem id) each; domains: each sample's (default: DEFAULT_DOMAIN)."""
        flat = [t for prompt, response, _ in samples for t in (*prompt, *response)]
        lens = torch.tensor([len(p) + len(r) for p, r, _ in samples], dtype=torch.long)
        offsets = torch.zeros(len(samples) + 1, dtype=torch.long)
        offsets[1:] = lens.cumsum(0)
        domains = [DEFAULT_DOMAIN] * len(samples) if domains is None else domains
        names = tuple(dict.fromkeys(domains)) or (DEFAULT_DOMAIN,)
        index = {name: i for i, name in enumerate(names)}
        return cls(torch.tensor(flat, dtype=torch.int32), offsets,
                   torch.tensor([len(p) for p, _, _ in samples], dtype=torch.int32),
                   torch.tensor([pid for _, _, pid in samples], dtype=torch.int32),
                   torch.tensor([index[d] for d in domains], dtype=torch.int32), names)

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
        return TokenSamples(tokens, offsets, self.prompt_lens[idx], self.problem_ids[idx], self.domain_ids[idx],
                            self.domains)

    def domain_indices(self) -> dict[str, list[int]]:
        """Sample indices of each domain present, domains in name order."""
        return {name: torch.nonzero(self.domain_ids == i).flatten().tolist()
                for i, name in sorted(enumerate(self.domains), key=lambda item: item[1])
                if bool((self.domain_ids == i).any())}

    def by_domain(self) -> dict[str, "TokenSamples"]:
        return {name: self.subset(indices) for name, indices in self.domain_indices().items()}

    def with_domain_repeats(self, repeats: dict[str, int]) -> "TokenSamples":
        """These samples with each one of domain d appearing repeats[d] times (once where d is not given): a
        domain's integer weight in every epoch, e.g. to keep a drafter trained further on mostly code from
        forgetting math. Apply it to the training split only, so that no held-out sample is scored twice."""
        if not repeats:  # the common case: no copy of every sample
            return self
        present = self.domain_indices()
        unknown = sorted(set(repeats) - set(present))
        if unknown:
            raise ValueError(f"no samples of domain {', '.join(unknown)} to repeat; the data holds "
                             f"{', '.join(present) or 'no samples'}")
        bad = {name: n for name, n in repeats.items() if not isinstance(n, int) or n < 1}
        if bad:
            raise ValueError(f"domain repeats must be whole numbers >= 1, got {bad}")
        times = torch.ones(len(self.domains), dtype=torch.long)
        for name, n in repeats.items():
            times[self.domains.index(name)] = n
        return self.subset(torch.arange(len(self)).repeat_interleave(times[self.domain_ids.long()]))

    def prompt_ids(self, i: int) -> list[int]:
        return self.tokens[self.offsets[i]:self.offsets[i] + self.prompt_lens[i]].tolist()

    def split_held_out(self, fraction: float, seed: int = 0) -> tuple["TokenSamples", "TokenSamples"]:
        """(train, held-out): a sample is held out when its prompt's key (`heldout_key`) is below
        `fraction`, so every answer to a prompt lands on the same side, and a prompt is held out in
        every data set that contains it: a run that starts from a drafter trained on other data (a
        shipped one, another recipe or seed over the same sources) is never scored on prompts that
        drafter was trained on, as long as both runs used the same fraction and seed."""
        if not 0 <= fraction < 1:
            raise ValueError(f"the held-out fraction must be in [0, 1), got {fraction}")
        held = [heldout_key(self.prompt_ids(i), seed) < fraction for i in range(len(self))]
        return (self.subset([i for i, h in enumerate(held) if not h]),
                self.subset([i for i, h in enumerate(held) if h]))

    def save(self, path: str | os.PathLike, metadata: dict | None = None) -> None:
        """Atomic: a reader never sees a partly written shard."""
        path = Path(path)
        tmp = path.with_name(f".tmp-{path.name}")
        tensors = {"tokens": self.tokens, "offsets": self.offsets, "prompt_lens": self.prompt_lens,
                   "problem_ids": self.problem_ids, "domain_ids": self.domain_ids}
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata={"specdec": json.dumps({**(metadata or {}), "domains": list(self.domains)})})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TokenSamples":
        with safe_open(str(path), framework="pt") as f:
            tensors = [f.get_tensor(k) for k in ("tokens", "offsets", "prompt_lens", "problem_ids")]
            if "domain_ids" not in f.keys():  # written before domains were stored
                return cls(*tensors, torch.zeros_like(tensors[3]), (DEFAULT_DOMAIN,))
            domains = json.loads(f.metadata()["specdec"])["domains"]
            return cls(*tensors, f.get_tensor("domain_ids"), tuple(domains))


def shard_metadata(path: str | os.PathLike) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return json.loads((f.metadata() or {}).get("specdec", "{}"))


def load_samples(*roots: str | os.PathLike) -> TokenSamples:
    """Every finished shard under each root (e.g. data generated on different days from different
    prompt lists), concatenated root by root in shard order."""
    if not roots:
        raise ValueError("load_samples needs at least one directory of training shards")
    files = []
    for root in roots:
        found = sorted(Path(root).glob(SHARD_GLOB))
        if not found:
            raise FileNotFoundError(f"no training shards ({SHARD_GLOB}) in {root}")
        files += found
    parts = [TokenSamples.load(f) for f in files]
    starts = torch.tensor([0] + [len(p.tokens) for p in parts[:-1]]).cumsum(0)
    offsets = torch.cat([parts[0].offsets[:1]] + [p.offsets[1:] + s for p, s in zip(parts, starts)])
    domains = tuple(dict.fromkeys(name for p in parts for name in p.domains))  # shards may list them in any order
    domain_ids = torch.cat([torch.tensor([domains.index(name) for name in p.domains], dtype=torch.int32)[
        p.domain_ids.long()] for p in parts])
    return TokenSamples(torch.cat([p.tokens for p in parts]), offsets, torch.cat([p.prompt_lens for p in parts]),
                        torch.cat([p.problem_ids for p in parts]), domain_ids, domains)


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
