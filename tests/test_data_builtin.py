"""The packaged evaluation sets (`hybridlm.data.builtin`): counts, licences, lookups under a
user folder, package-data globs, and byte equality with the originals in ../shared/data when
that folder exists."""

import fnmatch
import gzip
import hashlib
from pathlib import Path

import pytest

from hybridlm.data import builtin

ROOT = Path(__file__).resolve().parents[1]


def test_packaged_sets_load_with_their_counts():
    test = builtin.read_jsonl(builtin.path(builtin.GSM8K_TEST))
    assert len(test) == 1319 and test[0]["answer"].endswith("#### 18")
    assert len(builtin.read_jsonl(builtin.path(builtin.GSM8K_TRAIN))) == 7473
    he = builtin.read_jsonl(builtin.path(builtin.HUMANEVAL))
    assert len(he) == 164 and he[0]["task_id"] == "HumanEval/0"
    text = builtin.read_text(builtin.path(builtin.TINYSHAKESPEARE))
    assert len(text) == 1_115_394 and text.startswith("First Citizen:\nBefore we proceed")


def test_every_set_ships_its_licence_and_attribution():
    for name in builtin.NAMES:
        folder = builtin.path(name).parent
        assert "MIT" in (folder / "LICENSE").read_text(), name
        readme = (folder / "README.md").read_text()
        assert "Source: https://github.com/" in readme and "Licence:" in readme, name
        assert "Changes:" in readme, name


def test_package_data_globs_cover_every_data_file():
    tomllib = pytest.importorskip("tomllib")
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = cfg["tool"]["setuptools"]["package-data"]["hybridlm.data.builtin"]
    files = [p for p in builtin.ROOT.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")]
    assert len(files) == 4 + 3 + 3  # 4 data files, a LICENSE and a README.md per folder
    for f in files:
        rel = f.relative_to(builtin.ROOT).as_posix()
        assert any(fnmatch.fnmatch(rel, g) for g in globs), rel


def test_lookup_under_a_user_folder_and_errors(tmp_path):
    missing = builtin.path(builtin.GSM8K_TEST, tmp_path)
    assert missing == tmp_path / "gsm8k" / "test.jsonl" and not missing.exists()
    (tmp_path / "gsm8k").mkdir()
    packed = tmp_path / "gsm8k" / "test.jsonl.gz"
    packed.write_bytes(gzip.compress(b'{"question": "q", "answer": "#### 1"}\n\n'))
    assert builtin.path(builtin.GSM8K_TEST, tmp_path) == packed  # only the .gz exists
    assert builtin.read_jsonl(packed) == [{"question": "q", "answer": "#### 1"}]
    plain = tmp_path / "gsm8k" / "test.jsonl"
    plain.write_text('{"a": 1}\n{"a": 2}\nnot json\n')
    assert builtin.path(builtin.GSM8K_TEST, tmp_path) == plain  # the plain file first
    assert builtin.path(builtin.GSM8K_TEST, str(tmp_path)) == plain
    assert builtin.read_jsonl(plain, limit=2) == [{"a": 1}, {"a": 2}]
    with pytest.raises(ValueError, match=r"test\.jsonl:3: not JSON"):
        builtin.read_jsonl(plain)
    with pytest.raises(ValueError, match="no such file"):
        builtin.read_text(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="no packaged data set 'mmlu/test.jsonl'"):
        builtin.path("mmlu/test.jsonl")
    assert builtin.path(builtin.HUMANEVAL, "") == builtin.path(builtin.HUMANEVAL)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_packaged_files_equal_the_originals(shared_data):
    """Compression is the only change: the packaged bytes decompress to the original files
    (HumanEval ships as the upstream .gz itself), and the licences are the upstream ones."""
    for name in builtin.NAMES:
        original = (shared_data / name).read_bytes()
        packed = builtin.path(name).read_bytes()
        ours = packed if name.endswith(".gz") else gzip.decompress(packed)
        assert _sha256(ours) == _sha256(original), name
    for folder in ("gsm8k", "humaneval"):
        license_ = (shared_data / folder / "LICENSE").read_bytes()
        assert (builtin.ROOT / folder / "LICENSE").read_bytes() == license_, folder


def test_loaders_without_a_path_read_the_packaged_sets():
    """SFT / distillation / RL sources and the data pipeline take the packaged copies when no
    path is given (GSM8K: the train split to train on, the test split to evaluate)."""
    from hybridlm.data.config import SourceConfig
    from hybridlm.data.pipeline import build_source
    from hybridlm.data.sft import ReadReport
    from hybridlm.rl.env_config import EnvConfig, build_environment, eval_specs
    from hybridlm.train.distillation import PromptSource
    from hybridlm.train.post_training import ChatSource, load_source
    from hybridlm.train.stages.distill import load_prompts

    convs = load_source(ChatSource(kind="gsm8k", max_rows=3), ReadReport())
    assert len(convs) == 3 and convs[0][0]["content"].startswith("Natalia sold clips")
    prompts = load_prompts(PromptSource(domain="code", kind="humaneval"), ReadReport())
    assert len(prompts) == 164 and "def has_close_elements" in prompts[0].prompt[0]["content"]
    env = build_environment(EnvConfig(kind="gsm8k", limit=2))
    assert len(env) == 2 and "Natalia" in env[0].user_text
    assert len(build_environment(EnvConfig(kind="code", limit=0))) == 164
    (held,) = eval_specs([EnvConfig(kind="gsm8k")])
    assert held.path == str(builtin.path(builtin.GSM8K_TEST))
    src = build_source(SourceConfig(name="ts", kind="tinyshakespeare"))
    assert next(iter(src)).text.startswith("First Citizen:")
