"""Training DFlash drafters for a target model.

Three steps, each a thin script over this package; every step is resumable, so it can run as a
series of short calls (e.g. 10-minute GPU jobs): run the same command again and it continues.

1. Data: the target answers the MATH training problems (never math500) in the math500 prompt
   format, through our engine; greedy by default, plus K sampled answers per problem if asked.

       python scripts/generate_training_data.py --out data/math-qc15 \\
           --target qwen2.5-coder-1.5b-instruct --max-new-tokens 1024 --shard-size 256 \\
           --batch-size 128 [--samples-per-problem 2 --temperature 0.8] [--time-budget-s 540]

   Shards `shard-00000.safetensors`, ... hold int32 token ids (one flat array + offsets), the
   prompt length and source problem of each sample (`data.TokenSamples`); finished shards are
   skipped. `data.load_samples(dir, ...)` concatenates them (several directories: their shards together).

2. Train: the frozen target (transformers, bf16) computes the hidden features of the chosen
   layers for each batch on the fly; its embeddings and lm_head are shared, frozen. Random anchors
   in each response, one block [anchor token, MASK x (bs-1)] per anchor, all blocks of a sequence
   in one masked attention (`mask.training_mask`), CE weighted by exp(-(k-1)/gamma).

       python scripts/train_drafter.py --data data/math-qc15 --out runs/qc15 \\
           --max-steps 3000 --batch-size 8 --anchors-per-seq 256 --time-budget-s 540 --resume

   Shape flags: --draft-layers --heads --kv-heads --head-dim --intermediate-size
   --target-layer-ids --block-size --mask-token-id; or `--init-from DRAFTER_DIR` to start from an
   exported drafter's weights and shape with a fresh schedule; `--quant-aware q4_0` (or fp8, q8_0,
   q5_0) to train with exactly the weights that export's `--storage` of the same name writes.
   `runs/qc15/checkpoint.pt` holds everything
   needed to resume (written atomically every --save-every steps and at the end);
   `runs/qc15/log.jsonl` has one line per evaluation: step, loss, train_tau, eval_loss,
   tau_estimate (greedy acceptance length averaged over every anchor of the held-out prompts' first
   --eval-anchors-per-seq response positions), decode_tau_estimate (greedy decoding replayed over the
   same anchors: what eval.humaneval / eval.math500 measure as tau, ~10-15% lower), per domain, lr.

3. Export to the z-lab format (config.json + model.safetensors):

       python scripts/export_drafter.py runs/qc15 drafters/checkpoints/qc15-dflash [--storage fp8]

   bf16 (default) is read by z-lab's `dflash`, vLLM, SGLang and `drafters.load_drafter`; fp8
   (e4m3 weights, per-output-channel scales, `"weight_storage": "fp8_e4m3_per_channel"` at the top
   level of config.json) is about half the size and read by `drafters.load_drafter` only, as are the
   GGML block storages q8_0 ... q4_0 (`drafters.weight_storage`), which fit a larger drafter in the same bytes.

Modules: `data` (samples, shards, batches), `generation` (answering problems with the engine),
`anchors` (anchors, blocks, labels, weights, acceptance length), `mask` (the training mask),
`forward` (dense training forward and chunked loss), `target` (the frozen target), `drafter_config`
(shape, init, size), `grow` (a trained drafter widened or deepened without changing what it computes),
`quant_aware` (training in a storage's weights), `checkpoint` (atomic save/load), `trainer` (the loop).
"""
