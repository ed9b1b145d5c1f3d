"""`hybridlm speedrun`: the whole flow at toy size (every stage, inline rollouts), its report,
reuse of finished stages, invalidation downstream of a changed stage, and the model chain when
stages are skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hybridlm.report.card import render_report
from hybridlm.speedrun import Speedrun, SpeedrunConfig, load_config
from hybridlm.stages import STAGE_NAMES, STAGES
from test_report import check_report_html

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "speedrun.yaml"

# every stage a few steps long; RL rollouts in-process; harness tasks off (no data dir)
TINY = [
    "tokenizer.vocab_size=400",
    "tokenizer.max_chars=200000",
    "pretrain.data.sources.1.max_files=40",
    "pretrain.train.max_steps=12",
    "pretrain.train.eval_interval=6",
    "pretrain.train.checkpoint_interval=6",
    "pretrain.train.warmup_steps=2",
    "skip=[]",  # the long-context variant: midtrain and long_context too
    "midtrain.data.sources.1.max_files=40",
    "midtrain.train.max_steps=3",
    "midtrain.train.eval_interval=3",
    "midtrain.train.checkpoint_interval=3",
    "midtrain.train.warmup_steps=1",
    "long_context.data.sources.1.max_files=40",
    "long_context.data.sources.3.max_files=40",
    "long_context.train.max_steps=4",
    "long_context.train.eval_interval=4",
    "long_context.train.eval_batches=1",
    "long_context.train.checkpoint_interval=4",
    "long_context.train.warmup_steps=1",
    "long_context.ruler_samples=1",
    "long_context.ruler_tasks=[niah_single,cwe]",
    "sft.data.sources.0.max_rows=300",
    "sft.data.sources.1.max_rows=10",
    "sft.data.sources.2.max_rows=30",
    "sft.data.sources.3.max_rows=30",
    "sft.train.max_steps=6",
    "sft.train.eval_interval=6",
    "sft.train.checkpoint_interval=6",
    "sft.train.warmup_steps=2",
    "sft.sft.eval_generate=2",
    "sft.sft.max_new_tokens=24",
    "rl.train.max_steps=2",
    "rl.rl.executor=inline",
    "rl.data.eval_problems=4",
    "rl.rl.groups_per_step=2",
    "rl.rl.group_size=2",
    "rl.rl.max_draws=2",
    "rl.train.eval_interval=1",
    "rl.rl.max_new_tokens=16",
    "rl.rl.max_episode_tokens=32",
    "rl.data.difficulty_filter.problems=2",
    "rl.data.difficulty_filter.samples=2",
    "mtp_heal.train.max_steps=3",
    "mtp_heal.data.num_sequences=4",
    "mtp_heal.data.eval_prompts=2",
    "mtp_heal.data.gen_len=12",
    "mtp_heal.mtp_boost.eval_new_tokens=12",
    "mtp_heal.train.warmup_steps=1",
    "quantize.calib_samples=8",
    "quantize.eval_batches=1",
    "quantize.per_layer=false",
    "qad.train.max_steps=2",
    "qad.train.eval_interval=2",
    "qad.train.checkpoint_interval=2",
    "qad.train.warmup_steps=1",
    "qad.distill.eval_generate=2",
    "qad.distill.eval_max_new_tokens=16",
    "qad.qad.calib_samples=8",
    "qad.qad.text_batches=1",
    "qad.qad.teacher_replies=16",
    "qad.qad.correct_only=false",  # a few steps' model gets few answers right
    "eval.arithmetic_problems=4",
    "eval.text_batches=1",
    "eval.spec_prompts=1",
    "eval.spec_new_tokens=8",
    "eval.max_new_tokens=16",
    "eval.data_dir=does-not-exist",
    "eval.cache_contexts=[1024,65536]",
]


def stage_rows(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "stage"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    run = tmp_path_factory.mktemp("speedrun") / "run"
    cfg = load_config(str(CONFIG), TINY, out=str(run))
    result = Speedrun(cfg, progress=False).run()
    return cfg, run, result


def test_config_file_parses_and_rejects_mistakes(tmp_path):
    cfg = SpeedrunConfig.load(CONFIG)
    assert cfg.pretrain.data.sources[0].path == "{run}/curate/data"
    assert cfg.tokenizer.split_digits and cfg.quantize.recipes == ["nvfp4", "autoquant"]
    with pytest.raises(ValueError, match="unknown stages"):
        load_config(str(CONFIG), ["skip=[pretrian]"])
    with pytest.raises(ValueError, match="unknown sections"):
        SpeedrunConfig.from_dict({"pretrainn": {}})
    with pytest.raises(ValueError, match="unknown key"):
        load_config(str(CONFIG), ["sft.train.max_stpes=3"])
    with pytest.raises(ValueError, match="unknown model stages"):
        load_config(str(CONFIG), ["eval.spec_models=[dpo]"])
    with pytest.raises(ValueError, match="quantize.recipes"):
        load_config(str(CONFIG), ["quantize.recipes=[int4]"])
    with pytest.raises(ValueError, match="quantize.recipes"):
        load_config(str(CONFIG), ["quantize.recipes=[]"])
    with pytest.raises(ValueError, match="rl.group_size must be"):  # before any stage runs
        load_config(str(CONFIG), ["rl.rl.group_size=1"])
    with pytest.raises(ValueError, match="rl.steps is now rl.train.max_steps"):
        load_config(str(CONFIG), ["rl.steps=2"])
    with pytest.raises(ValueError, match="unknown stage"):
        Speedrun(cfg, only=["evaluate"])


def test_stage_registry():
    """The registry names each stage once, each reads only stages before it, every stage with
    a config has its section of the speedrun config, the report is the one derived stage, and
    every module that holds a stage is in the import-linter contract that keeps stage modules
    from importing each other."""
    import tomllib

    assert len(set(STAGE_NAMES)) == len(STAGES)
    for i, stage in enumerate(STAGES):
        assert set(stage.inputs) <= set(STAGE_NAMES[:i]), stage.name
        if stage.config is not None:
            assert isinstance(getattr(SpeedrunConfig(), stage.name), stage.config), stage.name
    assert [s.name for s in STAGES if s.derived] == ["report"]
    pyproject = tomllib.loads((CONFIG.parents[1] / "pyproject.toml").read_text())
    (independent,) = [
        c["modules"]
        for c in pyproject["tool"]["importlinter"]["contracts"]
        if c["type"] == "independence"
    ]
    holders = {s.run.__module__ for s in STAGES if not s.derived}
    assert holders <= set(independent), sorted(holders - set(independent))


def test_whole_flow_runs_and_writes_the_report(finished):
    cfg, run, result = finished
    for stage in STAGE_NAMES[:-1]:
        rec = json.loads((run / stage / "stage.json").read_text())
        assert rec["stage"] == stage and rec["seconds"] > 0
    assert [r["status"] for r in stage_rows(run)] == ["done"] * len(STAGE_NAMES)
    # the BPE the model was trained with travels with every later checkpoint
    tok = json.loads((run / "tokenizer" / "stage.json").read_text())["summary"]
    assert 300 < tok["vocab_size"] <= 400
    for d in ("rl/model", "mtp_heal/model", "quantize/nvfp4", "quantize/autoquant"):
        assert (run / d / "tokenizer.json").is_file(), d
    # the model chain: each stage starts from the previous stage's model
    mid = yaml.safe_load((run / "midtrain" / "run.yaml").read_text())
    assert mid["train"]["init_from"] == str(run / "pretrain")
    lc = yaml.safe_load((run / "long_context" / "run.yaml").read_text())
    assert lc["train"]["init_from"] == str(run / "midtrain") and lc["data"]["seq_len"] == 1024
    sft = yaml.safe_load((run / "sft" / "run.yaml").read_text())
    assert sft["train"]["init_from"] == str(run / "long_context")
    ext = json.loads((run / "long_context" / "stage.json").read_text())["summary"]
    assert ext["original_length"] == 256 and set(ext["ruler_after"]) == {"256", "512", "1024"}
    assert ext["ruler_gain"]["pairs"] == 2 and ext["short_bpb_before"] > 0
    assert (run / "long_context" / "long_context.png").stat().st_size > 5000
    assert yaml.safe_load((run / "rl" / "rl.yaml").read_text())["train"]["init_from"] == str(
        run / "sft"
    )
    # RL over the four environments, after the difficulty filter with the SFT model
    rl = json.loads((run / "rl" / "stage.json").read_text())["summary"]
    envs = {"sft_arithmetic", "calculator", "ifeval", "code_gen"}
    assert set(rl["difficulty_filter"]) == envs
    for f in rl["difficulty_filter"].values():
        assert f["pool"] == 2 and 0 <= f["pass@1"] <= f["pass@2"] <= 1
    heal = json.loads((run / "mtp_heal" / "stage.json").read_text())["summary"]
    assert heal["from"] == str(run / "rl" / "model")
    quant = json.loads((run / "quantize" / "stage.json").read_text())["summary"]
    assert quant["from"] == str(run / "mtp_heal" / "model")
    assert set(quant["models"]) == {"nvfp4", "autoquant"}
    for recipe in ("nvfp4", "autoquant"):
        assert (run / "quantize" / recipe / "hf_quant_config.json").is_file()
        assert quant["results"][recipe]["calibration"]["data"] == str(run / "sft")
    # eval: every model on the same held-out text and problems; quantised = healed +- small
    rows = [json.loads(x) for x in (run / "eval" / "metrics.jsonl").read_text().splitlines()]
    models = {r["model"]: r for r in rows if r["kind"] == "model"}
    assert list(models) == [
        "pretrain",
        "midtrain",
        "long_context",
        "sft",
        "rl",
        "mtp_heal",
        "nvfp4",
        "autoquant",
        "nvfp4_mixed_qad",
    ]
    for r in models.values():
        assert r["text_bpb"] > 0 and 0 <= r["exact_match"] <= 1 and r["problems"] == 4
        assert set(r["solved_by_env"]) <= envs
    # MTP healing trains only the head: the backbone's text loss is unchanged
    assert models["mtp_heal"]["text_loss"] == pytest.approx(models["rl"]["text_loss"], abs=1e-5)
    # QAD: the NVFP4 checkpoint's plan trained from the healed model, its step 0 = that PTQ
    qad = json.loads((run / "qad" / "stage.json").read_text())["summary"]
    assert qad["from"] == str(run / "mtp_heal" / "model") and qad["steps"] == 2
    # step 0 is the plan's PTQ with the Mamba projections moved to FP8 (`qad.formats`): close
    # to, not equal to, the all-NVFP4 checkpoint of the quantize stage
    ptq, nvfp4 = qad["figures"]["ptq"]["text_loss"], quant["results"]["nvfp4"]["quantized"]["loss"]
    assert ptq != nvfp4 and ptq == pytest.approx(nvfp4, rel=0.02)
    qad_meta = json.loads((run / "qad" / "hf" / "hf_quant_config.json").read_text())
    # the release assignment: FP8 Mamba projections, NVFP4 elsewhere (configs/speedrun.yaml)
    assert qad_meta["quantization"]["quant_algo"] == "MIXED_PRECISION"
    layers = qad_meta["quantization"]["quantized_layers"]
    assert {v["quant_algo"] for k, v in layers.items() if k.endswith("mixer.in_proj")} == {"FP8"}
    assert "NVFP4" in {v["quant_algo"] for v in layers.values()}
    for d in ("quantize/nvfp4", "qad/hf"):
        meta = json.loads((run / d / "hf_quant_config.json").read_text())
        assert meta["quantization"]["kv_cache_quant_algo"] == "FP8", d
    for recipe in ("nvfp4", "autoquant", "nvfp4_mixed_qad"):
        assert models[recipe]["text_loss"] != models["mtp_heal"]["text_loss"]
        assert abs(models[recipe]["text_bpb"] / models["mtp_heal"]["text_bpb"] - 1) < 0.05
    cache = [r for r in rows if r["kind"] == "cache_memory"]
    assert {r["model"] for r in cache} == {"speedrun", "nemotron-3-super"}
    # KV grows with the context, the Mamba state does not: at 64K the hybrid's cache is smaller
    assert all(r["attention_only_bytes"] > r["hybrid_bytes"] for r in cache if r["context"] > 2**15)
    spec = (run / "eval" / "mtp_heal" / "metrics.jsonl").read_text()
    assert "acceptance_length:greedy" in spec and "greedy_mismatches" in spec
    # the report: every plot, every section, a self-contained HTML page
    md = (run / "report.md").read_text()
    assert "SFT pass@1 / pass@2" in md and "| code_gen |" in md
    for png in ("loss", "bpb", "reward", "acceptance", "quantization", "cache_memory"):
        assert (run / "plots" / f"{png}.png").stat().st_size > 5000
        assert f"plots/{png}.png" in md
    for heading in ("Pretraining and SFT", "RL (GRPO)", "Speculative decoding", "quantisation"):
        assert heading in md
    assert "'?'" not in md and " ? x ?" not in md and "(T=?)" not in md  # every setting found
    page = (run / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 6 and "<table>" in page
    check_report_html(run / "report.html")
    assert result["stages"]["eval"]["models"][0]["model"] == "pretrain"
    # provenance: a toy run is marked as not the default one, with the settings that differ
    prov = json.loads((run / "provenance.json").read_text())
    changed = {o["key"] for o in prov["overrides"]}
    assert changed >= {"pretrain.train.max_steps", "rl.train.max_steps"}
    assert prov["is_default"] is False and "torch" in prov["versions"]
    assert {s: e["status"] for s, e in prov["stages"].items()} == dict.fromkeys(STAGE_NAMES, "run")
    assert md.startswith(f"# hybridlm speedrun — {run}\n") and "Not the default speedrun" in md


@pytest.mark.slow  # three more runs of the flow (~1 min); .ci/run runs it
def test_rerun_reuses_finished_stages_and_reruns_downstream_of_a_change(finished):
    _, run, _ = finished
    before = {s: json.loads((run / s / "stage.json").read_text()) for s in STAGE_NAMES[:-1]}
    cfg = load_config(str(CONFIG), TINY, out=str(run))
    Speedrun(cfg, progress=False).run()
    assert [r["status"] for r in stage_rows(run)[-len(STAGE_NAMES) :]] == ["reused"] * (
        len(STAGE_NAMES) - 1
    ) + ["done"]
    # a changed healing setting reruns healing and everything that reads its model
    cfg = load_config(str(CONFIG), [*TINY, "mtp_heal.train.max_steps=4"], out=str(run))
    Speedrun(cfg, progress=False).run()
    status = {r["stage"]: r["status"] for r in stage_rows(run)[-len(STAGE_NAMES) :]}
    assert status == {
        **{s: "reused" for s in ("curate", "tokenizer", "pretrain", "midtrain", "long_context")},
        **{s: "reused" for s in ("sft", "rl")},
        **{s: "done" for s in ("mtp_heal", "quantize", "qad", "eval", "report")},
    }
    after = json.loads((run / "mtp_heal" / "stage.json").read_text())
    assert after["fingerprint"] != before["mtp_heal"]["fingerprint"]
    assert json.loads((run / "pretrain" / "stage.json").read_text()) == before["pretrain"]
    # --force reruns a stage with the same settings, and everything that reads its outputs
    Speedrun(cfg, progress=False, force=["quantize"]).run()
    status = {r["stage"]: r["status"] for r in stage_rows(run)[-len(STAGE_NAMES) :]}
    assert status == {
        **{s: "reused" for s in ("curate", "tokenizer", "pretrain", "midtrain", "long_context")},
        **{s: "reused" for s in ("sft", "rl", "mtp_heal")},
        **{s: "done" for s in ("quantize", "qad", "eval", "report")},
    }


def _record(run: Path, stage: str, model: str) -> None:
    (run / stage).mkdir(parents=True)
    summary = {"model": model, "models": {"nvfp4": model}}
    (run / stage / "stage.json").write_text(
        json.dumps({"stage": stage, "fingerprint": stage, "seconds": 1.0, "summary": summary})
    )


def test_skipped_stages_hand_over_the_newest_model(tmp_path):
    cfg = load_config(str(CONFIG), ["skip=[rl]"], out=str(tmp_path))
    flow = Speedrun(cfg, progress=False)
    with pytest.raises(ValueError, match="needs a model from an earlier stage"):
        flow.settings("sft")
    _record(tmp_path, "pretrain", "P")
    _record(tmp_path, "sft", "S")
    _record(tmp_path, "rl", "R")  # from an earlier run: left out while rl is skipped
    assert flow.model_before("rl") == ("sft", "S")
    assert flow.model_before("mtp_heal") == ("sft", "S")  # rl skipped: healing starts from SFT
    assert flow.settings("mtp_heal")["train"]["init_from"] == "S"
    assert flow.settings("quantize")["checkpoint"] == "S"
    assert flow.tokenizer_spec() == "byte"  # no tokenizer stage: the byte tokenizer
    _record(tmp_path, "quantize", "Q")
    assert flow.model_before("mtp_heal") == ("sft", "S")  # a quantised model is not trained on
    assert [n for _, n, _ in flow.models()] == ["pretrain", "sft", "nvfp4"]
    flow = Speedrun(load_config(str(CONFIG), [], out=str(tmp_path)), progress=False)
    assert flow.model_before("mtp_heal") == ("rl", "R")


def test_interrupted_stage_keeps_its_outputs_only_for_the_same_settings(tmp_path):
    cfg = load_config(str(CONFIG), ["curate.inputs.0.max_files=30"], out=str(tmp_path))
    flow = Speedrun(cfg, only=["curate"], progress=False)
    out = tmp_path / "curate"
    out.mkdir()
    (out / "started.json").write_text(json.dumps({"fingerprint": flow.fingerprint("curate")}))
    (out / "partial").write_text("")  # e.g. a checkpoint of an interrupted run: resumed
    flow.run()
    assert (out / "partial").is_file() and (out / "stage.json").is_file()
    cfg = load_config(str(CONFIG), ["curate.inputs.0.max_files=31"], out=str(tmp_path))
    Speedrun(cfg, only=["curate"], progress=False).run()  # other settings: started afresh
    assert not (out / "partial").exists() and (out / "stage.json").is_file()


def test_quantize_data_options_name_missing_runs(tmp_path):
    from hybridlm.data.tokenizer import ByteTokenizer
    from hybridlm.train.run_data import pretraining_data
    from hybridlm.train.stages.quantize import sft_calibration_batches

    with pytest.raises(ValueError, match="no pretraining run config"):
        pretraining_data(tmp_path)
    with pytest.raises(ValueError, match="no SFT run config"):
        sft_calibration_batches(tmp_path / "sft", 8, ByteTokenizer())


def test_report_of_a_partial_run(tmp_path):
    out = render_report(tmp_path, STAGES)
    md = Path(out["report_md"]).read_text()
    assert "Stages finished: 0 of 11" in md and "The rl stage did not run." in md
    assert out["plots"] == []
    assert "<html>" in Path(out["report_html"]).read_text()


def test_a_stage_whose_checkpoints_are_all_damaged_says_how_to_start_it_again(tmp_path):
    from hybridlm.io.checkpoint import CheckpointError

    cfg = load_config(str(CONFIG), [], out=str(tmp_path))
    flow = Speedrun(cfg, only=["pretrain"], progress=False)
    ckpt = flow.stage_dir("pretrain") / "checkpoints" / "step_00000010"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text("{not json")
    seen = []

    def run(**kw):
        seen.append(kw)
        raise CheckpointError(
            "no intact checkpoint (step_00000010: bad); start again with --overwrite"
        )

    with pytest.raises(CheckpointError, match=r"hybridlm speedrun --force pretrain"):
        flow.continue_or_start("pretrain", run)
    assert seen == [{"resume": True, "overwrite": False}]
