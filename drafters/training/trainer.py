"""Training loop: AdamW with warmup + cosine, gradient clipping, bf16 autocast on CUDA, periodic
held-out acceptance estimates, and atomic checkpoints for runs split into short calls.

Everything random is a pure function of (seed, step) or (seed, epoch): the anchors of step s come
from a generator seeded with s, the batch order of an epoch from one seeded with the epoch. A run
resumed from its checkpoint therefore takes exactly the steps an uninterrupted run would.

Log: `<out_dir>/log.jsonl`, one line per evaluation: step, loss (mean training loss since the
last line), train_tau, eval_loss and tau_estimate (held-out loss and greedy acceptance length over
the anchors at the first `eval_anchors_per_seq` response positions of every held-out sequence),
decode_tau_estimate (the per-sequence mean acceptance length greedy decoding would see there, each
block starting where the last one's accepted tokens end: what `eval.*` measure as tau), domains
({domain: {eval_loss, tau_estimate, decode_tau_estimate, sequences}}, each domain's own), lr, epoch,
elapsed_s.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from dataclasses import asdict, astuple, dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from drafters.dflash_model import DFlashDraftModel
from drafters.training.anchors import (Anchors, acceptance_lengths, block_input_ids, block_labels, decoding_walk,
                                       first_anchors, sample_anchors, sample_block_sizes)
from drafters.training.checkpoint import (config_to_json, load_checkpoint, restore_rng, rng_state,
                                          save_checkpoint)
from drafters.training.data import TokenSamples, collate, epoch_batches
from drafters.training.forward import BlockLoss, block_hidden, block_loss
from drafters.training.quant_aware import check_storage, make_quant_aware
from drafters.training.target import FrozenTarget

LOG_FILE = "log.jsonl"
PAD_MULTIPLE = 64  # batch widths are rounded up to this: few distinct shapes, cached kernel plans


@dataclass(frozen=True)
class TrainConfig:
    out_dir: str
    max_steps: int = 2000
    batch_size: int = 8  # sequences per step
    anchors_per_seq: int = 256
    max_length: int = 2048  # longer sequences are cut
    gamma: float = 7.0  # loss weight decay over the block
    lr: float = 6e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.01
    warmup_frac: float = 0.04
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    loss_chunk: int = 2048  # rows of logits per cross-entropy chunk
    seed: int = 0
    save_every: int = 200
    eval_every: int = 200
    eval_sequences: int = 64  # held-out sequences of each domain per evaluation
    eval_anchors_per_seq: int = 256  # every anchor among the first this many response positions
    time_budget_s: float | None = None  # stop (and checkpoint) before this much wall time has passed
    quant_aware: str | None = None  # a weight storage the drafter trains in (drafters.training.quant_aware)
    # block sizes to train besides the whole block, each block's drawn uniformly from these and the whole one
    # (`anchors.sample_block_sizes`); the drafter then declares them, and the engine runs the shortest that holds a
    # step's drafts (`DFlashSpec.block_sizes`). (): whole blocks only
    block_sizes: tuple[int, ...] = ()

    def __post_init__(self):
        if min(self.max_steps, self.batch_size, self.anchors_per_seq, self.max_length, self.loss_chunk) < 1:
            raise ValueError("max_steps, batch_size, anchors_per_seq, max_length and loss_chunk must be positive")
        if not 0 <= self.warmup_frac < 1 or self.lr <= 0 or self.gamma <= 0:
            raise ValueError("warmup_frac must be in [0, 1), lr and gamma positive")
        if self.quant_aware is not None:
            check_storage(self.quant_aware)


def lr_factor(step: int, max_steps: int, warmup_frac: float, min_ratio: float) -> float:
    """Linear warmup over warmup_frac of the run, then cosine down to min_ratio."""
    warmup = max(1, round(warmup_frac * max_steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class HeldOutScore:
    """Sums over held-out blocks; `summary` gives the logged means."""
    weighted_ce: float = 0.0
    weight: float = 0.0
    tau_sum: float = 0.0
    blocks: int = 0  # full blocks, the ones whose acceptance length is counted
    decode_tau_sum: float = 0.0  # per-sequence mean acceptance length of the decoding walk, summed
    decoded: int = 0  # sequences with at least one anchor, the ones walked
    sequences: int = 0

    def __add__(self, other: "HeldOutScore") -> "HeldOutScore":
        return HeldOutScore(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def summary(self) -> dict:
        return {"eval_loss": self.weighted_ce / max(self.weight, 1e-6),
                "tau_estimate": self.tau_sum / self.blocks if self.blocks else None,
                "decode_tau_estimate": self.decode_tau_sum / self.decoded if self.decoded else None}


class Trainer:
    def __init__(self, config: TrainConfig, drafter: DFlashDraftModel, target: FrozenTarget,
                 train_data: TokenSamples, eval_data: TokenSamples | None = None, start_time: float | None = None):
        self.config = config
        self.start_time = time.monotonic() if start_time is None else start_time
        self.target = target
        self.device = target.device
        self.model = drafter.to(self.device).float().train()
        # the drafter declares how far back it was trained to attend: the engine's default window for it
        extra = self.model.config.dflash_config = dict(getattr(self.model.config, "dflash_config", None) or {})
        extra["draft_window"] = max(int(extra.get("draft_window") or 0), config.max_length)
        bs = self.model.spec.block_size
        if any(not 2 <= n <= bs for n in config.block_sizes):
            raise ValueError(f"block sizes to train must be in [2, {bs}] (the drafter's block), got {config.block_sizes}")
        self.block_sizes = tuple(sorted(set(config.block_sizes) | {bs})) if config.block_sizes else ()
        if self.block_sizes:
            extra["block_sizes"] = sorted(set(extra.get("block_sizes") or []) | set(self.block_sizes))
        if config.quant_aware:
            make_quant_aware(self.model, config.quant_aware)
        if len(train_data) == 0:
            raise ValueError("no training sequences")
        self.train_data = train_data
        self.eval_sets = eval_data.by_domain() if eval_data is not None else {}  # held-out samples of each domain
        self.block_size = drafter.spec.block_size
        self.out_dir = Path(config.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=config.lr, betas=config.betas, fused=self.device.type == "cuda")
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, config.max_steps, config.warmup_frac, config.min_lr_ratio))
        self.step = self.epoch = self.batch_in_epoch = 0
        self._saved_step: int | None = None
        self._epoch_order: tuple[int, list[list[int]]] | None = None
        self._since_log: list[tuple[float, float]] = []  # (loss, train tau) of steps since the last log line

    # ---- checkpoints -------------------------------------------------------------------------
    def save(self) -> None:
        self._saved_step = self.step
        save_checkpoint(self.out_dir, {
            "drafter_config": config_to_json(self.model.config),
            "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
            "step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
            "since_log": self._since_log, "rng": rng_state(), "train_config": json.dumps(asdict(self.config))})

    def resume(self) -> bool:
        """Continue from `<out_dir>/checkpoint.pt` if there is one; returns whether there was."""
        state = load_checkpoint(self.out_dir)
        if state is None:
            return False
        saved = json.loads(state["train_config"]).get("quant_aware")
        if saved != self.config.quant_aware:  # the weights were trained for one storage: keep training for it
            raise ValueError(f"{self.out_dir} was trained with quant_aware={saved!r}, not {self.config.quant_aware!r}: "
                             f"resume with " + (f"--quant-aware {saved}" if saved else "no --quant-aware")
                             + " or train into a new --out")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        self._since_log = [tuple(x) for x in state["since_log"]]
        restore_rng(state["rng"])
        self._truncate_log()
        self._saved_step = self.step
        return True

    def _truncate_log(self) -> None:
        """Drop log lines written after the checkpoint (a run killed between a log line and a save)."""
        log = self.out_dir / LOG_FILE
        if log.is_file():
            lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
            log.write_text("".join(ln + "\n" for ln in lines if json.loads(ln)["step"] <= self.step))

    # ---- one step ----------------------------------------------------------------------------
    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    def batch_loss(self, samples: TokenSamples, indices,
                   choose_anchors: Callable[[torch.Tensor], Anchors]) -> tuple[BlockLoss, Anchors]:
        """Loss over the anchors `choose_anchors(loss_mask)` picks in the given sequences (graph kept
        when grad is enabled)."""
        c, bs = self.config, self.block_size
        batch = collate(samples, indices, c.max_length, pad_multiple=PAD_MULTIPLE)
        input_ids, loss_mask = batch.input_ids.to(self.device), batch.loss_mask.to(self.device)
        anchors = choose_anchors(loss_mask)
        labels, weights = block_labels(input_ids, loss_mask, anchors, bs, c.gamma)
        features = self.target.features(input_ids)
        with torch.no_grad():
            embeds = self.target.embed(block_input_ids(input_ids, anchors, bs, self.model.spec.mask_token_id))
        with self._autocast():
            hidden = block_hidden(self.model, features, embeds, anchors.positions, anchors.block_sizes)
            result = block_loss(self.model, hidden, self.target.lm_head, labels, weights, c.loss_chunk)
        return result, anchors

    def train_step(self, indices) -> tuple[float, float]:
        """One optimizer step; returns (loss, greedy acceptance length on this batch's full blocks)."""
        generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + self.step)

        def choose(mask: torch.Tensor) -> Anchors:
            anchors = sample_anchors(mask, self.config.anchors_per_seq, generator)
            return sample_block_sizes(anchors, self.block_sizes, generator) if self.block_sizes else anchors

        result, _ = self.batch_loss(self.train_data, indices, choose)
        result.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        tau = acceptance_lengths(result.correct)[result.full_blocks].float()
        return result.loss.item(), (tau.mean().item() if tau.numel() else float("nan"))

    def next_batch(self) -> list[int]:
        c = self.config
        if self._epoch_order is None or self._epoch_order[0] != self.epoch:
            self._epoch_order = (self.epoch, epoch_batches(self.train_data.lengths, c.batch_size, c.seed, self.epoch))
        batches = self._epoch_order[1]
        if self.batch_in_epoch >= len(batches):
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
            return self.next_batch()
        self.batch_in_epoch += 1
        return batches[self.batch_in_epoch - 1]

    # ---- evaluation --------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out weighted loss and greedy acceptance length (1 + accepted drafts) over random
        full-block anchors, per domain and over all domains together; the same anchors at every
        evaluation, and a domain's do not depend on the other domains."""
        if not self.eval_sets:
            return {}
        self.model.eval()
        scores = {name: self.held_out_score(samples) for name, samples in self.eval_sets.items()}
        self.model.train()
        total = sum(scores.values(), HeldOutScore())
        return {**total.summary(),
                "domains": {name: {**score.summary(), "sequences": score.sequences} for name, score in scores.items()}}

    def held_out_score(self, samples: TokenSamples) -> HeldOutScore:
        n = min(self.config.eval_sequences, len(samples))
        score = HeldOutScore(sequences=n)
        for s in range(0, n, self.config.batch_size):
            result, anchors = self.batch_loss(samples, range(s, min(n, s + self.config.batch_size)),
                                              lambda mask: first_anchors(mask, self.config.eval_anchors_per_seq))
            lengths = acceptance_lengths(result.correct)
            tau = lengths[result.full_blocks]
            walks = [w for w in (decoding_walk(lengths[i], anchors.valid[i]) for i in range(len(lengths))) if w]
            score += HeldOutScore(result.weighted_ce.item(), result.weight_sum.item(), tau.sum().item(), tau.numel(),
                                  sum(sum(w) / len(w) for w in walks), len(walks))
        return score

    def log(self, record: dict) -> None:
        with open(self.out_dir / LOG_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")

    def _log_eval(self) -> dict:
        losses = [l for l, _ in self._since_log]
        taus = [t for _, t in self._since_log if not math.isnan(t)]
        record = {"step": self.step, "loss": sum(losses) / len(losses) if losses else None,
                  "train_tau": sum(taus) / len(taus) if taus else None, **self.evaluate(),
                  "lr": self.scheduler.get_last_lr()[0], "epoch": self.epoch,
                  "elapsed_s": round(time.monotonic() - self.start_time, 1)}
        self.log(record)
        self._since_log = []
        if len(record.get("domains", {})) > 1:
            taus = ", ".join(f"{name} {d['decode_tau_estimate']:.2f} ({d['tau_estimate']:.2f})"
                             for name, d in record["domains"].items() if d["tau_estimate"] is not None)
            tqdm.write(f"step {self.step}: held-out tau estimate, decoding (all anchors): {taus}")
        return record

    # ---- the loop ----------------------------------------------------------------------------
    def train(self, until_step: int | None = None, progress: bool = True) -> list[float]:
        """Train to max_steps (or until_step, or the time budget), checkpointing along the way and at
        the end. Returns the losses of the steps taken by this call."""
        c = self.config
        stop_at = min(c.max_steps, until_step or c.max_steps)
        losses: list[float] = []
        step_time = save_time = eval_time = 0.0
        bar = tqdm(total=c.max_steps, initial=self.step, disable=not progress, dynamic_ncols=True)
        ema_loss = ema_tau = None
        while self.step < stop_at:
            eval_next = (self.step + 1) % c.eval_every == 0 or self.step + 1 == c.max_steps
            if eval_next and not eval_time:  # not measured yet: about one forward per held-out batch
                eval_time = step_time * -(-c.eval_sequences // c.batch_size)
            if self._out_of_time(1.5 * step_time + save_time + (eval_time if eval_next else 0.0)):
                break
            t = time.monotonic()
            loss, tau = self.train_step(self.next_batch())
            if losses:  # a call's first step warms up (kernel builds, allocator growth): not what a step costs
                step_time = max(step_time, time.monotonic() - t)
            losses.append(loss)
            self._since_log.append((loss, tau))
            ema_loss = loss if ema_loss is None else 0.9 * ema_loss + 0.1 * loss
            if not math.isnan(tau):
                ema_tau = tau if ema_tau is None else 0.9 * ema_tau + 0.1 * tau
            postfix = {"loss": f"{ema_loss:.3f}", "lr": f"{self.scheduler.get_last_lr()[0]:.2e}"}
            if ema_tau is not None:
                postfix["tau"] = f"{ema_tau:.2f}"
            if self.step % c.eval_every == 0 or self.step == c.max_steps:
                t = time.monotonic()
                record = self._log_eval()
                eval_time = time.monotonic() - t
                if record.get("tau_estimate") is not None:
                    postfix["eval_tau"] = f"{record['tau_estimate']:.2f}"
            bar.set_postfix(postfix, refresh=False)
            bar.update(1)
            if self.step % c.save_every == 0:
                t = time.monotonic()
                self.save()
                save_time = time.monotonic() - t
        bar.close()
        if self._saved_step != self.step:
            self.save()
        return losses

    def _out_of_time(self, needed_s: float) -> bool:
        budget = self.config.time_budget_s
        return budget is not None and time.monotonic() - self.start_time + needed_s > budget
