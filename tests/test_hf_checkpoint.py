"""Model directories open in transformers as they are: `AutoTokenizer` + `AutoModelForCausalLM`
from the directory alone, the Jinja chat template token for token equal to `data.chat.render`,
config.json ids equal to the tokenizer's, generation_config.json, and greedy `generate` equal to
the project's own (`infer.generate.generate`), for the export-hf, training-run and SFT paths."""

import json
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from jinja2.exceptions import TemplateError  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from _tiny import tiny_train_model  # noqa: E402
from hybridlm import HybridLM, ModelConfig  # noqa: E402
from hybridlm.cli import main  # noqa: E402
from hybridlm.data.bpe import load_tokenizer, train_bpe  # noqa: E402
from hybridlm.data.chat import CHAT_TEMPLATE, STOP, render  # noqa: E402
from hybridlm.data.sft import LOW_EFFORT_TAG, ReasoningModes, apply_reasoning_modes  # noqa: E402
from hybridlm.data.tokenizer import ByteTokenizer  # noqa: E402
from hybridlm.infer.generate import generate  # noqa: E402
from hybridlm.interop.hf import save_pretrained  # noqa: E402
from hybridlm.io import load_model, load_tokenizer_for  # noqa: E402
from hybridlm.io.checkpoint import save_checkpoint  # noqa: E402
from hybridlm.presets import get_preset  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# ------------------------------------------------------------------------- conversations
PIECES = [
    "hello",
    "world",
    "Héllo wörld",
    "你好，世界",
    "🤖🚀",
    "2 + 2 = 4",
    "x = f(1, 2)",
    "  two leading spaces",
    "trailing space ",
    "new\nline",
    "\n\nblank lines\n",
    "tab\there",
    '{"json": [1, 2]}',
    "<think>",
    "a </tool_call> b",
    "-3 °C",
    "",
]
TOOLS = ["weather", "calculator", "search_web", "get_time"]


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) + rng.choice(["", " ", "\n", ". "]) for _ in range(4))


def _content(rng: random.Random):
    """A string, or OpenAI text parts (joined by a newline)."""
    if rng.random() < 0.2:
        return [{"type": "text", "text": _text(rng)} for _ in range(rng.randint(1, 3))]
    return _text(rng)


def _tool_call(rng: random.Random, i: int) -> dict:
    args = {"city": rng.choice(["Oslo", "Zürich", "東京"]), "n": rng.randint(0, 99)}
    if rng.random() < 0.3:
        args = {"query": _text(rng), "opts": {"deep": rng.random() < 0.5, "k": [1, 2.5, None]}}
    name = rng.choice(TOOLS)
    kind = rng.randrange(4)
    if kind == 0:  # OpenAI: arguments as a JSON string (what parse_assistant returns)
        fn = {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}
        return {"id": f"call_{i}", "type": "function", "function": fn}
    if kind == 1:  # arguments as an object
        return {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": name, "arguments": args},
        }
    if kind == 2:  # the flat form
        return {"name": name, "arguments": args}
    return {"function": {"name": name, "arguments": rng.choice(["", "{}"])}}  # no arguments


def _assistant(rng: random.Random, i: int) -> dict:
    msg: dict = {"role": "assistant", "content": _content(rng)}
    r = rng.random()
    if r < 0.4:
        msg["reasoning_content"] = _text(rng)
    elif r < 0.5:
        msg["reasoning"] = _text(rng)  # the other spelling
    elif r < 0.6:
        msg["reasoning_content"] = None  # absent: the other spelling, if any, counts
        if rng.random() < 0.5:
            msg["reasoning"] = _text(rng)
    if rng.random() < 0.3:
        msg["tool_calls"] = [_tool_call(rng, i * 10 + k) for k in range(rng.randint(1, 2))]
        if rng.random() < 0.5:
            msg["content"] = None
    elif rng.random() < 0.1:
        msg["content"] = ""
    return msg


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """`n` random conversations: system / developer prompts, multi-turn, reasoning traces, tool
    calls and results, ending on any role."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        conv: list[dict] = []
        if rng.random() < 0.6:
            conv.append(
                {"role": rng.choice(["system", "system", "developer"]), "content": _text(rng)}
            )
        for t in range(rng.randint(1, 4)):
            conv.append({"role": "user", "content": _content(rng)})
            msg = _assistant(rng, i * 100 + t)
            conv.append(msg)
            for call in msg.get("tool_calls") or []:
                conv.append({"role": "tool", "tool_call_id": call.get("id"), "content": _text(rng)})
            if msg.get("tool_calls"):
                conv.append({"role": "assistant", "content": _text(rng)})
        out.append(conv[: rng.randint(1, len(conv))] if rng.random() < 0.5 else conv)
    return out


@pytest.fixture(scope="module")
def convs() -> list[list[dict]]:
    base = conversations(72)
    # the SFT reasoning modes (reasoning off, low effort, budget), as training applies them
    modes = ReasoningModes(reasoning_off=0.25, low_effort=0.25, budget=0.25, seed=1)
    out, counts = apply_reasoning_modes(base, modes, ByteTokenizer())
    assert all(counts[k] >= 3 for k in ("regular", "reasoning_off", "low_effort", "budget"))
    return out


@pytest.fixture(scope="module")
def bpe(convs):
    texts = [render(c) for c in convs] + [p * 20 for p in PIECES]
    return train_bpe(texts * 3, vocab_size=420)


@pytest.fixture(scope="module")
def tokenizers(bpe, tmp_path_factory):
    """(ours, transformers') for the trained BPE and the byte tokenizer, saved and reloaded."""
    out = {}
    for name, tok in (("bpe", bpe), ("byte", ByteTokenizer())):
        path = tok.save(tmp_path_factory.mktemp(name))
        assert type(load_tokenizer(path)) is type(tok)
        out[name] = (tok, AutoTokenizer.from_pretrained(path))
    return out


# ------------------------------------------------------------------------- chat template
@pytest.mark.parametrize("name", ["bpe", "byte"])
def test_chat_template_equals_render_token_for_token(convs, tokenizers, name):
    ours, hf = tokenizers[name]
    assert hf.chat_template == CHAT_TEMPLATE
    assert len(convs) >= 50
    seen = {"tool": 0, "think": 0, LOW_EFFORT_TAG: 0, "/no_think": 0, "budget": 0, "parts": 0}
    for conv in convs:
        for gp in (False, True):
            text = render(conv, add_generation_prompt=gp)
            kw = dict(add_generation_prompt=gp, return_dict=False)
            assert hf.apply_chat_template(conv, tokenize=False, **kw) == hf.bos_token + text
            ids = hf.apply_chat_template(conv, tokenize=True, **kw)
            assert ids == ours.encode(text), (conv, gp)
        full = render(conv, add_generation_prompt=False)
        seen["tool"] += "<tool_call>" in full and "<|im_start|>tool" in full
        seen["think"] += "<think>\n" in full
        seen["budget"] += "Reasoning budget:" in full
        seen["parts"] += any(isinstance(m.get("content"), list) for m in conv)
        for tag in (LOW_EFFORT_TAG, "/no_think"):
            seen[tag] += tag in full
    assert min(seen.values()) >= 3, seen


def test_chat_template_rejects_what_render_rejects(tokenizers):
    _, hf = tokenizers["bpe"]
    bad = [
        [{"role": "robot", "content": "x"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
        [{"role": "user"}],
        [{"role": "assistant", "reasoning_content": "only thinking"}],
        [{"role": "user", "content": "x", "tool_calls": [{"name": "f", "arguments": {}}]}],
        [{"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}],
    ]
    for conv in bad:
        with pytest.raises(ValueError):
            render(conv)
        with pytest.raises(TemplateError, match=r"messages\[0\]"):
            hf.apply_chat_template(conv, tokenize=False)


# ------------------------------------------------------------------------- model directories
def _tiny_nemotron(vocab: int) -> ModelConfig:
    cfg = tiny_train_model()  # Mamba, LatentMoE, attention + an MTP head (transformers skips it)
    cfg.vocab_size = vocab
    return cfg


def _tiny_olmo(vocab: int) -> ModelConfig:
    cfg = get_preset("tiny-olmo")
    cfg.vocab_size, cfg.d_model, cfg.pattern, cfg.mlp.hidden = vocab, 64, "*-*-", 128
    cfg.attention.num_heads, cfg.attention.num_kv_heads, cfg.attention.head_dim = 4, 2, 16
    cfg.validate()
    return cfg


def check_model_dir(path: Path, ours_model: HybridLM, ours_tok, prompts: list) -> None:
    """The directory alone: tokenizer files + chat template + generation config, config.json ids
    equal to the tokenizer's, and transformers' greedy `generate` equal to ours (which stops at
    the same ids: EOS and the end-of-turn token)."""
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= names
    assert {"tokenizer_config.json", "chat_template.jinja"} <= names
    hf_tok = AutoTokenizer.from_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    gen = json.loads((path / "generation_config.json").read_text())
    ids = (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == ids
    assert (gen["bos_token_id"], gen["pad_token_id"]) == (ids[0], ids[2])
    stop_ids = (
        gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    )
    assert stop_ids[0] == ours_tok.eos_id == hf_tok.eos_token_id
    end_of_turn = hf_tok.convert_tokens_to_ids(STOP) if STOP in hf_tok.get_vocab() else None
    assert stop_ids == (
        [ours_tok.eos_id, end_of_turn] if end_of_turn is not None else [ours_tok.eos_id]
    )

    hf_model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert hf_model.generation_config.eos_token_id in (stop_ids, stop_ids[0])
    for prompt in prompts:
        if isinstance(prompt, str):
            enc = hf_tok(prompt, return_tensors="pt")
            mine = ours_tok.encode(prompt)
        else:  # a conversation, through the chat template
            enc = hf_tok.apply_chat_template(
                prompt, add_generation_prompt=True, return_tensors="pt"
            )
            mine = ours_tok.encode(render(prompt, add_generation_prompt=True))
        assert enc["input_ids"][0].tolist() == mine
        with torch.no_grad():
            theirs = hf_model.generate(**enc, max_new_tokens=12, do_sample=False)
        theirs = theirs[0, enc["input_ids"].shape[1] :].tolist()
        reference = generate(ours_model, torch.tensor([mine]), 12)[0].tolist()
        stop = next((i for i, t in enumerate(reference) if t in stop_ids), None)
        assert theirs == (reference if stop is None else reference[: stop + 1])


PROMPTS = [
    "Once upon a time",
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}],
]


def test_export_hf_of_a_training_checkpoint(bpe, tmp_path, capsys):
    """`hybridlm export-hf --checkpoint <run>`: the run's BPE tokenizer travels with the model."""
    tok_dir = bpe.save(tmp_path / "tok")
    model = HybridLM(_tiny_nemotron(448), seed=0).eval()
    run_config = {"model": model.config.to_dict(), "data": {"tokenizer": str(tok_dir)}}
    save_checkpoint(
        tmp_path / "run", step=1, model=model, optimizer=None, meta={"run_config": run_config}
    )
    assert (
        main(["export-hf", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf")])
        == 0
    )
    ours = load_model(tmp_path / "run").eval()  # the project's own path
    check_model_dir(tmp_path / "hf", ours, load_tokenizer_for(tmp_path / "run"), PROMPTS)
    # and back: the exported directory is the same model and tokenizer for hybridlm
    assert type(load_tokenizer_for(tmp_path / "hf")).__name__ == "BPETokenizer"
    assert load_tokenizer_for(tmp_path / "hf").sha256 == bpe.sha256


def test_export_hf_of_a_preset_carries_the_byte_tokenizer(tmp_path, capsys):
    cfg_path = tmp_path / "olmo.json"
    cfg_path.write_text(json.dumps(_tiny_olmo(320).to_dict()))
    assert main(["export-hf", "--config", str(cfg_path), "--out", str(tmp_path / "hf")]) == 0
    assert isinstance(load_tokenizer_for(tmp_path / "hf"), ByteTokenizer)
    ours = load_model(tmp_path / "hf").eval()
    check_model_dir(tmp_path / "hf", ours, ByteTokenizer(), PROMPTS)
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (256, 257, 257)
    text = "Héllo 🤖\n\t<|im_start|>"
    assert hf_tok(text)["input_ids"] == ByteTokenizer().encode(text)
    assert hf_tok.decode(ByteTokenizer().encode(text), skip_special_tokens=True) == text


def test_sft_run_writes_a_transformers_directory(bpe, tmp_path):
    """A training run's own export (`<out>/hf` at the end of an SFT run)."""
    from hybridlm.train.config import TrainConfig
    from hybridlm.train.post_training import ChatSource, SFTDataConfig
    from hybridlm.train.stages.sft import SFTConfig, SFTRunConfig, run_sft

    tok_dir = bpe.save(tmp_path / "tok")
    cfg = SFTRunConfig(
        model=_tiny_nemotron(448),
        data=SFTDataConfig(
            sources=[ChatSource(kind="arithmetic", max_rows=24, digits=1, seed=3)],
            tokenizer=str(tok_dir),
            seq_len=128,
            batch_size=4,
            held_out=4,
        ),
        train=TrainConfig(
            lr=3e-3,
            warmup_steps=1,
            max_steps=2,
            eval_interval=0,
            checkpoint_interval=0,
            out_dir=str(tmp_path / "sft"),
            progress=False,
            plot=False,
        ),
        sft=SFTConfig(eval_generate=0),
    )
    result = run_sft(cfg)
    assert result["hf"] == str(tmp_path / "sft" / "hf")
    ours = load_model(tmp_path / "sft").eval()  # its last training checkpoint
    check_model_dir(tmp_path / "sft" / "hf", ours, bpe, PROMPTS)


def test_modelopt_export_carries_the_tokenizer(tmp_path):
    from hybridlm.interop.modelopt import export_modelopt
    from hybridlm.precision import ptq

    model = HybridLM(tiny_train_model(), seed=0).eval()
    stats = ptq.calibrate(model, [{"input_ids": torch.randint(0, 256, (1, 16))}])
    ptq.quantize_model(model, ptq.recipe_plan(model, "fp8"), stats)
    export_modelopt(model, tmp_path, tokenizer=ByteTokenizer())
    config = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" in config and (tmp_path / "hf_quant_config.json").is_file()
    hf_tok = AutoTokenizer.from_pretrained(tmp_path)
    assert config["eos_token_id"] == hf_tok.eos_token_id == 257
    assert (tmp_path / "generation_config.json").is_file() and hf_tok.chat_template
    assert isinstance(load_tokenizer_for(tmp_path), ByteTokenizer)


def test_a_tokenizer_larger_than_the_model_is_refused(bpe, tmp_path):
    model = HybridLM(_tiny_nemotron(300), seed=0)
    with pytest.raises(ValueError, match=f"{bpe.vocab_size} ids but the model only 300"):
        save_pretrained(model, tmp_path / "x", tokenizer=bpe)
    assert not (tmp_path / "x" / "config.json").exists()
