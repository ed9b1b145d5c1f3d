"""Grammar-constrained decoding (infer.grammar): every sequence a tiny random model samples under a
JSON-schema constraint parses and validates, end tokens are allowed exactly when the grammar can
end, and the constraint's contract (mask shape, accept errors, independent states) holds."""

import json
import math
import random

import pytest
import torch

pytest.importorskip("llguidance")

from _tiny import tiny_train_model  # noqa: E402
from hybridlm import HybridLM  # noqa: E402
from hybridlm.data.bpe import train_bpe  # noqa: E402
from hybridlm.data.chat import STOP  # noqa: E402
from hybridlm.data.tokenizer import ByteTokenizer  # noqa: E402
from hybridlm.infer.grammar import (  # noqa: E402
    end_token_ids,
    grammar_constraint,
    json_constraint,
    llg_tokenizer,
)
from hybridlm.model.cache import HybridCache  # noqa: E402

# --------------------------------------------------------------------------- shared helpers
_WORDS = ["Oslo", "Rome", "Lima", "city", "days", "name", "tags", "true", "false", "null", "note"]


def trained_bpe(vocab_size: int = 600):
    """A BPE trained on JSON-ish text and chat markup (ids 0-11 are the reserved tokens)."""
    rng = random.Random(0)
    texts = []
    for _ in range(400):
        obj = {
            w: rng.choice([rng.randint(0, 999), rng.choice(_WORDS), [1.5, 2]]) for w in _WORDS[:4]
        }
        texts.append(f"<|im_start|>user\n{json.dumps(obj)}<|im_end|>\n" + " ".join(_WORDS))
    return train_bpe(texts, vocab_size=vocab_size)


def tiny_lm(vocab_size: int, seed: int = 0) -> HybridLM:
    """The training tests' tiny hybrid (Mamba, LatentMoE, attention) at `vocab_size`."""
    cfg = tiny_train_model(mtp=False)
    cfg.vocab_size = vocab_size
    return HybridLM(cfg, seed=seed).eval()


@torch.no_grad()
def constrained_sample(
    model: HybridLM,
    factory,
    prompt: list[int],
    *,
    n: int,
    temperature: float,
    seed: int = 0,
    max_new: int = 200,
) -> list[tuple[list[int], bool]]:
    """The reference loop an engine runs: logits -> mask -> sample -> accept, for `n` rows of one
    prompt in a batch (one constraint per row). Returns each row's tokens and whether its
    constraint finished (else it ran out of `max_new`). One thread: a model this small runs
    several times faster on one than on two busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _sample(model, factory, prompt, n, temperature, seed, max_new)
    finally:
        torch.set_num_threads(threads)


def _sample(model, factory, prompt, n, temperature, seed, max_new):
    cons = [factory() for _ in range(n)]
    gen = torch.Generator().manual_seed(seed)
    cache = HybridCache.for_pattern(model.config.pattern)
    logits_BV = model(torch.tensor([prompt] * n), cache=cache).logits[:, -1].float()
    out: list[list[int]] = [[] for _ in range(n)]
    done = [False] * n
    for _ in range(max_new):
        mask_BV = torch.stack([c.allowed() for c in cons])  # finished rows: end tokens
        assert mask_BV.shape == logits_BV.shape and mask_BV.dtype == torch.bool
        assert bool(mask_BV.any(-1).all())  # never an empty set to sample from
        masked = logits_BV.masked_fill(~mask_BV, float("-inf"))
        if temperature <= 0:
            nxt = masked.argmax(-1)
        else:
            nxt = torch.multinomial(torch.softmax(masked / temperature, -1), 1, generator=gen)[:, 0]
        for i, c in enumerate(cons):
            if not done[i]:
                c.accept(int(nxt[i]))
                out[i].append(int(nxt[i]))
                done[i] = c.finished()
        if all(done):
            break
        logits_BV = model(nxt[:, None], cache=cache).logits[:, -1].float()
    return list(zip(out, done, strict=True))


def check_schema(value, schema: dict) -> None:
    """Validate with `jsonschema` when installed, else by hand for the keywords used here."""
    try:
        import jsonschema
    except ImportError:
        _check_by_hand(value, schema)
        return
    jsonschema.validate(value, schema)


def _check_by_hand(value, schema: dict) -> None:  # pragma: no cover - jsonschema is installed
    types = schema.get("type")
    if types is not None:
        names = {
            "object": dict,
            "array": list,
            "string": str,
            "boolean": bool,
            "null": type(None),
            "integer": int,
            "number": (int, float),
        }
        types = [types] if isinstance(types, str) else types
        assert any(
            isinstance(value, names[t]) and not (t in ("integer", "number") and value is True)
            for t in types
        ), (value, schema)
    if "enum" in schema:
        assert value in schema["enum"]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        assert schema.get("minimum", -math.inf) <= value <= schema.get("maximum", math.inf)
    if isinstance(value, str):
        assert len(value) <= schema.get("maxLength", math.inf)
    if isinstance(value, list):
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", math.inf)
        for item in value:
            _check_by_hand(item, schema.get("items", {}))
    if isinstance(value, dict):
        props = schema.get("properties", {})
        assert set(schema.get("required", ())) <= set(value)
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props)
        for key, item in value.items():
            _check_by_hand(item, props.get(key, {}))


# --------------------------------------------------------------------------- fixtures
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Rome", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "temp": {"type": "number", "minimum": -50, "maximum": 50, "multipleOf": 0.25},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 4},
            "minItems": 1,
            "maxItems": 3,
        },
        "where": {
            "type": "object",
            "properties": {
                "lat": {
                    "type": "number",
                    "exclusiveMinimum": -90,
                    "maximum": 90,
                    "multipleOf": 0.5,
                },
                "ok": {"type": "boolean"},
            },
            "required": ["lat", "ok"],
            "additionalProperties": False,
        },
        "note": {"type": ["string", "null"], "maxLength": 6},
    },
    "required": ["city", "days", "tags", "where"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def bpe():
    return trained_bpe()


@pytest.fixture(scope="module")
def models(bpe):
    """(tokenizer, model) per tokenizer; the model vocabularies exceed the tokenizers' (the
    extra ids must never be allowed)."""
    byte = ByteTokenizer()
    return {
        "byte": (byte, tiny_lm(byte.vocab_size + 42)),
        "bpe": (bpe, tiny_lm(bpe.vocab_size + 20)),
    }


# --------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("name", ["byte", "bpe"])
def test_every_sample_validates_against_the_schema(models, name):
    tok, model = models[name]
    V = model.config.vocab_size
    factory = json_constraint(tok, SCHEMA, vocab_size=V)
    prompt = tok.encode("<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n")
    runs = constrained_sample(model, factory, prompt, n=16, temperature=1.0, seed=1)
    seen = {"temp": 0, "note": 0}
    for ids, finished in runs:
        assert finished, tok.decode(ids)
        assert ids[-1] < tok.vocab_size
        value = json.loads(tok.decode(ids))
        check_schema(value, SCHEMA)
        for key in seen:
            seen[key] += key in value
    assert all(v > 0 for v in seen.values()), seen  # optional fields are sampled too
    # greedy, from different prompts; without free numbers, whose digits a random model may
    # repeat forever under argmax
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"], "temp": {"type": "boolean"}}}
    schema["properties"]["where"] = {
        "type": "object",
        "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90}},
        "required": ["lat"],
        "additionalProperties": False,
    }
    factory = json_constraint(tok, schema, vocab_size=V)
    for cut in (1, 2, 3, 4):
        ((ids, finished),) = constrained_sample(model, factory, prompt[:-cut], n=1, temperature=0)
        assert finished, tok.decode(ids)
        check_schema(json.loads(tok.decode(ids)), schema)


@pytest.mark.parametrize("name", ["byte", "bpe"])
def test_json_object_mode(models, name):
    """response_format json_object: any JSON object; the first token must open one."""
    tok, model = models[name]
    V = model.config.vocab_size
    factory = json_constraint(tok, None, vocab_size=V)
    first = factory().allowed()
    for text in ("[", '"', "1", " ", "t"):
        assert not first[tok.encode(text, add_bos=False)[0]], text
    assert first[tok.encode("{", add_bos=False)[0]]
    runs = constrained_sample(model, factory, tok.encode("JSON:"), n=8, temperature=1, max_new=256)
    finished = [ids for ids, done in runs if done]
    assert len(finished) >= 3  # (keys are free strings: the others are still writing one)
    for ids in finished:
        assert isinstance(json.loads(tok.decode(ids)), dict)
    # json.dumps spelling: one space after ':' and ',', none elsewhere
    c = factory()
    for t in tok.encode('{"a":', add_bos=False):
        c.accept(t)
    texts = [tok.decode([i]) for i in c.allowed().nonzero()[:, 0].tolist()]
    assert texts and all(t[0] == " " and not t[1:2].isspace() for t in texts), texts
    # a handwritten object goes through token by token and finishes the constraint
    c = factory()
    for t in tok.encode('{"a": [1, {"b": null}], "c": "x"}', add_bos=False):
        assert c.allowed()[t] and not c.finished()
        c.accept(t)
    assert c.finished()


def test_end_tokens_are_allowed_exactly_when_the_grammar_can_end(bpe):
    byte = ByteTokenizer()
    assert end_token_ids(byte) == [byte.eos_id]  # <|im_end|> is text for the byte tokenizer
    im_end = bpe.token_to_id(STOP)
    assert end_token_ids(bpe) == [bpe.eos_id, im_end] and im_end == 4
    assert end_token_ids(bpe, [9, 1]) == [1, 4, 9]
    special = [bpe.token_to_id(t) for t in ("<|bos|>", "<|pad|>", "<think>", "<tool_call>")]
    for tok, ends in ((byte, [byte.eos_id]), (bpe, [bpe.eos_id, im_end])):
        c = json_constraint(tok, {"type": "integer"}, vocab_size=tok.vocab_size)()
        assert not c.allowed()[ends].any()  # nothing yet: cannot end
        c.accept(tok.encode("4", add_bos=False)[0])
        mask = c.allowed()
        assert mask[ends].all() and not c.finished()  # "4" is complete, "42" would be too
        assert mask[tok.encode("2", add_bos=False)[0]]
        if tok is bpe:
            assert not mask[special].any()
        c.accept(ends[-1])
        assert c.finished()
        # an object is complete at its closing brace: nothing but an end token may follow
        c = json_constraint(tok, {"type": "object"}, vocab_size=tok.vocab_size + 5)()
        for t in tok.encode("{}", add_bos=False):
            c.accept(t)
        assert c.finished()
        assert c.allowed().nonzero()[:, 0].tolist() == sorted(ends)


def test_mask_shape_and_accept_errors(bpe):
    byte = ByteTokenizer()
    factory = json_constraint(byte, {"type": "boolean"}, vocab_size=300)
    c = factory()
    mask = c.allowed()
    assert mask.shape == (300,) and mask.dtype == torch.bool
    assert mask.nonzero()[:, 0].tolist() == [ord("f"), ord("t")]
    assert not mask[258:].any()
    for bad in (ord("x"), 299, 258, -1, byte.eos_id):
        with pytest.raises(ValueError, match="not allowed"):
            c.accept(bad)
    c.accept(ord("t"))  # a refused token changed nothing
    # without allowed() first, accept asks the matcher
    with pytest.raises(ValueError, match="not allowed"):
        c.accept(ord("x"))
    for ch in "rue":
        c.accept(ord(ch))
    assert c.finished() and c.error == ""
    with pytest.raises(ValueError, match="stop_token_ids: .*out of range"):
        json_constraint(byte, None, vocab_size=300, stop_token_ids=[290])
    with pytest.raises(ValueError, match="stop_token_ids must be"):
        json_constraint(byte, None, vocab_size=300, stop_token_ids=[-1])
    # a model vocabulary smaller than the tokenizer's: the mask is cut at V
    small = json_constraint(bpe, None, vocab_size=bpe.vocab_size - 50)()
    assert small.allowed().shape == (bpe.vocab_size - 50,)


def test_factory_gives_independent_states():
    byte = ByteTokenizer()
    factory = json_constraint(byte, {"enum": ["ab", "cd"]}, vocab_size=258)
    a, b = factory(), factory()
    start = a.allowed().clone()
    for ch in '"a':
        a.accept(ord(ch))
    assert torch.equal(b.allowed(), start)
    b.accept(ord('"'))
    b.accept(ord("c"))
    assert a.allowed().nonzero()[:, 0].tolist() == [ord("b")]
    assert b.allowed().nonzero()[:, 0].tolist() == [ord("d")]
    assert torch.equal(factory().allowed(), start)
    assert llg_tokenizer(byte) is llg_tokenizer(byte)  # compiled once per tokenizer


@pytest.mark.parametrize(
    "schema,match",
    [
        ({"type": "foo"}, "Invalid type: foo"),
        ({"type": "string", "not": {"const": "x"}}, "Unimplemented keys"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "integer", "minimum": 5, "maximum": 2}, "Unsatisfiable"),
        ({"type": "string", "format": "colour"}, "Unknown format"),
        ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
        ({"$ref": "#/$defs/missing"}, "does not exist"),
        ({"enum": [math.nan]}, "not JSON"),
        ([{"type": "string"}], "must be an object"),
    ],
)
def test_invalid_or_unsupported_schemas_are_one_line_errors(schema, match):
    with pytest.raises(ValueError, match=match) as err:
        json_constraint(ByteTokenizer(), schema, vocab_size=258)
    assert "\n" not in str(err.value)


def test_lark_and_regex_grammars(models):
    tok, model = models["bpe"]
    V = model.config.vocab_size
    lark = 'start: "answer: " ("yes" | "no") " (" /[0-9]{2}/ "%)"'
    runs = constrained_sample(
        model, grammar_constraint(tok, lark, vocab_size=V), tok.encode("Q"), n=6, temperature=1.0
    )
    for ids, done in runs:
        text = tok.decode(ids)
        assert done and text.startswith("answer: ") and text.endswith("%)"), text
    factory = grammar_constraint(tok, r"[a-c]{3}-\d", syntax="regex", vocab_size=V)
    for ids, done in constrained_sample(model, factory, tok.encode("Q"), n=4, temperature=1.0):
        text = tok.decode(ids)
        assert done and len(text) == 5 and set(text[:3]) <= set("abc") and text[4].isdigit()
    with pytest.raises(ValueError, match="Lark grammar"):
        grammar_constraint(tok, "start: undefined_rule", vocab_size=V)
    with pytest.raises(ValueError, match="syntax"):
        grammar_constraint(tok, "x", syntax="gbnf", vocab_size=V)


def test_transformers_tokenizer(bpe, tmp_path):
    """A transformers fast tokenizer (a checkpoint's) works like the BPE it was saved from."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(bpe.save(tmp_path / "tok"))
    assert end_token_ids(hf) == end_token_ids(bpe)
    a = json_constraint(hf, SCHEMA, vocab_size=hf.vocab_size + 3)()
    b = json_constraint(bpe, SCHEMA, vocab_size=bpe.vocab_size + 3)()
    for t in bpe.encode('{"city": "Rome", "days": 3, "tags": ["x"]', add_bos=False):
        assert torch.equal(a.allowed(), b.allowed())
        a.accept(t)
        b.accept(t)
