"""The speedrun report card: rendered from a synthetic run directory (no training), then checked
as a reader's browser would take it: well-formed HTML, every image a valid PNG, the provenance
block present, stage times formatted for people, rates with their confidence intervals.
`check_report_html` is also applied to the real toy run in test_speedrun.py."""

from __future__ import annotations

import base64
import json
import re
import shutil
import struct
import subprocess
import sys
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest

from hybridlm.provenance import collect, config_diff, git_state
from hybridlm.report.card import render_report
from hybridlm.report.doc import fmt_duration
from hybridlm.report.stats import reward_window, wilson_interval
from hybridlm.speedrun import SpeedrunConfig
from hybridlm.stages import STAGE_NAMES, STAGES

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "speedrun.yaml"
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"}


# ---------------------------------------------------------------------------- the checker
class _Page(HTMLParser):
    """Tags nest properly; collects images, ids and tables (rows of cell texts)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.imgs: list[dict[str, str]] = []
        self.ids: dict[str, str] = {}  # id -> the text inside the element
        self.tables: list[list[list[str]]] = []
        self._open_ids: list[tuple[str, int, int]] = []  # id, depth, text index
        self._cell: list[str] | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "img":
            self.imgs.append(a)
        if tag in VOID:
            return
        self.stack.append(tag)
        if "id" in a:
            self._open_ids.append((a["id"], len(self.stack), len(self._text)))
        if tag == "table":
            self.tables.append([])
        elif tag == "tr" and self.tables:
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1] if self.stack else None}>")
            return
        if self._open_ids and self._open_ids[-1][1] == len(self.stack):
            ident, _, start = self._open_ids.pop()
            self.ids[ident] = "".join(self._text[start:])
        self.stack.pop()
        if tag in ("td", "th") and self._cell is not None and self.tables:
            self.tables[-1][-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data: str) -> None:
        self._text.append(data)
        if self._cell is not None:
            self._cell.append(data)


def _png_ok(data: bytes) -> bool:
    """PNG signature, IHDR first, IEND last, every chunk's CRC right."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return False
    pos, kinds = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        if zlib.crc32(kind + body) != crc:
            return False
        kinds.append(kind)
        pos += 12 + length
    return kinds[0] == b"IHDR" and kinds[-1] == b"IEND"


# a duration as the report writes it: 0.04 s, 9.2 s, 1:03 min, 1:02:03 h (optionally "when run")
DURATION = re.compile(r"^(–|\d{1,2}\.\d{1,2} s|\d+:\d\d min|\d+:\d\d:\d\d h)( when run)?$")
LONG_FLOAT = re.compile(r"\d*\.\d{5,}|\d{5,}\.\d+")


def check_report_html(page: Path) -> _Page:
    """Assert what a reader relies on in report.html; returns the parsed page."""
    text = page.read_text()
    parsed = _Page()
    parsed.feed(text)
    parsed.close()
    assert text.lstrip().lower().startswith("<!doctype html>")
    assert not parsed.errors, parsed.errors[:5]
    assert parsed.stack == [], f"unclosed tags {parsed.stack}"
    assert parsed.imgs, "no images"
    for img in parsed.imgs:
        src = img.get("src", "")
        assert img.get("alt"), f"image without alt text: {src[:60]}"
        if src.startswith("data:"):
            assert src.startswith("data:image/png;base64,"), src[:40]
            assert _png_ok(base64.b64decode(src.split(",", 1)[1], validate=True)), img["alt"]
        else:
            assert (page.parent / src).is_file(), src
    # provenance first: the block is there, before the stage table, with what a reader needs
    assert "provenance" in parsed.ids, "no provenance block"
    block = parsed.ids["provenance"]
    for word in ("command", "settings", "code", "versions", "threads", "CPU", "date"):
        assert word in block, f"provenance has no {word!r}"
    assert text.index("id='provenance'") < text.index("<h2>Stages</h2>")
    title = re.search(r"<title>(.*?)</title>", text).group(1)
    assert "speedrun: speedrun" not in title and "—" in title
    # stage times: human durations, never a raw float
    stages = next(t for t in parsed.tables if t and "wall time" in t[0])
    col = stages[0].index("wall time")
    for row in stages[1:]:
        assert DURATION.match(row[col]), f"stage time {row[col]!r}"
        assert not LONG_FLOAT.search(row[col]), row[col]
    # no figure in any table carries more than 4 significant digits after the point
    for table in parsed.tables:
        for row in table[1:]:
            for cell in row:
                if not cell.startswith(("/", "`")):  # paths and code
                    assert not LONG_FLOAT.search(cell), f"long float in {cell!r}"
    return parsed


# ---------------------------------------------------------------------------- a synthetic run
def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _stage(run: Path, name: str, summary: dict, seconds: float) -> None:
    (run / name).mkdir(parents=True, exist_ok=True)
    rec = {"stage": name, "fingerprint": name, "seconds": seconds, "summary": summary}
    (run / name / "stage.json").write_text(json.dumps(rec))


def fake_run(run: Path, *, overrides: list[str] | None = None) -> Path:
    """A run directory with every stage's files, shaped as the speedrun writes them."""
    from hybridlm.speedrun import load_config

    cfg = load_config(str(CONFIG), overrides or [], out=str(run))
    run.mkdir(parents=True, exist_ok=True)
    cfg.save(run / "speedrun.yaml")
    prov = collect(
        argv=["hybridlm", "speedrun", "--out", str(run), *(f"--set={o}" for o in overrides or [])],
        config=cfg.to_dict(),
        defaults=SpeedrunConfig.load(CONFIG).to_dict(),
        defaults_path=CONFIG,
        threads={"threads": 2, "cpus": 2, "source": "free cores"},
    )
    times = {"curate": 8.66, "tokenizer": 0.19, "pretrain": 48.7, "sft": 4.29, "rl": 0.86}
    times |= {"mtp_heal": 12.1, "quantize": 9.69, "eval": 612.4, "report": 2.07}
    # the default flow skips midtrain and long_context
    prov["stages"] = {
        s: {"status": "run", "seconds": times[s]} if s in times else {"status": "skipped"}
        for s in STAGE_NAMES
    }
    prov["stages"]["curate"] = {"status": "reused", "seconds_when_run": 8.6635}
    prov |= {"run_dir": str(run), "wall_seconds": 690.12, "finished": prov["started"]}
    (run / "provenance.json").write_text(json.dumps(prov))

    _stage(
        run,
        "curate",
        {
            "output": {"docs": 211, "chars": 715232},
            "stages": [{"stage": "length", "docs_in": 407, "docs_out": 352, "seconds": 0.0021}],
        },
        times["curate"],
    )
    _stage(run, "tokenizer", {"path": "tok", "vocab_size": 400, "bytes_per_token": 1.79}, 0.19)
    _stage(run, "pretrain", {"step": 12, "tokens_seen": 24576, "eval": {"eval_bpb": 3.934}}, 48.7)
    pre = [{"kind": "train", "step": s, "ce": 5 - s / 10, "mtp": 5.1 - s / 10} for s in (2, 4, 6)]
    pre += [{"kind": "eval", "step": 6, "eval_loss": 4.6, "eval_bpb": 3.934, "eval_tokens": 8160}]
    _write_jsonl(run / "pretrain" / "metrics.jsonl", pre)
    _stage(run, "sft", {"step": 6, "eval": {"eval_loss": 3.69, "eval_accuracy": 0.5}}, 4.29)
    _write_jsonl(
        run / "sft" / "metrics.jsonl",
        [
            {"kind": "train", "step": 6, "loss": 5.0, "nll_token": 3.76},
            {"kind": "eval", "step": 6, "eval_loss": 3.69, "eval_accuracy": 0.5},
        ],
    )
    _stage(run, "rl", {"model": "rl/model"}, 0.86)
    rl = [{"kind": "train", "step": s, "reward_mean": s / 10} for s in range(1, 7)]
    rl += [{"kind": "eval", "step": s, "all/solved": 0.25, "all/count": 4.0} for s in (0, 6)]
    _write_jsonl(run / "rl" / "metrics.jsonl", rl)
    _stage(
        run,
        "mtp_heal",
        {"draft_len": 3, "acceptance_length": {"T0": [3.5, 3.7], "T1": [3.1, 3.3]}},
        12.1,
    )
    by_prompt = [[[3, 2, 1], [3, 3, 2]], [[2, 1, 1], [3, 2, 2]], [[3, 3, 2], [3, 3, 3]]]
    _write_jsonl(
        run / "mtp_heal" / "metrics.jsonl",
        [
            {
                "kind": "acceptance",
                "when": when,
                "temperature": 1.0,
                "draft_len": 3,
                "steps": 9,
                "acceptance_length": 3.1,
                "acceptance_by_position": [0.89, 0.75, 0.57],
                "prompts": 3,
                "by_prompt": by_prompt,
            }
            for when in ("before", "after")
        ],
    )
    groups = [
        {"group": f"layers.{i}.mixer.shared_experts.down_proj", "format": "nvfp4",
         "loss_delta": (-1) ** i * 1e-4 * (i + 1)}
        for i in range(20)
    ]  # fmt: skip
    quant = {
        "calibration": {"tokens": 2048, "data": "sft"},
        "eval": {"batches": 1, "tokens": 2040},
        "unquantized": {"loss": 4.75, "bpb": 4.2718},
        "quantized": {"loss": 4.7531, "bpb": 4.2727, "effective_bits": 4.5},
        "delta": {"loss": 0.0011, "loss_rel": 0.0003, "bpb_rel": 0.0003},
        "plan": {"a": "nvfp4", "b": "nvfp4"},
        "groups": groups,
    }
    (run / "quantize" / "nvfp4").mkdir(parents=True)
    (run / "quantize" / "nvfp4" / "quantize.json").write_text(json.dumps(quant))
    _stage(run, "quantize", {"results": {"nvfp4": quant}}, 9.69)
    models = [
        {"kind": "model", "model": m, "stage": s, "text_loss": 4.75, "text_bpb": 4.27,
         "text_tokens": 2040, "exact_match": p, "exact_match_stderr": 0.1, "problems": 50}
        for m, s, p in (("pretrain", "pretrain", 0.0), ("mtp_heal", "mtp_heal", 0.42),
                        ("nvfp4", "quantize", 0.4))
    ]  # fmt: skip
    cache = [
        {"kind": "cache_memory", "model": "speedrun", "pattern": "MEM*EME", "context": c,
         "hybrid_bytes": 1000 * c + 10**6, "attention_only_bytes": 7000 * c}
        for c in (1024, 65536)
    ]  # fmt: skip
    _write_jsonl(run / "eval" / "metrics.jsonl", models + cache)
    spec = [
        {"kind": "eval", "model": "mtp_heal", "task": "spec_bench", "metric": m, "value": v,
         "stderr": se, "n": 20}
        for m, v, se in (("acceptance_length:greedy", 4.2, 0.3), ("acceptance@1:greedy", 0.8, 0.05),
                         ("acceptance@2:greedy", 0.6, 0.06), ("speedup", 1.5, None))
    ]  # fmt: skip
    _write_jsonl(run / "eval" / "mtp_heal" / "metrics.jsonl", spec)
    _stage(run, "eval", {"models": models}, 612.4)
    return run


# ---------------------------------------------------------------------------- tests
def test_report_html_is_valid_and_shows_provenance(tmp_path):
    overrides = ["pretrain.train.max_steps=12", "rl.train.max_steps=6"]
    run = fake_run(tmp_path / "run", overrides=overrides)
    out = render_report(run, STAGES)
    page = check_report_html(Path(out["report_html"]))
    assert len(page.imgs) == len(out["plots"]) == 6
    md = Path(out["report_md"]).read_text()
    head = md[: md.index("## Stages")]
    # a shortened run says so before anything else, with the settings that differ
    assert md.startswith(f"# hybridlm speedrun — {run}\n")
    assert "Not the default speedrun: 2 settings differ" in head
    assert "| `pretrain.train.max_steps` | 1000 | 12 |" in head
    assert "| `rl.train.max_steps` | 40 | 6 |" in head
    assert "hybridlm speedrun --out" in head and "torch " in head and "python " in head
    assert "threads=2" in head  # configure_threads' result, as recorded
    # stage times for people; a reused stage says so
    assert "| eval | run | 10:12 min |" in md
    assert "| curate | reused: from an earlier run | 8.7 s when run |" in md
    assert "0.8122" not in md and "612.4" not in md
    # every figure named after its data; two bpb figures on different batches, two names
    assert "**trainer bpb**" in md and "**eval bpb**" in md and "8,160 tokens" in md
    assert "trainer bpb: 3.934 at step 12" in md
    # the RL eval set's size comes from the run's config (rl.data.eval_problems)
    assert "fraction of 160 held-out problems solved greedily" in md
    # honest step counts: 6 RL steps -> first / last 3
    assert "mean of the first / last 3 of 6 steps: 0.200 -> 0.500" in md
    assert "first / last 10" not in md
    # rates with Wilson intervals and n; the eval headline names its metric
    lo, hi = wilson_interval(21, 50)
    assert f"0.42 [{lo:.2f}, {hi:.2f}] (95% CI, n=50)" in md
    assert "0.00 [0.00, 0.07] (95% CI, n=50)" in md  # 0 of 50 is not "0 ± 0"
    assert "held-out solved (RL eval set, n=50): pretrain 0.00" in md
    assert "4.20 ± 0.59 (95% CI, n=20 prompts)" in md  # SPEED-Bench: 1.96 x bootstrap s.e.
    # acceptance intervals from the per-prompt counts
    assert re.search(r"0\.89 \[0\.\d\d, 1\.00\]", md)


def test_report_without_provenance_says_so(tmp_path):
    run = fake_run(tmp_path / "run")
    (run / "provenance.json").unlink()
    md = Path(render_report(run, STAGES)["report_md"]).read_text()
    assert "No provenance.json in this run directory" in md
    assert "| pretrain | finished | 48.7 s |" in md  # times from the stage records


def test_default_settings_are_marked_default(tmp_path):
    md = Path(render_report(fake_run(tmp_path / "run"), STAGES)["report_md"]).read_text()
    assert "The default speedrun" in md and "Not the default" not in md


def test_formatting_helpers():
    assert [fmt_duration(s) for s in (0.0412, 9.23, 48.7, 63.4, 612.4, 3723.0)] == [
        "0.04 s",
        "9.2 s",
        "48.7 s",
        "1:03 min",
        "10:12 min",
        "1:02:03 h",
    ]
    lo, hi = wilson_interval(0, 4)  # Wilson at 0 / n: a real upper bound, not 0
    assert lo == 0.0 and hi == pytest.approx(0.4899, abs=1e-4)
    lo, hi = wilson_interval(21, 50)
    assert lo == pytest.approx(0.2937, abs=1e-4) and hi == pytest.approx(0.5577, abs=1e-4)
    assert [reward_window(n) for n in (0, 1, 2, 6, 20, 30)] == [0, 1, 1, 3, 10, 10]


def test_provenance_pieces(tmp_path):
    diff = config_diff({"a": {"b": 1, "c": [1, 2]}, "d": "x"}, {"a": {"b": 2, "c": [1, 2]}})
    assert diff == [
        {"key": "a.b", "default": 2, "value": 1},
        {"key": "d", "default": None, "value": "x"},
    ]
    state = git_state(tmp_path)  # not a checkout (or no git at all): said, not raised
    assert state["commit"] is None and state["note"]


def test_speedrun_writes_provenance_and_report_rerenders(tmp_path):
    """The flow's own provenance.json, from a run of one cheap stage; the report re-renders
    from the files alone."""
    from hybridlm.speedrun import Speedrun, load_config

    cfg = load_config(str(CONFIG), ["curate.inputs.0.max_files=5"], out=str(tmp_path))
    info = {"threads": 1, "source": "--threads"}
    Speedrun(cfg, only=["curate"], progress=False, threads=info, argv=["hybridlm", "x"]).run()
    prov = json.loads((tmp_path / "provenance.json").read_text())
    assert prov["command"] == "hybridlm x" and prov["threads"]["configured"] == info
    assert (
        prov["overrides"] == [{"key": "curate.inputs.0.max_files", "default": 0, "value": 5}]
        and prov["is_default"] is False
    )
    assert prov["stages"]["curate"]["status"] == "run"
    assert prov["stages"]["pretrain"]["status"] == "not run"
    assert {"python", "torch", "numpy"} <= set(prov["versions"])
    assert prov["cpu"]["logical_cores"] >= 1 and "torch_threads" in prov["threads"]
    rec = json.loads((tmp_path / "curate" / "stage.json").read_text())
    assert rec["run"]["started"] == prov["started"]
    out = subprocess.run(
        [sys.executable, "-m", "hybridlm.cli", "report", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "report_html" in out.stdout
    md = (tmp_path / "report.md").read_text()
    assert "Not the default speedrun: 1 setting differs" in md and "| curate | run |" in md


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
def test_report_renders_in_a_headless_browser(tmp_path):
    run = fake_run(tmp_path / "run")
    page = Path(render_report(run, STAGES)["report_html"])
    png = tmp_path / "shot.png"
    subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={png}",
         "--window-size=1200,3000", page.as_uri()],
        capture_output=True,
        timeout=120,
        check=True,
    )  # fmt: skip
    assert _png_ok(png.read_bytes()) and png.stat().st_size > 20_000


def test_headline_rows_skip_a_torn_last_line(tmp_path):
    """A killed run's metrics.jsonl may end in half a row: the stage headlines read the rest
    (as the report's sections do)."""
    from hybridlm.rl.learner import STAGE as RL
    from hybridlm.stage import Report

    (tmp_path / "rl").mkdir()
    (tmp_path / "rl" / "metrics.jsonl").write_text(
        '{"kind": "train", "reward_mean": 0.1}\n{"kind": "tra'
    )
    report = Report(tmp_path, {}, {})
    assert report.rows("rl", "train") == [{"kind": "train", "reward_mean": 0.1}]
    assert RL.headline({}, report) == "train reward (first -> last step of 1): 0.100 -> 0.100"
