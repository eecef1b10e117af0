"""Per-layer error of an FP8 KV cache against the model's own attention (specdec/models/kv_precision.py).

    python scripts/kv_precision.py --model qwen2.5-coder-1.5b-instruct --out kv-precision.json
    python scripts/kv_precision.py --quick          # a tiny random model (CPU smoke run)

The text: the first --problems math500 problems with their reference solutions, as chat turns through
the model's template, cut to --max-tokens. The model runs in fp32 on --device (cpu by default: the
fp32 reference needs no GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python scripts/kv_precision.py`
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from eval.data_file import read_rows  # noqa: E402
from eval.problems import PACKAGED_DATA  # noqa: E402
from specdec.models.kv_precision import LayerError, fp8_layer_errors  # noqa: E402
from specdec.models.loader import load_target  # noqa: E402
from specdec.weights.demo_models import resolve_model  # noqa: E402


def math_text_ids(tokenizer, problems: int, max_tokens: int) -> list[int]:
    rows = read_rows(str(PACKAGED_DATA), ("problem", "solution"))[:problems]
    messages = [m for r in rows for m in ({"role": "user", "content": r["problem"]},
                                           {"role": "assistant", "content": r["solution"]})]
    return tokenizer(tokenizer.apply_chat_template(messages, tokenize=False))["input_ids"][:max_tokens]


def table(errors: list[LayerError]) -> str:
    header = ("| layer | max abs K | max abs V | fp8 | fp8, calibrated scales | fp8 K only | fp8 V only | "
              "fp8, smoothed keys | bf16 |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|"]
    for e in errors:
        lines.append(f"| {e.layer} | {e.max_k:.1f} | {e.max_v:.1f} | {e.fp8:.3f} | {e.fp8_calibrated:.3f} | "
                     f"{e.fp8_k_only:.3f} | {e.fp8_v_only:.3f} | {e.fp8_smoothed_keys:.3f} | {e.bf16:.4f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="demo name or HF model directory")
    p.add_argument("--device", default="cpu")
    p.add_argument("--problems", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--quick", action="store_true", help="a tiny random model and random token ids")
    p.add_argument("--out", help="JSON results file")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            from scripts.bench.random_models import TINY_SHAPE, random_target

            model_dir = random_target(Path(tmp) / "target", TINY_SHAPE, torch.device("cpu"), std=0.2)
            target = load_target(Path(model_dir), torch.device(args.device), torch.float32)
            ids = torch.randint(3, target.model.config.vocab_size - 3, (64,)).tolist()
        else:
            target = load_target(Path(resolve_model(args.model)), torch.device(args.device), torch.float32)
            ids = math_text_ids(target.tokenizer, args.problems, args.max_tokens)
        errors = fp8_layer_errors(target.model, torch.tensor(ids, device=args.device))
    print(f"{len(ids)} tokens; error = |attention output - reference| / |reference| per layer")
    print(table(errors))
    if args.out:
        Path(args.out).write_text(json.dumps({"command": sys.argv, "model": args.model, "tokens": len(ids),
                                              "layers": [asdict(e) for e in errors]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
