"""Structured output is exact under speculation: every verified row is masked with the grammar's state after
the drafts before it, so speculative greedy output equals plain greedy output with the same grammar; every
finished output of a random-weight model parses and validates; plain decoding equals a direct loop masking
the target's logits with llguidance's own mask."""

import json
import re

import jsonschema
import llguidance
import pytest
import torch
from transformers import AutoTokenizer

from specdec.engine.config import EngineConfig
from specdec.engine.engine import Engine
from specdec.engine.grammar import Grammars, bitmask
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.structured_output import StructuredOutput
from specdec.engine.verify_policy import TREE, StepCosts
from specdec.models.loader import LoadedTarget, load_causal_lm
from tests.conftest import build_tiny_model_with_tokenizer
from tests.drafter_helpers import ScriptedDrafter
from tests.engine_helpers import assert_no_leak, dflash_drafter
from tests.tokenizer_helpers import as_transformers, bytelevel_tokenizer, gguf_style

# bounded (strings, numbers, arrays, no extra keys), so that a random model's output ends within max_new_tokens
SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3}},
        "required": ["name", "age", "tags"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                   "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                  "required": ["x", "y"], "additionalProperties": False},
        "ok": {"type": "boolean"}, "kind": {"enum": ["circle", "square"]}},
        "required": ["point", "ok", "kind"], "additionalProperties": False},
    "list": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    "optional": {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3},
                                                   "b": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                                   {"type": "null"}]}},
                 "required": ["a"], "additionalProperties": False},
}
TEXTS = ["Hello world", "The quick brown fox", "naïve café", "Streaming text arrives", "tiny corpus", "lazy dog"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_with_tokenizer(tmp_path_factory.mktemp("structured"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(t) for t in TEXTS]


def engine_for(model_dir, tokenizer, drafter=None, **config):
    config = {"num_kv_pages": 512, "page_size": 4, **config}
    target = LoadedTarget(load_causal_lm(model_dir, torch.device("cpu"), torch.float32), tokenizer,
                          frozenset({tokenizer.eos_token_id}), model_dir)
    return Engine(target, EngineConfig(device="cpu", **config), drafter)


def drafter_for(kind, model_dir, tmp_path, expected=None, prompts=None):
    if kind == "dflash":
        return dflash_drafter(model_dir, tmp_path, 4)
    return ScriptedDrafter({tuple(p): e for p, e in zip(prompts, expected)}, 4, 400, error_rate=0.3)


def constrained(max_new_tokens=120, **spec) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, structured_output=StructuredOutput(**spec))


@pytest.mark.parametrize("schema", SCHEMAS, ids=list(SCHEMAS))
@pytest.mark.parametrize("drafter", [None, "dflash"])
@pytest.mark.parametrize("sampling", [dict(), dict(temperature=1.0, seed=5)], ids=["greedy", "sampled"])
def test_every_output_parses_and_validates(model_dir, tokenizer, prompts, tmp_path, schema, drafter, sampling):
    engine = engine_for(model_dir, tokenizer, drafter_for(drafter, model_dir, tmp_path) if drafter else None)
    params = SamplingParams(max_new_tokens=120, structured_output=StructuredOutput(json=SCHEMAS[schema]), **sampling)
    for request in engine.generate_ids(prompts, params):
        assert request.finish_reason == "stop", tokenizer.decode(request.output_ids)
        jsonschema.validate(json.loads(tokenizer.decode(request.output_ids)), SCHEMAS[schema])
    assert_no_leak(engine)


@pytest.mark.parametrize("config", [dict(), dict(verify="tree", tree_nodes=7), dict(verify="auto", max_num_seqs=3)],
                         ids=["chain", "tree", "auto-with-arrivals"])
def test_speculative_greedy_equals_plain_greedy_with_a_grammar(model_dir, tokenizer, prompts, tmp_path, config):
    params = [constrained(json=SCHEMAS["person"]), SamplingParams(max_new_tokens=30),
              constrained(regex=r"[a-z]{1,4}( [0-9]{1,3}){1,3}"), constrained(json=SCHEMAS["nested"])]
    plain = engine_for(model_dir, tokenizer)
    expected = [plain.generate_ids([p], params[i % 4])[0].output_ids for i, p in enumerate(prompts)]
    engine = engine_for(model_dir, tokenizer, dflash_drafter(model_dir, tmp_path, 4), **config)
    requests = [engine.make_request(p, params[i % 4]) for i, p in enumerate(prompts)]  # mixed batches
    engine.run(requests)
    assert [r.output_ids for r in requests] == expected
    assert_no_leak(engine)


def test_short_chains_are_exact_with_grammars_penalties_and_logprobs(model_dir, tokenizer, prompts, tmp_path):
    """Steps with such requests verify chains only, of the length the policy picks: here the shortest (2), and the
    whole chain for a request running alone."""
    params = [constrained(json=SCHEMAS["person"]), SamplingParams(max_new_tokens=30, frequency_penalty=1.0),
              SamplingParams(max_new_tokens=30, logprobs=2), constrained(regex=r"[a-z]{1,4}( [0-9]{1,3}){1,3}")]
    plain = engine_for(model_dir, tokenizer)
    expected = [plain.generate_ids([p], params[i % 4])[0] for i, p in enumerate(prompts)]
    engine = engine_for(model_dir, tokenizer, dflash_drafter(model_dir, tmp_path, 8), verify="auto", tree_nodes=7)
    policy = engine.decoding.policy
    rungs = range(1, 65)
    policy.costs = StepCosts(draft={}, verify={2: {r: 1.0 for r in rungs}, 4: {r: 100.0 for r in rungs},
                                               8: {r: 100.0 for r in rungs}, TREE: {r: 1e-3 for r in rungs}})
    requests = [engine.make_request(p, params[i % 4]) for i, p in enumerate(prompts)]
    engine.run(requests)
    assert [r.output_ids for r in requests] == [e.output_ids for e in expected]
    lengths = {q for r in requests for q in r.stats.verify_lengths}
    assert 2 in lengths and lengths <= {2, 8}  # never a tree; the whole block only at batch 1
    for got, want in zip(requests, expected):
        if want.output_logprobs is not None:
            assert [t.logprob for t in got.output_logprobs] == pytest.approx([t.logprob for t in want.output_logprobs],
                                                                            abs=1e-4)
    assert_no_leak(engine)


@pytest.mark.parametrize("error_rate", [0.0, 0.3], ids=["all-accepted", "noisy"])
def test_drafts_along_the_grammar_are_accepted_and_exact(model_dir, tokenizer, prompts, error_rate):
    """A drafter proposing the constrained answer itself: rows past the first follow accepted drafts, so each
    row's mask must be the grammar's after them (a mask of the committed state alone would reject them)."""
    params = constrained(json=SCHEMAS["person"])
    expected = [r.output_ids for r in engine_for(model_dir, tokenizer).generate_ids(prompts, params)]
    drafter = ScriptedDrafter({tuple(p): e for p, e in zip(prompts, expected)}, 4, len(tokenizer),
                              error_rate=error_rate)
    engine = engine_for(model_dir, tokenizer, drafter)
    got = engine.generate_ids(prompts, params)
    assert [r.output_ids for r in got] == expected
    if error_rate == 0:
        assert max(max(r.stats.acceptance_lengths) for r in got) == 4
    assert_no_leak(engine)


@pytest.mark.parametrize("overlap", [True, False])
def test_plain_decoding_equals_a_direct_loop_with_llguidance_masks(model_dir, tokenizer, prompts, overlap):
    engine = engine_for(model_dir, tokenizer, overlap_steps=overlap)
    spec = StructuredOutput(json=SCHEMAS["nested"])
    [request] = engine.generate_ids([prompts[0]], SamplingParams(max_new_tokens=60, structured_output=spec))
    matcher = llguidance.LLMatcher(engine.grammars.tokenizer, spec.llguidance_grammar())
    output = []
    while not matcher.is_stopped() and len(output) < 60:
        logits = engine.next_token_logits(prompts[0] + output)
        allowed = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
        allowed = ((allowed[:, None] >> torch.arange(8)) & 1).flatten()[:logits.shape[0]].bool()
        output.append(int(logits.masked_fill(~allowed, float("-inf")).argmax()))
        assert matcher.consume_token(output[-1])
    assert request.output_ids == output
    unconstrained = engine.generate_ids([prompts[0]], SamplingParams(max_new_tokens=len(output)))[0].output_ids
    assert unconstrained != output  # the grammar changed something


@pytest.mark.parametrize("spec, check", [
    (dict(regex=r"[a-c]{2,5}-[0-9]{1,3}"), lambda t: re.fullmatch(r"[a-c]{2,5}-[0-9]{1,3}", t)),
    (dict(choice=["yes", "no", "maybe not"]), lambda t: t in ("yes", "no", "maybe not")),
    (dict(grammar='start: "(" NUM ("," NUM)? ")"\nNUM: /[0-9]{1,2}/'), lambda t: re.fullmatch(r"\(\d{1,2}(,\d{1,2})?\)", t)),
    (dict(json_object=True), lambda t: isinstance(json.loads(t), dict)),
], ids=["regex", "choice", "lark", "json_object"])
def test_regex_choice_and_grammar_outputs_match(model_dir, tokenizer, prompts, tmp_path, spec, check):
    engine = engine_for(model_dir, tokenizer, dflash_drafter(model_dir, tmp_path, 4))
    for request in engine.generate_ids(prompts, constrained(max_new_tokens=200, **spec)):
        text = tokenizer.decode(request.output_ids, skip_special_tokens=True)
        if spec.get("json_object") and request.finish_reason == "length":
            continue  # any object may be longer than the budget; the grammar is then unfinished, not broken
        assert request.finish_reason == "stop" and check(text), text
    assert_no_leak(engine)


def test_seeded_samples_validate_and_repeat(model_dir, tokenizer, prompts):
    params = SamplingParams(max_new_tokens=120, temperature=1.0, seed=3, n=3,
                            structured_output=StructuredOutput(json=SCHEMAS["person"]))
    runs = [[r.output_ids for r in engine_for(model_dir, tokenizer).generate_ids(prompts[:2], params)]
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 6
    for ids in runs[0]:
        jsonschema.validate(json.loads(tokenizer.decode(ids)), SCHEMAS["person"])


def test_preempted_requests_keep_their_grammar_state(model_dir, tokenizer, prompts):
    params = constrained(max_new_tokens=60, json=SCHEMAS["nested"])
    reference = engine_for(model_dir, tokenizer).generate_ids(prompts, params)
    assert all(r.finish_reason == "stop" for r in reference)
    expected = [r.output_ids for r in reference]
    engine = engine_for(model_dir, tokenizer, num_kv_pages=20)  # too few pages for all six: some are preempted
    preempted = []
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests:
        preempted += engine.step().preempted
    assert preempted
    assert [r.output_ids for r in requests] == expected
    assert_no_leak(engine)


@pytest.mark.parametrize("spec, message", [
    (dict(regex="[a-"), "(?s)invalid structured output \\(regex\\).*unclosed character class"),
    (dict(json={"type": "frobnicate"}), "invalid structured output \\(json\\).*frobnicate"),
    (dict(json="{not json"), "invalid structured output \\(json\\)"),
    (dict(grammar="start: ("), "invalid structured output \\(grammar\\)"),
    (dict(choice=[]), "choice must be 1 to"),
    (dict(regex="a", choice=["a"]), "exactly one of .*got regex, choice"),
    (dict(), "exactly one of .*got none"),
])
def test_bad_specs_are_refused_with_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutput(**spec)


def test_sampling_params_refuse_a_spec_of_another_type():
    with pytest.raises(ValueError, match="structured_output must be a StructuredOutput"):
        SamplingParams(structured_output={"json": {}})


def test_an_engine_without_a_tokenizer_fails_the_request_alone(model_dir, prompts):
    target = LoadedTarget(load_causal_lm(model_dir, torch.device("cpu"), torch.float32), None, frozenset(), model_dir)
    engine = Engine(target, EngineConfig(device="cpu", num_kv_pages=64, page_size=4))
    bad = engine.add_request(prompts[0], constrained(regex="[a-z]+"))
    good = engine.add_request(prompts[1], SamplingParams(max_new_tokens=4))
    assert bad.finish_reason == "error" and "structured output needs the model's fast (tokenizers) tokenizer" in bad.error

    while engine.has_unfinished_requests:
        engine.step()
    assert len(good.output_ids) == 4
    assert_no_leak(engine)


def allowed_after(grammars: Grammars, spec: StructuredOutput, tokenizer, text: str) -> set[int]:
    """The tokens a grammar allows after `text`."""
    from types import SimpleNamespace

    matcher = grammars.matcher(spec)
    assert matcher.consume_tokens(tokenizer.encode(text))
    bits = bitmask([SimpleNamespace(matcher=matcher)], 1, None, grammars.vocab_size)[0]
    return {t for t in range(grammars.vocab_size) if bits[t // 32] >> (t % 32) & 1}


def test_a_gguf_converted_byte_level_tokenizer_is_read_as_bytes():
    """transformers' GGUF conversion wraps the byte-level decoder in sentencepiece-style steps; read as text,
    the newline token would be the letter "Ċ" and a raw newline could enter a JSON string."""
    tokenizer = as_transformers(gguf_style(bytelevel_tokenizer()), eos_token="<|endoftext|>")
    newline = tokenizer.encode("\n")[0]
    grammars = Grammars(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    spec = StructuredOutput(json={"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})
    inside_string = allowed_after(grammars, spec, tokenizer, '{"a":"x')
    assert newline not in inside_string and tokenizer.encode("y")[0] in inside_string
    assert grammars.tokenizer.decode_bytes([newline]) == b"\n"


def test_a_tokenizer_llguidance_would_misread_is_refused():
    metaspace = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True}
    tokenizer = as_transformers(gguf_style(bytelevel_tokenizer(), pre_tokenizer=metaspace), eos_token="<|endoftext|>")
    with pytest.raises(ValueError, match="structured output cannot be enforced for this model: llguidance reads"):
        Grammars(tokenizer, len(tokenizer), {tokenizer.eos_token_id})


def test_a_model_without_grammars_is_found_out_once(model_dir, prompts, monkeypatch):
    """The grammar tokenizer's failure is kept: later constrained requests fail with it, with no second build."""
    import specdec.engine.engine as engine_module

    builds = []
    monkeypatch.setattr(engine_module, "Grammars", lambda *args: builds.append(args) or Grammars(*args))
    target = LoadedTarget(load_causal_lm(model_dir, torch.device("cpu"), torch.float32), None, frozenset(), model_dir)
    engine = Engine(target, EngineConfig(device="cpu", num_kv_pages=64, page_size=4))
    failed = [engine.add_request(p, constrained(regex="[a-z]+")) for p in prompts[:3]]
    assert len(builds) == 1
    assert all(r.finish_reason == "error" and "fast (tokenizers) tokenizer" in r.error for r in failed)
