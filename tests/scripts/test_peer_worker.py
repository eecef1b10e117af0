"""scripts/bench/peer_worker.py's timing and bookkeeping, with a scripted engine in place of vLLM/SGLang."""

import asyncio
import json
import time

import pytest

from scripts.bench import peer_worker
from scripts.bench.peer_worker import Stream


class ScriptedPeer:
    """Emits `chunk` tokens per step (token id = prompt length + position), 2 ms apart; counts drafts like vLLM."""

    engine = None
    in_flight = 0
    most_in_flight = 0

    def __init__(self, job):
        self.chunk = 3 if job["drafter"] else 1
        self.drafts = self.accepted = 0.0
        self.closed = False

    def event_loop(self):
        return asyncio.new_event_loop()

    async def generate(self, prompt_ids, max_new_tokens):
        cls = type(self)
        cls.in_flight += 1
        cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
        stream = Stream(time.perf_counter())
        tokens = []
        while len(tokens) < max_new_tokens:
            await asyncio.sleep(0.002)
            tokens += [len(prompt_ids) + k for k in range(len(tokens), min(len(tokens) + self.chunk, max_new_tokens))]
            self.drafts += 1
            self.accepted += self.chunk - 1
            stream.seen(len(tokens))
        stream.token_ids = tokens
        cls.in_flight -= 1
        return stream

    def counters(self):
        return (self.drafts, self.accepted) if self.chunk > 1 else None

    def info(self):
        return {"engine": "scripted"}

    def close(self):
        self.closed = True


def job(drafter, concurrency=(2,)):
    return {"engine": "scripted", "drafter": "d" if drafter else None, "prompts": [[1] * 5, [1] * 7],
            "warm_prompt": [1, 2], "batch": [[1] * 5, [1] * 7, [1] * 9], "max_new_tokens": 10, "warmup_tokens": 2,
            "concurrency": list(concurrency), "budget_s": None}


@pytest.mark.parametrize("drafter", [False, True])
def test_job_records_and_rows(monkeypatch, tmp_path, drafter):
    monkeypatch.setitem(peer_worker.PEERS, "scripted", ScriptedPeer)
    ScriptedPeer.most_in_flight = 0
    job_path, result_path = tmp_path / "job.json", tmp_path / "result.json"
    job_path.write_text(json.dumps(job(drafter)))
    assert peer_worker.main([str(job_path), str(result_path)]) == 0
    res = json.loads(result_path.read_text())
    assert res["error"] is None and res["info"]["engine"] == "scripted" and res["info"]["build_s"] >= 0
    assert [r["index"] for r in res["prompts"]] == [0, 1]
    first = res["prompts"][0]
    assert first["token_ids"] == list(range(5, 15)) and first["generated_tokens"] == 10
    assert 0 < first["ttft_s"] <= first["wall_s"] and first["tpot_s"] > 0
    chunk = 3 if drafter else 1
    # TPOT: from the first chunk to the last, over the tokens after the first chunk
    assert first["tpot_s"] == pytest.approx((first["wall_s"] - first["ttft_s"]) / (10 - chunk), rel=1e-6)
    # vLLM's acceptance length: 1 + accepted / drafts over the phase (the scripted peer accepts chunk - 1 per draft)
    assert res["tau_reported"] == (pytest.approx(chunk) if drafter else None)
    [row] = res["throughput"]
    assert row["concurrency"] == 2 and row["prompts"] == 3 and row["generated_tokens"] == 30
    assert row["token_ids"][2] == list(range(9, 19)) and row["tokens_per_s"] > 0
    assert ScriptedPeer.most_in_flight == 2  # the semaphore held concurrency at 2 with 3 requests


def test_failure_is_reported(monkeypatch, tmp_path):
    class Broken(ScriptedPeer):
        def __init__(self, job):
            raise RuntimeError("no GPU")

    monkeypatch.setitem(peer_worker.PEERS, "scripted", Broken)
    (tmp_path / "job.json").write_text(json.dumps(job(False)))
    assert peer_worker.main([str(tmp_path / "job.json"), str(tmp_path / "r.json")]) == 1
    assert json.loads((tmp_path / "r.json").read_text())["error"] == "RuntimeError: no GPU"
