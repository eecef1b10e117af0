"""Greedy outputs of the default target on CPU (fp32 weights, torch attention) with an fp32 KV cache,
an all-FP8 (e4m3, scale 1.0) cache, and FP8 with a few layers kept in fp32 (the layer tensors swapped
after the engine is built: the engine has no per-layer cache dtype yet). Four math500 problems (10-13),
80 new tokens. Run from the repo root: python results/kv-precision-cpu-run1/greedy_with_full_precision_layers.py 80"""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch

from specdec.models.loader import load_target
from specdec.engine.engine import Engine
from specdec.engine.config import EngineConfig
from specdec.engine.sampling_params import SamplingParams
torch.set_grad_enabled(False)
target = load_target(Path.home()/".cache/specdec/models/qwen2.5-coder-1.5b-instruct", torch.device("cpu"), torch.float32)
tok = target.tokenizer
probs = [json.loads(l)["problem"] for l in open('eval/data/math500.jsonl').readlines()[10:14]]
prompts = [tok(tok.apply_chat_template([{"role":"user","content":p}], tokenize=False, add_generation_prompt=True))["input_ids"] for p in probs]
params = SamplingParams(max_new_tokens=int(sys.argv[1]) if len(sys.argv)>1 else 80)
def run(kv, full_layers=()):
    e = Engine(target, EngineConfig(device="cpu", kv_cache_dtype=kv, num_kv_pages=256, page_size=16, max_num_seqs=4), None)
    for i in full_layers:
        layer = e.kv.layers[i]; layer.data = torch.zeros(layer.data.shape, dtype=torch.float32)
    t=time.time(); out=[r.output_ids for r in e.generate_ids(prompts, params)]; 
    return out, time.time()-t
ref, t = run("auto"); print("fp32", round(t,1), "s")
def first_diff(a,b): return next((i for i,(x,y) in enumerate(zip(a,b)) if x!=y), min(len(a),len(b)))
for name, kv, layers in [("fp8", "fp8", ()), ("fp8, layers 0 1 15 full", "fp8", (0,1,15)), ("fp8, layers 0 1 full", "fp8", (0,1))]:
    out, t = run(kv, layers)
    print(name, round(t,1), "s; first divergence per prompt:", [first_diff(a,b) for a,b in zip(ref,out)], "of", [len(a) for a in ref])
print("ref text 0:", tok.decode(ref[0])[:200].replace("\n"," "))
