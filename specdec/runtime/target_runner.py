"""Runs the target model: its KV cache, attention backend, static buffers and CUDA graphs.

Two kinds of forward, both appending K/V at each request's end (tables grow here):
- `forward(tables, token_ids, q_lens, ...)`: any number of new tokens per request (prompt prefill,
  probes); always eager.
- `run_block(tables, first_tokens, rest, q)`: exactly q new tokens per request (q = 1: decode, q =
  block_size: verify). A fixed shape: replayed from the CUDA graph of the next larger batch size when
  graphs are captured, else run eagerly through the same code (`_block_body`). With `prefill`
  (`PrefillChunks`), the step also carries prompt chunks: one eager forward over the block rows and
  the chunks (ragged queries), so an arrival never costs a forward of its own.

Block outputs live in static buffers shared by every batch size (logits in the model dtype, their
argmax, and the drafter's features): they stay valid until the next `run_block`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attention.batch_layout import BatchLayout, slots_on_device
from attention.page_pool import PageTable
from attention.transfer import upload
from specdec.models.decoder import CausalLM, ForwardOutput
from specdec.runtime.cuda_graphs import StaticInputs
from specdec.runtime.model_runner import FixedStep, ModelRunner


@dataclass
class BlockOutput:
    logits: torch.Tensor  # [B * q, vocab], model dtype
    greedy: torch.Tensor  # [B * q] int64: argmax of the logits
    features: torch.Tensor | None  # [B * q, len(feature_layers) * hidden]


@dataclass
class PrefillChunks:
    """Prompt chunks that ride along a block step, so that one forward runs both."""

    tables: list[PageTable]
    token_ids: torch.Tensor  # every chunk's tokens, flattened, on the device
    lens: list[int]
    logits_rows: np.ndarray  # rows (counted within the chunks) whose logits are wanted
    out: ForwardOutput | None = None  # set by the step: features of every chunk row, logits of logits_rows


class TargetRunner(ModelRunner):
    def __init__(self, model: CausalLM, *, backend_name: str, kv_dtype: torch.dtype, page_size: int,
                 max_batch: int, block_lens: tuple[int, ...], feature_layers: tuple[int, ...] = ()):
        dtype = model.model.embed_tokens.weight.dtype
        super().__init__(model, backend_name=backend_name, kv_dtype=kv_dtype, q_dtype=dtype, page_size=page_size,
                         max_batch=max_batch, device=next(model.parameters()).device)
        self.dtype = dtype
        self.feature_layers = feature_layers
        # static buffers of the fixed-shape steps, allocated before the KV pool is sized
        rows = max_batch * max(block_lens)
        self.inputs = {q: StaticInputs({"ids": max_batch * q, "starts": max_batch}, self.device) for q in block_lens}
        self.logits_out = torch.zeros(rows, model.config.vocab_size, dtype=dtype, device=self.device)
        self.greedy_out = torch.zeros(rows, dtype=torch.long, device=self.device)
        feature_dim = len(feature_layers) * model.config.hidden_size
        self.features_out = torch.zeros(rows, feature_dim, dtype=dtype, device=self.device) if feature_layers else None
        self.arange = torch.arange(rows, device=self.device)

    def fixed_steps(self) -> list[FixedStep]:
        """One step per block length q: q new tokens per request (q = 1 decode, q = block size verify)."""
        return [FixedStep(q, f"target q={q}",
                          lambda batch, scratch, q=q: BatchLayout.dummy(batch, q, q, self.page_size, scratch, True),
                          q, lambda batch, q=q: self._block_body(q, batch)) for q in self.inputs]

    # ---- forwards ----------------------------------------------------------------------------
    def forward(self, tables: list[PageTable], token_ids: torch.Tensor, q_lens: list[int], *,
                logits_rows: torch.Tensor | None, feature_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """q_lens[i] new tokens of request i (flattened in `token_ids`) at positions length.., causal."""
        starts = np.array([t.length for t in tables], dtype=np.int32)
        for table, n in zip(tables, q_lens):
            table.grow(n)
        layout = BatchLayout.for_tokens(q_lens, starts + np.asarray(q_lens, dtype=np.int32),
                                        [t.array for t in tables], self.page_size, causal=True)
        self.attn.plan(layout)
        positions = upload(layout.new_kv_positions().astype(np.int64), self.device)
        return self.model(token_ids, positions, self.kv, self.attn, logits_rows=logits_rows,
                          feature_layers=feature_layers)

    def run_block(self, tables: list[PageTable], first_tokens: list[int], rest: torch.Tensor | None,
                  q: int, prefill: PrefillChunks | None = None) -> BlockOutput:
        """Each request gets [first_tokens[i], *rest[i]] (rest: [B, q - 1] on the device, or None for q = 1).
        With `prefill`, its chunks run in the same forward (eagerly) and `prefill.out` is set."""
        if prefill is not None:
            return self._run_mixed(tables, first_tokens, rest, q, prefill)
        batch = len(tables)
        starts = np.array([t.length for t in tables], dtype=np.int64)
        for table in tables:
            table.grow(q)
        layout = BatchLayout.for_tokens([q] * batch, starts + q, [t.array for t in tables], self.page_size,
                                        causal=True)
        inputs = self.inputs[q]
        ids = np.zeros((batch, q), dtype=np.int64)
        ids[:, 0] = first_tokens
        inputs.fill("ids", ids)
        inputs.fill("starts", starts)

        def drafts_into_ids() -> None:  # the drafts are already on the device: no round trip
            inputs["ids"].view(-1, q)[:batch, 1:].copy_(rest)

        self.dispatch(q, batch, layout, inputs, lambda b: self._block_body(q, b),
                      after_upload=drafts_into_ids if rest is not None else None)
        n = batch * q
        features = self.features_out[:n] if self.features_out is not None else None
        return BlockOutput(self.logits_out[:n], self.greedy_out[:n], features)

    def _run_mixed(self, tables: list[PageTable], first_tokens: list[int], rest: torch.Tensor | None, q: int,
                   prefill: PrefillChunks) -> BlockOutput:
        """The block step and the prompt chunks in one eager forward (ragged queries, causal): block rows
        first, then the chunks. Block outputs land in the static buffers, as a block step's do."""
        n = len(tables) * q
        block_ids = upload(np.asarray(first_tokens, dtype=np.int64), self.device)[:, None]
        if rest is not None:
            block_ids = torch.cat([block_ids, rest], dim=1)
        rows = np.concatenate([np.arange(n), n + prefill.logits_rows]).astype(np.int64)
        out = self.forward([*tables, *prefill.tables], torch.cat([block_ids.reshape(-1), prefill.token_ids]),
                           [q] * len(tables) + prefill.lens, logits_rows=upload(rows, self.device),
                           feature_layers=self.feature_layers)
        self.logits_out[:n].copy_(out.logits[:n])
        torch.argmax(self.logits_out[:n], dim=-1, out=self.greedy_out[:n])
        features = None
        if self.features_out is not None:
            features = self.features_out[:n]
            features.copy_(out.features[:n])
        prefill.out = ForwardOutput(out.logits[n:], out.features[n:] if out.features is not None else None)
        return BlockOutput(self.logits_out[:n], self.greedy_out[:n], features)

    def _block_body(self, q: int, batch: int) -> None:
        """The fixed-shape step: reads static inputs and the planned page metadata, writes static outputs."""
        n, inputs = batch * q, self.inputs[q]
        positions = (inputs["starts"][:batch, None] + self.arange[:q]).reshape(-1)
        requests = self.arange[:batch].repeat_interleave(q)
        self.attn.set_write_slots(*slots_on_device(self.attn.kv_indices, self.attn.kv_indptr, requests, positions,
                                                   self.page_size))
        out = self.model(inputs["ids"][:n], positions, self.kv, self.attn, logits_rows=slice(None),
                         feature_layers=self.feature_layers, logits_out=self.logits_out[:n])
        torch.argmax(out.logits, dim=-1, out=self.greedy_out[:n])
        if self.features_out is not None:
            self.features_out[:n].copy_(out.features)
