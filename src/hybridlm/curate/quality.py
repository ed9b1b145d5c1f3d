"""fastText-style quality and topic classifiers, and topic x quality-vingtile partitions.

Shape legend: N documents, F features of one document, H hash buckets, D embedding dim,
C classes.

The model is fastText's supervised classifier (Joulin et al. 2017, "Bag of Tricks for Efficient
Text Classification"): each document is a bag of hashed features (lower-cased word unigrams and
bigrams, optionally character n-grams of the words, fastText's `-wordNgrams 2 -minn -maxn`);
its vector is the mean of the features' D-dim embeddings, and a linear layer + softmax gives the
class probabilities. Training is SGD on the softmax cross-entropy with a linearly decaying
learning rate, as in fastText. Olmo 3 (§2.2 steps 4-5, after DCLM) uses one such model for
quality (positives: instruction/ELI5-style text; negatives: a web sample) and distils the
WebOrganizer topic model into another; the same class serves both (`labels` has 2 or more
classes). The `fasttext` PyPI wheel does not work with numpy 2 (its `predict` calls
`np.array(..., copy=False)`), so this is a small PyTorch re-implementation: hashing is
`zlib.crc32`, stable across processes and machines.

Partitioning (Olmo 3 §2.2 step 6): documents are split by topic, then by quality *vingtile*
(5-percentile bucket) within each topic: `BucketThresholds.fit(scores, topics)` stores each
topic's 19 inner quantiles, `assign` maps scores to buckets 0..19 (19 = best 5%).

    clf = FastTextClassifier.train(texts, labels, ClassifierConfig(epochs=5))
    clf.save("runs/quality");  clf = FastTextClassifier.load("runs/quality")
    p_high = clf.score(texts, "high")                     # P(label) per document
"""

from __future__ import annotations

import json
import random
import re
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..data import builtin
from ..data.sources import JsonlSource, StdlibSource, TextFileSource
from .core import CurateDoc, Decision, DocStage, GlobalStage, register_stage

FORMAT = "hybridlm.fasttext"
FORMAT_VERSION = 1
_WORD_RE = re.compile(r"\w+|[^\w\s]", re.UNICODE)


@dataclass(kw_only=True)
class ClassifierConfig:
    """fastText's supervised options: `dim`, `word_ngrams` (2: unigrams + bigrams), `min_char`
    / `max_char` (character n-grams of each word; 0 = off), `buckets` (hash space), `epochs`,
    `lr` (linearly decayed to 0), `batch_size` (1 = fastText's per-example SGD)."""

    dim: int = 16
    word_ngrams: int = 2
    min_char: int = 0
    max_char: int = 0
    buckets: int = 1 << 20
    epochs: int = 5
    lr: float = 0.5
    batch_size: int = 8
    max_words: int = 2000  # words of a document used for its features (speed on long docs)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("dim", "word_ngrams", "buckets", "epochs", "batch_size", "max_words"):
            if getattr(self, name) < 1:
                raise ValueError(f"classifier.{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"classifier.lr must be positive, got {self.lr}")
        if self.min_char < 0 or self.max_char < self.min_char:
            raise ValueError(
                f"classifier char n-grams need 0 <= min_char <= max_char, got "
                f"{self.min_char}, {self.max_char}"
            )
        if self.max_char and not self.min_char:
            raise ValueError("classifier.min_char must be >= 1 when max_char is set")


def tokenize(text: str) -> list[str]:
    """Lower-cased words and single punctuation marks."""
    return _WORD_RE.findall(text.lower())


def feature_ids(text: str, cfg: ClassifierConfig) -> np.ndarray:
    """Hashed feature ids [F] of one document: word n-grams up to `word_ngrams` (joined by a
    space), and character n-grams of `<word>` when `min_char > 0` (prefixed so they never
    collide with a word of the same spelling). Never empty: an empty text gets one id."""
    words = tokenize(text)[: cfg.max_words]
    feats = [zlib.crc32(w.encode()) for w in words]
    for n in range(2, cfg.word_ngrams + 1):
        feats += [
            zlib.crc32(" ".join(words[i : i + n]).encode()) for i in range(len(words) - n + 1)
        ]
    if cfg.min_char:
        for w in set(words):
            token = f"<{w}>"
            for n in range(cfg.min_char, cfg.max_char + 1):
                feats += [
                    zlib.crc32(("\x01" + token[i : i + n]).encode())
                    for i in range(len(token) - n + 1)
                ]
    if not feats:
        feats = [zlib.crc32(b"\x00empty")]
    return np.asarray(feats, dtype=np.int64) % cfg.buckets


def _bag(feats: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """EmbeddingBag inputs: flat ids and offsets."""
    lengths = [len(f) for f in feats]
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return torch.from_numpy(np.concatenate(feats)), torch.from_numpy(offsets)


class FastTextClassifier(torch.nn.Module):
    """Mean of hashed-feature embeddings -> linear -> softmax (see the module docstring)."""

    def __init__(self, labels: Sequence[str], cfg: ClassifierConfig | None = None) -> None:
        super().__init__()
        labels = [str(x) for x in labels]
        if len(labels) < 2 or len(set(labels)) != len(labels):
            raise ValueError(f"a classifier needs >= 2 distinct labels, got {labels}")
        self.labels = labels
        self.cfg = cfg or ClassifierConfig()
        self.embeddings = torch.nn.EmbeddingBag(
            self.cfg.buckets, self.cfg.dim, mode="mean", sparse=True
        )
        self.output = torch.nn.Linear(self.cfg.dim, len(labels))
        # fastText's init: input rows U(-1/D, 1/D), output zeros
        with torch.no_grad():
            self.embeddings.weight.uniform_(-1.0 / self.cfg.dim, 1.0 / self.cfg.dim)
            self.output.weight.zero_()
            self.output.bias.zero_()

    def forward(self, ids_F: torch.Tensor, offsets_N: torch.Tensor) -> torch.Tensor:
        """Logits [N, C] of the bags given by flat ids and per-document offsets."""
        return self.output(self.embeddings(ids_F, offsets_N))

    # ------------------------------------------------------------------ training
    @classmethod
    def train_model(
        cls,
        texts: Sequence[str],
        labels: Sequence[str],
        cfg: ClassifierConfig | None = None,
        *,
        label_set: Sequence[str] | None = None,
        progress: bool = False,
    ) -> FastTextClassifier:
        """Fit on (text, label) pairs with SGD, lr decayed linearly to 0 over all updates."""
        cfg = cfg or ClassifierConfig()
        if len(texts) != len(labels):
            raise ValueError(f"{len(texts)} texts but {len(labels)} labels")
        if not texts:
            raise ValueError("no training documents")
        names = list(label_set) if label_set is not None else sorted(set(map(str, labels)))
        index = {name: k for k, name in enumerate(names)}
        unknown = sorted({str(y) for y in labels} - set(index))
        if unknown:
            raise ValueError(f"labels {unknown} are not in label_set {names}")
        torch.manual_seed(cfg.seed)
        model = cls(names, cfg).train()
        feats = [feature_ids(t, cfg) for t in texts]
        y_N = torch.tensor([index[str(y)] for y in labels])
        dense = [model.output.weight, model.output.bias]
        opt_sparse = torch.optim.SGD([model.embeddings.weight], lr=cfg.lr)
        opt_dense = torch.optim.SGD(dense, lr=cfg.lr)
        order = list(range(len(texts)))
        rng = random.Random(cfg.seed)
        batches_per_epoch = -(-len(order) // cfg.batch_size)
        total, step = cfg.epochs * batches_per_epoch, 0
        bar = _progress(total, "quality classifier" if progress else None)
        for _ in range(cfg.epochs):
            rng.shuffle(order)
            for start in range(0, len(order), cfg.batch_size):
                idx = order[start : start + cfg.batch_size]
                lr = cfg.lr * (1.0 - step / total)
                for opt in (opt_sparse, opt_dense):
                    opt.param_groups[0]["lr"] = lr
                ids_F, offsets_N = _bag([feats[i] for i in idx])
                # summed loss: every example gets fastText's per-example step size
                loss = F.cross_entropy(model(ids_F, offsets_N), y_N[idx], reduction="sum")
                opt_sparse.zero_grad()
                opt_dense.zero_grad()
                loss.backward()
                opt_sparse.step()
                opt_dense.step()
                step += 1
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return model.eval()

    # ------------------------------------------------------------------ inference
    @torch.no_grad()
    def predict_proba(self, texts: Sequence[str], *, batch_size: int = 512) -> np.ndarray:
        """Class probabilities [N, C] (columns in `labels` order)."""
        out = []
        for start in range(0, len(texts), batch_size):
            feats = [feature_ids(t, self.cfg) for t in texts[start : start + batch_size]]
            out.append(torch.softmax(self(*_bag(feats)), dim=-1).numpy())
        return np.concatenate(out) if out else np.zeros((0, len(self.labels)), np.float32)

    def predict(self, texts: Sequence[str]) -> list[str]:
        """The most probable label of each text."""
        return [self.labels[k] for k in self.predict_proba(texts).argmax(axis=1)]

    def score(self, texts: Sequence[str], label: str) -> np.ndarray:
        """P(`label`) per text, e.g. the quality score P(high) [N]."""
        if label not in self.labels:
            raise ValueError(f"unknown label {label!r}; the classifier has {self.labels}")
        return self.predict_proba(texts)[:, self.labels.index(label)]

    def accuracy(self, texts: Sequence[str], labels: Sequence[str]) -> float:
        pred = self.predict(texts)
        return float(np.mean([p == str(y) for p, y in zip(pred, labels, strict=True)]))

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path) -> Path:
        """`model.safetensors` (embeddings, output) + `config.json` (labels, options)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.detach().contiguous() for k, v in self.state_dict().items()},
            str(path / "model.safetensors"),
        )
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "labels": self.labels,
            "config": asdict(self.cfg),
        }
        (path / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> FastTextClassifier:
        from safetensors.torch import load_file

        path = Path(path)
        meta_file = path / "config.json"
        if not meta_file.is_file() or not (path / "model.safetensors").is_file():
            raise ValueError(f"{path} is not a classifier directory (config.json + safetensors)")
        meta = json.loads(meta_file.read_text())
        if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{meta_file}: not a {FORMAT} v{FORMAT_VERSION} classifier")
        model = cls(meta["labels"], ClassifierConfig(**meta["config"]))
        model.load_state_dict(load_file(str(path / "model.safetensors")))
        return model.eval()


def _progress(total: int, desc: str | None) -> Any:
    if desc is None:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=False)


# ---------------------------------------------------------------------------- data files
def read_texts(
    path: str | Path, *, text_field: str = "text", split: str = "line", limit: int = 0
) -> list[str]:
    """Documents of a file or folder: JSON Lines (`.jsonl`, `.jsonl.gz`; `text_field`, dotted
    ok) or plain text, one document per line (`split="line"`), per blank-line passage
    (`"blank_line"`) or per file (`"file"`). `limit > 0` keeps the first `limit`."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"training file not found: {p}")
    if ".jsonl" in p.name or (p.is_dir() and any(p.glob("**/*.jsonl*"))):
        source: Iterable[Any] = JsonlSource(p, text_field=text_field, id_field=None)
        texts = [d.text for d in source]
    elif split == "line":
        files = [p] if p.is_file() else sorted(p.glob("**/*.txt"))
        texts = [ln for f in files for ln in f.read_text(errors="replace").splitlines()]
        texts = [t for t in texts if t.strip()]
    elif split in ("blank_line", "file"):
        texts = [d.text for d in TextFileSource(p, split=split)]  # type: ignore[arg-type]
    else:
        raise ValueError(f"split must be 'line', 'blank_line' or 'file', got {split!r}")
    return texts[:limit] if limit else texts


def train_test_split(
    texts: Sequence[str], labels: Sequence[str], *, test_fraction: float = 0.2, seed: int = 0
) -> tuple[list[str], list[str], list[str], list[str]]:
    """Seeded shuffle, then (train texts, train labels, test texts, test labels)."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    cut = int(round(len(order) * (1 - test_fraction)))
    tr, te = order[:cut], order[cut:]
    return (
        [texts[i] for i in tr],
        [labels[i] for i in tr],
        [texts[i] for i in te],
        [labels[i] for i in te],
    )


# ---------------------------------------------------------------------------- synthetic junk
BOILERPLATE = (
    "Click here to subscribe to our newsletter",
    "We use cookies to improve your experience. Accept all cookies",
    "All rights reserved. Privacy policy | Terms of service | Contact us",
    "Log in or sign up to continue",
    "Share on Facebook Share on Twitter Share via email",
    "Home > Products > Category > Page 2 of 17",
    "Buy now! Limited time offer, free shipping on orders over $50",
    "Skip to main content. Menu. Search. Cart (0)",
)
SPAM_KEYWORDS = (
    "cheap",
    "best",
    "free",
    "casino",
    "loans",
    "viagra",
    "replica",
    "watches",
    "online",
    "discount",
    "deal",
    "bonus",
    "win",
    "crypto",
    "seo",
    "backlinks",
    "followers",
    "sale",
)


def make_junk(texts: Sequence[str], *, seed: int = 0) -> list[str]:
    """Low-quality counterparts of `texts`, one per text, cycling three kinds: the text's words
    shuffled (same unigrams, broken bigrams), boilerplate lines, keyword spam."""
    rng = random.Random(seed)
    out = []
    for k, text in enumerate(texts):
        kind = k % 3
        if kind == 0:
            words = text.split()
            rng.shuffle(words)
            out.append(" ".join(words))
        elif kind == 1:
            n = rng.randint(2, 6)
            out.append("\n".join(rng.choice(BOILERPLATE) for _ in range(n)))
        else:
            n = rng.randint(10, 60)
            out.append(" ".join(rng.choice(SPAM_KEYWORDS) for _ in range(n)))
    return out


def example_quality_data(
    data_dir: str | Path | None = None, *, per_source: int = 400, seed: int = 0
):
    """(texts, labels) of the example quality task on the packaged data sets (or those under
    `data_dir`): positives are GSM8K train questions, HumanEval prompts and tinyshakespeare
    passages ("high"); negatives are `make_junk` of other documents of the same sources
    ("low")."""
    gsm = read_texts(builtin.path(builtin.GSM8K_TRAIN, data_dir), text_field="question")
    he = read_texts(builtin.path(builtin.HUMANEVAL, data_dir), text_field="prompt")
    shakes = read_texts(builtin.path(builtin.TINYSHAKESPEARE, data_dir), split="blank_line")
    rng = random.Random(seed)
    pos, neg_src = [], []
    for docs in (gsm, he, shakes):
        docs = list(docs)
        rng.shuffle(docs)
        half = min(per_source, len(docs) // 2)
        pos += docs[:half]
        neg_src += docs[half : 2 * half]
    neg = make_junk(neg_src, seed=seed)
    return pos + neg, ["high"] * len(pos) + ["low"] * len(neg)


def example_topic_data(data_dir: str | Path | None = None, *, per_topic: int = 150, seed: int = 0):
    """(texts, labels) of a tiny 3-topic task: math (GSM8K train), code (HumanEval + stdlib
    source), literature (tinyshakespeare); the packaged data sets or those under `data_dir`."""
    gsm_path = builtin.path(builtin.GSM8K_TRAIN, data_dir)
    gsm = read_texts(gsm_path, text_field="question", limit=per_topic)
    he = read_texts(builtin.path(builtin.HUMANEVAL, data_dir), text_field="prompt")
    stdlib = [d.text[:2000] for d in StdlibSource(max_files=per_topic)]
    shakes = read_texts(builtin.path(builtin.TINYSHAKESPEARE, data_dir), split="blank_line")
    rng = random.Random(seed)
    code = (he + stdlib)[:per_topic]
    lit = rng.sample(shakes, per_topic)
    texts = gsm + code + lit
    labels = ["math"] * len(gsm) + ["code"] * len(code) + ["literature"] * len(lit)
    return texts, labels


# ---------------------------------------------------------------------------- vingtiles
@dataclass(kw_only=True)
class BucketThresholds:
    """Per-topic quality quantiles: bucket b of a topic holds scores in
    (q_b, q_{b+1}] with q_0 = -inf, q_B = +inf (Olmo 3 §2.2 step 6: 24 topics x 20 vingtiles).
    Fitted on a sample, applied to any document: `assign` uses `searchsorted`."""

    num_buckets: int = 20
    edges: dict[str, list[float]] = field(default_factory=dict)  # topic -> B-1 inner quantiles

    @classmethod
    def fit(
        cls, scores: Sequence[float], topics: Sequence[str] | None = None, num_buckets: int = 20
    ) -> BucketThresholds:
        """Inner quantiles k/B (k = 1..B-1) of each topic's scores."""
        if num_buckets < 1:
            raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
        s_N = np.asarray(scores, dtype=np.float64)
        t_N = np.asarray(topics if topics is not None else [""] * len(s_N), dtype=object)
        if len(t_N) != len(s_N):
            raise ValueError(f"{len(s_N)} scores but {len(t_N)} topics")
        if not len(s_N):
            raise ValueError("no scores to fit buckets on")
        edges = {}
        for topic in sorted(set(t_N.tolist())):
            sub = np.sort(s_N[t_N == topic])
            n = len(sub)
            # edge k = the ceil(k n / B)-th smallest score (integer arithmetic: no rounding)
            idx = [(k * n + num_buckets - 1) // num_buckets - 1 for k in range(1, num_buckets)]
            edges[str(topic)] = sub[np.maximum(idx, 0)].tolist()
        return cls(num_buckets=num_buckets, edges=edges)

    def assign(self, scores: Sequence[float], topics: Sequence[str] | None = None) -> np.ndarray:
        """Bucket 0..B-1 per score (B-1 = the topic's top 1/B)."""
        s_N = np.asarray(scores, dtype=np.float64)
        t_N = list(topics) if topics is not None else [""] * len(s_N)
        out = np.empty(len(s_N), dtype=np.int64)
        for topic in set(t_N):
            if str(topic) not in self.edges:
                raise ValueError(
                    f"topic {topic!r} has no fitted buckets; known {sorted(self.edges)}"
                )
            mask = np.asarray([t == topic for t in t_N])
            out[mask] = np.searchsorted(self.edges[str(topic)], s_N[mask], side="left")
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BucketThresholds:
        return cls(num_buckets=int(data["num_buckets"]), edges=dict(data["edges"]))


def vingtiles(scores: Sequence[float], topics: Sequence[str] | None = None) -> np.ndarray:
    """Topic x quality-vingtile bucket (0..19) of every document, fitted on these documents."""
    return BucketThresholds.fit(scores, topics, 20).assign(scores, topics)


# ---------------------------------------------------------------------------- stages
_MODELS: dict[str, FastTextClassifier] = {}


def _cached(path: str) -> FastTextClassifier:
    if path not in _MODELS:
        _MODELS[path] = FastTextClassifier.load(path)
    return _MODELS[path]


@register_stage("classify")
@dataclass(kw_only=True)
class ClassifyStage(DocStage):
    """Annotate `metadata[key]` with a classifier's output: P(`label`) when `label` is set
    (quality score), else the predicted label (topic). With `label` and `min_score > 0`
    documents scoring below it are dropped (a DCLM-style flat threshold)."""

    model: str  # classifier directory
    key: str = "quality"
    label: str = ""
    min_score: float = 0.0

    def setup(self) -> None:
        _cached(self.model)

    def process(self, doc: CurateDoc) -> Decision:
        clf = _cached(self.model)
        if not self.label:
            topic = clf.predict([doc.text])[0]
            doc.metadata[self.key] = topic
            return Decision.ok(**{self.key: topic})
        score = float(clf.score([doc.text], self.label)[0])
        doc.metadata[self.key] = score
        if score < self.min_score:
            return Decision.drop(f"{self.name}:below_{self.min_score}", **{self.key: score})
        return Decision.ok(**{self.key: score})


@register_stage("quality_buckets")
@dataclass(kw_only=True)
class QualityBucketStage(GlobalStage):
    """Write `metadata[bucket_key]` = the document's quality bucket within its topic
    (`metadata[topic_key]`, "" when absent), fitted over the whole corpus."""

    score_key: str = "quality"
    topic_key: str = "topic"
    bucket_key: str = "quality_bucket"
    num_buckets: int = 20

    def _pairs(self, docs: Sequence[CurateDoc]) -> list[tuple[float, str]]:
        out = []
        for doc in docs:
            if self.score_key not in doc.metadata:
                raise ValueError(
                    f"document {doc.id!r} has no metadata[{self.score_key!r}]; run a "
                    "'classify' stage first"
                )
            out.append(
                (float(doc.metadata[self.score_key]), str(doc.metadata.get(self.topic_key, "")))
            )
        return out

    def observe(self, docs: Sequence[CurateDoc]) -> list[tuple[float, str]]:
        return self._pairs(docs)

    def plan(self, partials: Sequence[list[tuple[float, str]]]) -> list[Any]:
        pairs = [p for part in partials for p in part]
        if not pairs:
            return [None for _ in partials]
        scores, topics = zip(*pairs, strict=True)
        th = BucketThresholds.fit(scores, topics, self.num_buckets)
        return [th.to_dict() for _ in partials]

    def apply(self, doc: CurateDoc, position: int, shard_plan: Any) -> Decision:
        th = BucketThresholds.from_dict(shard_plan)
        score, topic = self._pairs([doc])[0]
        bucket = int(th.assign([score], [topic])[0])
        doc.metadata[self.bucket_key] = bucket
        return Decision.ok(**{self.bucket_key: bucket})
