"""What one forward step looks like to attention: per-request query and KV lengths and pages.

Every request i in the step writes K/V for `new_kv_lens[i]` tokens, which are the last tokens
of its KV (positions kv_lens[i] - new_kv_lens[i] .. kv_lens[i] - 1), and asks `q_lens[i]`
queries, which are the last q_lens[i] of those new tokens. A target forward has
new_kv_lens == q_lens; a DFlash draft step also writes context K/V that have no query.

Causal alignment is bottom-right: query j of request i sees KV positions
<= kv_lens[i] - q_lens[i] + j. With causal=False every query sees the request's whole KV.

Flattened tensors (queries, new K/V) are ordered request by request. All per-request and per-page
arrays are numpy int32, built with vectorized operations: no Python work per token or page.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from attention.transfer import upload


def _int32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


@dataclass(frozen=True, eq=False)
class BatchLayout:
    q_lens: np.ndarray  # [B]
    kv_lens: np.ndarray  # [B]
    new_kv_lens: np.ndarray  # [B]
    kv_indices: np.ndarray  # [sum of pages used]: every request's used pages, request by request
    page_size: int
    causal: bool
    # [B, max_q, max_q] bool tensor (on any device), with causal=True: which of its request's new rows each
    # query sees (a token tree: the node's ancestors and itself; the request's earlier KV stays visible);
    # None = causal order
    query_masks: torch.Tensor | None = None
    # how many of the step's requests, the last ones, are prompt chunks rather than decodes or verifies (a backend
    # may pick its kernels by it)
    prompts: int = 0
    # a lone request's KV length at most, over its whole life (its page table's `expected_length`; 0: unknown): a
    # backend may split its KV into chunks sized by it, the same at every step (see `query_rows`)
    expected_kv_len: int = 0
    # the query masks already packed as `pack_tree_masks` packs them, for at least batch_size requests (made where the
    # masks are, e.g. in the CUDA graph that builds the trees); None: packed when asked for
    packed_masks: torch.Tensor | None = None
    # with query masks of a lone request whose shape the host knows (a tree whose nodes form one chain): each row's
    # depth, row i's i (False: the shape is on the device only)
    chain_masks: bool = False

    @classmethod
    def build(cls, q_lens, kv_lens, new_kv_lens, page_tables, page_size: int, causal: bool,
              expected_kv_len: int = 0) -> "BatchLayout":
        """page_tables[i]: request i's pages (a list or an int array); only the used ones are kept."""
        q, kv, new = _int32(q_lens), _int32(kv_lens), _int32(new_kv_lens)
        if not (len(q) == len(kv) == len(new) == len(page_tables)):
            raise ValueError("q_lens, kv_lens, new_kv_lens and page_tables must have one entry per request")
        if not ((0 < q) & (q <= new) & (new <= kv)).all():
            raise ValueError(f"need 0 < q_len <= new_kv_len <= kv_len, got {q}, {new}, {kv}")
        used = -(-kv // page_size)
        # one pass over the tables (a step of 256 requests builds two layouts on the host's path between verifies):
        # a table too short gives a shorter slice, so the pages taken fall short of the pages used
        indices = (np.concatenate([t[:n] for t, n in zip(page_tables, used.tolist())], dtype=np.int32)
                   if len(q) else _int32([]))
        if len(indices) != used.sum():
            raise ValueError(f"page tables too short for KV lengths {kv.tolist()} with pages of {page_size}")
        return cls(q, kv, new, indices, page_size, causal, expected_kv_len=expected_kv_len)

    def with_query_masks(self, masks: torch.Tensor, packed: torch.Tensor | None = None,
                         chain: bool = False) -> "BatchLayout":
        """The same step with each query seeing only the new rows `masks` allows (see `query_masks`); `packed`: the
        same masks packed (`packed_masks`), if already made; `chain`: the masks are known to be causal order (see
        `chain_masks`)."""
        q = int(self.q_lens.max())
        if (not self.causal or tuple(masks.shape) != (self.batch_size, q, q) or masks.dtype != torch.bool
                or (self.q_lens != self.new_kv_lens).any()):
            raise ValueError(f"query masks need a causal layout whose new rows all have queries, and a bool "
                             f"mask of shape {(self.batch_size, q, q)}; got {masks.dtype} {tuple(masks.shape)}")
        return replace(self, query_masks=masks, packed_masks=packed, chain_masks=chain)

    def tree_context(self) -> "BatchLayout":
        """A token-tree step's context part: the same queries, each seeing all of its request's KV before the
        step's new rows, in no causal order (the tree part, the new rows under the query masks, is attended
        separately and merged; see `FlashInferBackend`). Its pages are each request's first ones. A request
        with no earlier KV (a capture's dummy layout, a graph rung's padding; a real tree step always follows
        committed tokens) keeps its first slot, so that every request has some KV: its rows are never used."""
        context = np.maximum(self.kv_lens - self.new_kv_lens, 1).astype(np.int32)
        pages, kept = self.pages_used(), -(-context // self.page_size)
        entry_in_request = np.arange(len(self.kv_indices)) - np.repeat(np.cumsum(pages) - pages, pages)
        indices = self.kv_indices[entry_in_request < np.repeat(kept, pages)]
        return BatchLayout(self.q_lens, context, np.zeros_like(self.q_lens), indices, self.page_size, causal=False,
                           prompts=self.prompts)

    def packed_tree_masks(self) -> torch.Tensor:
        """The query masks as FlashInfer's custom mask of the tree part alone (`pack_tree_masks`)."""
        batch, n, _ = self.query_masks.shape
        if self.packed_masks is not None and len(self.packed_masks) >= batch * n * n:
            return self.packed_masks[:batch * n * n]
        return pack_tree_masks(self.query_masks)

    def query_rows(self, split_pages: int, padding_page: int) -> "BatchLayout":
        """A lone request's causal step as one request per query, in no causal order: query j sees the KV
        positions up to its own, kv_len - q_len + j, over the request's first pages. Then one request with no
        query whose KV (`padding_page` 2 x `split_pages` times) spans two KV chunks of `split_pages` pages:
        FlashInfer splits the KV of every such plan into chunks and merges them, as the graph captured with
        it does, though the request adds no work. A decode (one query) and a verify of the same request at
        the same position then give that position's row the same kernel, KV and chunks: the same bits."""
        q, kv = int(self.q_lens[0]), int(self.kv_lens[0])
        if self.batch_size != 1 or not self.causal or self.query_masks is not None:
            raise ValueError("query rows are for one request's causal step without query masks")
        lens = (kv - q + 1 + np.arange(q)).astype(np.int32)
        pages = -(-lens // self.page_size)
        indices = np.concatenate([self.kv_indices[:n] for n in pages.tolist()]
                                 + [np.full(2 * split_pages, padding_page, dtype=np.int32)])
        return BatchLayout(np.append(np.ones(q, np.int32), 0).astype(np.int32),
                           np.append(lens, 2 * split_pages * self.page_size).astype(np.int32),
                           np.zeros(q + 1, np.int32), indices.astype(np.int32), self.page_size, causal=False)

    @classmethod
    def for_tokens(cls, q_lens, kv_lens, page_tables, page_size: int, causal: bool,
                   expected_kv_len: int = 0) -> "BatchLayout":
        """A layout where every new token also has a query (prefill, verify, decode)."""
        return cls.build(q_lens, kv_lens, q_lens, page_tables, page_size, causal, expected_kv_len)

    @classmethod
    def dummy(cls, batch_size: int, q_len: int, kv_len: int, page_size: int, scratch_page: int,
              causal: bool) -> "BatchLayout":
        """Padding requests only, on the scratch page (what a CUDA graph is captured with)."""
        pages = [[scratch_page] * -(-kv_len // page_size)] * batch_size
        return cls.build([q_len] * batch_size, [kv_len] * batch_size, [q_len] * batch_size, pages, page_size, causal)

    def padded(self, batch_size: int, scratch_page: int) -> "BatchLayout":
        """The same step padded with dummy requests up to `batch_size` (a CUDA-graph rung): each dummy
        has this layout's largest q_len / new_kv_len, KV of that length, and only the scratch page."""
        extra = batch_size - self.batch_size
        if extra <= 0:
            return self
        q, new = int(self.q_lens.max()), int(self.new_kv_lens.max())
        dummy_pages = -(-new // self.page_size)
        pad = lambda a, v: np.concatenate([a, np.full(extra, v, dtype=np.int32)])  # noqa: E731
        indices = np.concatenate([self.kv_indices, np.full(extra * dummy_pages, scratch_page, dtype=np.int32)])
        masks = self.query_masks
        if masks is not None:  # a dummy's queries see in causal order
            dummy = torch.ones(q, q, dtype=torch.bool, device=masks.device).tril()
            masks = torch.cat([masks, dummy.expand(extra, q, q)])
        # packed masks made for the padded size keep serving it (a padding request's rows are never read)
        packed = self.packed_masks if self.packed_masks is not None and len(self.packed_masks) >= batch_size * q * q \
            else None
        return BatchLayout(pad(self.q_lens, q), pad(self.kv_lens, new), pad(self.new_kv_lens, new), indices,
                           self.page_size, self.causal, masks, self.prompts, packed_masks=packed)

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def num_queries(self) -> int:
        return int(self.q_lens.sum())

    @property
    def num_new_kv(self) -> int:
        return int(self.new_kv_lens.sum())

    def pages_used(self) -> np.ndarray:
        return -(-self.kv_lens // self.page_size)

    def qo_indptr(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.q_lens)]).astype(np.int32)

    def kv_indptr(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.pages_used())]).astype(np.int32)

    def last_page_lens(self) -> np.ndarray:
        return (self.kv_lens - 1) % self.page_size + 1

    def new_kv_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(request index, in-sequence position) of every written token, flattened."""
        requests = np.repeat(np.arange(self.batch_size, dtype=np.int32), self.new_kv_lens)
        starts = np.repeat(self.kv_lens - self.new_kv_lens, self.new_kv_lens)
        offsets = np.arange(len(requests), dtype=np.int32) - np.repeat(
            np.cumsum(self.new_kv_lens) - self.new_kv_lens, self.new_kv_lens)
        return requests, (starts + offsets).astype(np.int32)

    def new_kv_positions(self) -> np.ndarray:
        return self.new_kv_rows()[1]

    def new_kv_places(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(position, page, offset) of every written token, flattened, on the host."""
        requests, positions = self.new_kv_rows()
        pages = self.kv_indices[self.kv_indptr()[requests] + positions // self.page_size]
        return positions, pages, positions % self.page_size

    def new_kv_slots(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, offset) of every written token, flattened, as int64 tensors on `device`."""
        _, pages, offsets = self.new_kv_places()
        return upload(pages.astype(np.int64), device), upload(offsets.astype(np.int64), device)


def pack_tree_masks(masks: torch.Tensor) -> torch.Tensor:
    """Query masks [B, n, n] (each request's new rows against its new rows, every request the same size n) as
    FlashInfer's custom mask of a token tree's tree part: request i's n x n bits, row-major, bit order little, from
    byte i * n * n. That byte is the request's *bit* offset: FlashInfer, handed packed bits, derives each request's
    start from the lengths as the sum of q_j * kv_j before it and reads it as a byte offset, so each request's bytes
    sit there (8x what the bits need; a tree is small). A few tensor operations on the masks' device, the same
    whatever the tree: no host work grows with it, none waits for the GPU, and a CUDA graph can capture them."""
    batch, n, _ = masks.shape
    bits = masks.reshape(batch, n * n)
    if (n * n) % 8:
        bits = torch.nn.functional.pad(bits, (0, 8 - (n * n) % 8))
    weights = 2 ** torch.arange(8, dtype=torch.int32, device=masks.device)  # made on the device: no host copy
    packed = (bits.view(batch, -1, 8).int() * weights).sum(dim=2).to(torch.uint8)
    out = torch.zeros(batch, n * n, dtype=torch.uint8, device=masks.device)
    out[:, :packed.shape[1]] = packed
    return out.view(-1)


def write_real_page_metadata(kv_indptr: torch.Tensor, last_page_len: torch.Tensor, kv_indices: torch.Tensor,
                             kv_lens: torch.Tensor, page_size: int) -> None:
    """`real_page_metadata` written over the planned buffers in place."""
    real = real_page_metadata(kv_indptr, last_page_len, kv_indices, kv_lens, page_size)
    for buffer, values in zip((kv_indptr, last_page_len, kv_indices), real):
        buffer.copy_(values)


def write_query_row_metadata(kv_indptr: torch.Tensor, last_page_len: torch.Tensor, kv_indices: torch.Tensor,
                             kv_len: torch.Tensor, q: int, page_size: int) -> None:
    """A lone request's query-rows plan made at a longer length, rewritten for its real one (`kv_len`, after the
    step): each of the q rows' KV up to its own position."""
    rows = kv_len - q + 1 + torch.arange(q, device=kv_len.device)
    write_real_page_metadata(kv_indptr, last_page_len, kv_indices, _with_padding_request(rows), page_size)


def write_node_row_metadata(kv_indptr: torch.Tensor, last_page_len: torch.Tensor, kv_indices: torch.Tensor,
                            context: torch.Tensor, depths: torch.Tensor, page_size: int) -> None:
    """A lone tree's node-rows plan made at the deepest node's length, rewritten for each node's own: the context,
    the anchor, then the node's path."""
    write_real_page_metadata(kv_indptr, last_page_len, kv_indices, _with_padding_request(context + 1 + depths),
                             page_size)


def _with_padding_request(lengths: torch.Tensor) -> torch.Tensor:
    """A lone request's rows' KV lengths, then the padding request's, which keeps its planned length."""
    return torch.cat([lengths, lengths.new_full((1,), 1 << 30)])


def slots_on_device(kv_indices: torch.Tensor, kv_indptr: torch.Tensor, requests: torch.Tensor,
                    positions: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, offset) of tokens given as (request index, position) from a step's page metadata, computed
    on the GPU (no host work per token); page-table entries past a request's pages are never read."""
    pages = kv_indices[kv_indptr[requests].long() + torch.div(positions, page_size, rounding_mode="floor")]
    return pages.long(), (positions % page_size).long()


def real_page_metadata(kv_indptr: torch.Tensor, last_page_len: torch.Tensor, kv_indices: torch.Tensor,
                       kv_lens: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Page metadata planned for upper bounds of the KV lengths -> the metadata of the real lengths `kv_lens`
    [B] (each request keeps its first pages up to min(real, planned) tokens; page indices past the last request's
    are 0), as (kv_indptr, last_page_len, kv_indices) of the same sizes and dtypes. Tensor operations only, of
    fixed shapes: no host sync, so a CUDA graph can capture them."""
    indptr = kv_indptr.long()
    batch = len(last_page_len)
    planned = (indptr[1:] - indptr[:-1] - 1) * page_size + last_page_len.long()
    lengths = torch.minimum(kv_lens[:batch].long(), planned).clamp(min=1)
    pages = torch.div(lengths + page_size - 1, page_size, rounding_mode="floor")
    real_indptr = torch.cat([indptr[:1], pages.cumsum(0)])
    entry = torch.arange(len(kv_indices), device=kv_indices.device)  # every entry of the page-index buffer
    request = (torch.searchsorted(real_indptr, entry, right=True) - 1).clamp(0, batch - 1)
    source = (indptr[request] + entry - real_indptr[request]).clamp(max=len(kv_indices) - 1)
    indices = torch.where(entry < real_indptr[-1], kv_indices[source], 0)
    return (real_indptr.to(kv_indptr.dtype), ((lengths - 1) % page_size + 1).to(last_page_len.dtype),
            indices.to(kv_indices.dtype))
