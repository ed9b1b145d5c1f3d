"""Typed model configuration: one `ModelConfig` describes every model hybridlm builds.

A model is a *pattern string*, one letter per residual block (the letters of Hugging Face's
`NemotronHConfig.hybrid_override_pattern`), plus one sub-config per mixer kind:

    M  Mamba-2 mixer          -> `MambaConfig`
    *  attention (GQA)        -> `AttentionConfig`
    E  MoE / LatentMoE        -> `MoEConfig`
    -  dense MLP              -> `MLPConfig`

`Config` is the base of every config of the project (model, data, runs, flows): a YAML/JSON
round trip (`to_dict`, `from_dict`, `save`, `load`), dotted overrides
(`cfg.override(["moe.top_k=8"])`) and a `validate()` hook; unknown keys and wrong types are
ValueErrors naming the dotted key. `ModelConfig.validate()` names the field and the fix for every
inconsistent setting.

Counting helpers (`num_params`, `flops_per_token`, `kv_cache_bytes_per_token`,
`mamba_state_bytes_per_sequence`) are computed from the config alone, without allocating.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import yaml

MIXER_LETTERS = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}

C = TypeVar("C", bound="Config")


class Config:
    """Base of the config dataclasses: plain-data round trip, YAML / JSON files, dotted overrides.

    Sections are nested dataclasses (configs or plain ones); `from_dict` checks every key and type
    and names the dotted key in its ValueError. `load` and `override` run `validate()` on the
    result. Class attributes adapt it to a config without copying methods.
    """

    WHAT: ClassVar[str] = "config"  # what a file of it is called in error messages
    # the section a recipe gives it (`data`, `curate`): a file holding only that section reads as
    # it, and the keys of a config read on its own are named under it in error messages
    KEY: ClassVar[str] = ""
    REQUIRED: ClassVar[tuple[str, ...]] = ()  # sections a mapping must give
    # field -> how a name held there expands to its section (a preset name to its ModelConfig),
    # so an override can set a key inside it (`model.d_model=128` on `model: tiny-super`)
    EXPAND: ClassVar[dict[str, Callable[[str], Any]]] = {}
    # old key -> its dotted place now, for configs whose keys moved into sections: a file or
    # override that still uses the old key is told where it went
    MOVED: ClassVar[dict[str, str]] = {}

    def validate(self) -> Any:
        """Raise a ValueError naming the setting when settings disagree; nothing to check here."""

    def to_dict(self) -> dict[str, Any]:
        """Plain data (nested configs as mappings): what `save` writes and `from_dict` reads."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[C], data: dict[str, Any]) -> C:
        return _from_dict(cls, data, f"{cls.KEY}." if cls.KEY else "")

    def save(self, path: str | Path) -> None:
        write_mapping(path, self.to_dict())

    @classmethod
    def load(cls: type[C], path: str | Path) -> C:
        data = read_mapping(path, cls.WHAT)
        if cls.KEY and set(data) == {cls.KEY}:
            data = data[cls.KEY]
        cfg = cls.from_dict(data)
        cfg.validate()
        return cfg

    def override(self: C, overrides: Sequence[str]) -> C:
        """A new, validated config with dotted `key=value` overrides (see `apply_overrides`)."""
        return apply_overrides(self, overrides)


@dataclass(kw_only=True)
class MambaConfig:
    """Mamba-2 mixer (Dao & Gu 2024, SSD); Nemotron 3 Super values in the presets (notes §1.3)."""

    num_heads: int = 8
    head_dim: int = 16
    state_size: int = 16
    n_groups: int = 1  # B and C are shared by the heads of one group
    conv_kernel: int = 4
    conv_bias: bool = True
    chunk_size: int = 64  # SSD chunk length for training / prefill
    # dt = softplus(dt_raw + dt_bias), clamped to [dt_clamp_min, dt_clamp_max] on every path
    # (prefill == decode): mamba-ssm's `dt_limit`, NemotronH's `time_step_limit`, (0, inf) by
    # default. dt_min / dt_max / dt_init_floor only set the dt_bias init (Mamba-2 §A).
    dt_min: float = 1e-3  # lower end of the dt init range
    dt_max: float = 0.1  # upper end of the dt init range
    dt_init_floor: float = 1e-4
    dt_clamp_min: float = 0.0
    dt_clamp_max: float | None = None

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.state_size


@dataclass(kw_only=True)
class YarnConfig:
    """YaRN RoPE extension (Peng et al. 2023); Olmo 3 applies it to full-attention layers only."""

    factor: float = 8.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None  # None -> 0.1 * ln(factor) + 1

    def validate(self) -> None:
        if self.factor < 1 or self.original_max_position_embeddings < 1:
            raise ValueError(
                f"YaRN needs factor >= 1 and original_max_position_embeddings >= 1, got "
                f"{self.factor} and {self.original_max_position_embeddings}"
            )


@dataclass(kw_only=True)
class AttentionConfig:
    """Grouped-query attention; `rope_theta=None`: no positional embedding (Nemotron 3 §2.1)."""

    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float | None = None
    yarn: YarnConfig | None = None  # applied to full-attention layers only (Olmo 3 §3.6)
    qk_norm: bool = False  # RMSNorm over the whole q / k projection (Olmo 2/3)
    sliding_window: int | None = None
    # One letter per attention layer, 'S' sliding or 'F' full. Empty: every `full_every`-th
    # attention layer is full and so is the last (Olmo 3: SWA on 3 of 4 layers, last one full).
    window_pattern: str = ""
    full_every: int = 4


@dataclass(kw_only=True)
class MoEConfig:
    """MoE with sigmoid router; LatentMoE when `latent_size` is set (Nemotron 3 Super §2.1.1)."""

    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 64
    shared_expert_hidden: int = 128  # 0: no shared expert
    latent_size: int | None = None  # None: experts run at full width d (standard MoE)
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    n_group: int = 1  # group-limited routing (DeepSeek-V3); 1 disables it
    topk_group: int = 1
    activation: Literal["relu2"] = "relu2"
    bias_update_rate: float = 1e-3  # aux-loss-free balancing step (notes §1.5)
    aux_loss_coef: float = 1e-4  # sequence-level load-balancing loss


@dataclass(kw_only=True)
class MLPConfig:
    hidden: int = 128
    activation: Literal["relu2", "swiglu"] = "relu2"


@dataclass(kw_only=True)
class MTPConfig:
    """Shared-weight multi-token prediction (Nemotron 3 Super §2.1.2). Empty pattern: no MTP."""

    pattern: str = ""  # blocks of the one MTP layer, e.g. "*E"
    depth: int = 2  # recursive applications in training; each predicts one token further
    loss_weight: float = 0.3
    # False: one module per depth (DeepSeek-V3 §2.2; Nemotron 3.5 Super's pretraining heads),
    # a training form: drafting and export take one shared head (`hybridlm mtp-boost` with
    # `init: consolidate` merges them, Nemotron 3.5 §1)
    shared: bool = True

    @property
    def heads(self) -> int:
        """MTP modules the model holds: 1 shared, or one per depth."""
        return 1 if self.shared else self.depth


@dataclass(kw_only=True)
class ModelConfig(Config):
    vocab_size: int = 512
    d_model: int = 64
    pattern: str = "M*ME"
    norm_eps: float = 1e-5
    # "pre": x + mixer(norm(x)) (Nemotron-H); "post": x + norm(mixer(x)) (Olmo 2/3 reordered norm)
    norm_placement: Literal["pre", "post"] = "pre"
    tie_embeddings: bool = False
    init_std: float = 0.02
    max_seq_len: int = 4096
    # > 0: a `score` head [num_labels, d_model] on the final-normed hidden state, read at a
    # sequence's last token (reward models: num_labels 1, `hybridlm rm`)
    num_labels: int = 0
    mamba: MambaConfig = field(default_factory=MambaConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    mlp: MLPConfig = field(default_factory=MLPConfig)
    mtp: MTPConfig = field(default_factory=MTPConfig)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise `ValueError` for settings that cannot build a model."""
        _check_pattern(self.pattern, "pattern")
        if self.mtp.pattern:
            _check_pattern(self.mtp.pattern, "mtp.pattern")
            if self.mtp.depth < 1:
                raise ValueError(
                    f"mtp.depth must be >= 1 when mtp.pattern is set, got {self.mtp.depth}"
                )
        if self.num_labels < 0:
            raise ValueError(f"num_labels must be >= 0, got {self.num_labels}")
        for name in ("vocab_size", "d_model", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.norm_placement not in ("pre", "post"):
            raise ValueError(f"norm_placement must be 'pre' or 'post', got {self.norm_placement!r}")
        letters = set(self.pattern) | set(self.mtp.pattern)
        if "M" in letters:
            m = self.mamba
            _positive(m, "mamba", "num_heads", "head_dim", "state_size", "n_groups", "conv_kernel")
            _positive(m, "mamba", "chunk_size")
            if m.num_heads % m.n_groups:
                raise ValueError(
                    f"mamba.num_heads ({m.num_heads}) must be divisible by "
                    f"mamba.n_groups ({m.n_groups})"
                )
            if not 0 < m.dt_min <= m.dt_max:
                raise ValueError(
                    f"need 0 < mamba.dt_min <= mamba.dt_max, got {m.dt_min}, {m.dt_max}"
                )
            if m.dt_clamp_min < 0 or (
                m.dt_clamp_max is not None and not m.dt_clamp_min < m.dt_clamp_max
            ):
                raise ValueError(
                    "need 0 <= mamba.dt_clamp_min < mamba.dt_clamp_max, got "
                    f"{m.dt_clamp_min}, {m.dt_clamp_max}"
                )
        if "*" in letters:
            a = self.attention
            _positive(a, "attention", "num_heads", "num_kv_heads", "head_dim")
            if a.num_heads % a.num_kv_heads:
                raise ValueError(
                    f"attention.num_heads ({a.num_heads}) must be divisible by "
                    f"attention.num_kv_heads ({a.num_kv_heads})"
                )
            if a.rope_theta is not None and a.head_dim % 2:
                raise ValueError(f"attention.head_dim must be even for RoPE, got {a.head_dim}")
            if a.yarn is not None and a.rope_theta is None:
                raise ValueError("attention.yarn needs attention.rope_theta (YaRN rescales RoPE)")
            if a.sliding_window is not None and a.sliding_window <= 0:
                raise ValueError(
                    f"attention.sliding_window must be positive, got {a.sliding_window}"
                )
            if a.window_pattern:
                if set(a.window_pattern) - {"S", "F"}:
                    raise ValueError(
                        f"attention.window_pattern uses only 'S' and 'F', got {a.window_pattern!r}"
                    )
                n_attn = self.pattern.count("*")
                if len(a.window_pattern) != n_attn:
                    raise ValueError(
                        f"attention.window_pattern has {len(a.window_pattern)} letters "
                        "but the pattern "
                        f"has {n_attn} attention layers"
                    )
                if "S" in a.window_pattern and a.sliding_window is None:
                    raise ValueError(
                        "attention.window_pattern has 'S' layers but no sliding_window"
                    )
            if a.full_every <= 0:
                raise ValueError(f"attention.full_every must be positive, got {a.full_every}")
        if "E" in letters:
            e = self.moe
            _positive(e, "moe", "num_experts", "top_k", "expert_hidden", "n_group", "topk_group")
            if e.top_k > e.num_experts:
                raise ValueError(f"moe.top_k ({e.top_k}) exceeds moe.num_experts ({e.num_experts})")
            if e.shared_expert_hidden < 0:
                raise ValueError(
                    "moe.shared_expert_hidden must be >= 0 (0 disables the shared expert)"
                )
            if e.latent_size is not None and not 0 < e.latent_size <= self.d_model:
                raise ValueError(
                    f"moe.latent_size ({e.latent_size}) must be in (0, d_model={self.d_model}]: "
                    "LatentMoE compresses the routed width below the hidden size"
                )
            if e.num_experts % e.n_group or e.topk_group > e.n_group:
                raise ValueError(
                    f"moe.n_group ({e.n_group}) must divide moe.num_experts "
                    f"({e.num_experts}) and be "
                    f">= moe.topk_group ({e.topk_group})"
                )
            if e.activation != "relu2":
                raise ValueError(f"moe.activation must be 'relu2', got {e.activation!r}")
        if "-" in letters:
            _positive(self.mlp, "mlp", "hidden")
            if self.mlp.activation not in ("relu2", "swiglu"):
                raise ValueError(
                    f"mlp.activation must be 'relu2' or 'swiglu', got {self.mlp.activation!r}"
                )

    # ------------------------------------------------------------------ layer facts
    def attention_is_sliding(self) -> list[bool]:
        """For each attention layer of the backbone, in order: does it use the sliding window?"""
        a = self.attention
        n = self.pattern.count("*")
        if a.sliding_window is None:
            return [False] * n
        if a.window_pattern:
            return [c == "S" for c in a.window_pattern]
        return [not ((j + 1) % a.full_every == 0 or j == n - 1) for j in range(n)]

    # ------------------------------------------------------------------ counting
    def _block_params(self, letter: str) -> tuple[int, int]:
        """(total, active) parameters of one residual block including its norm."""
        d = self.d_model
        norm = d
        if letter == "M":
            m = self.mamba
            in_proj = d * (2 * m.d_inner + 2 * m.n_groups * m.state_size + m.num_heads)
            conv = m.conv_dim * m.conv_kernel + (m.conv_dim if m.conv_bias else 0)
            n = in_proj + conv + 3 * m.num_heads + m.d_inner + m.d_inner * d
            return n + norm, n + norm
        if letter == "*":
            a = self.attention
            q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
            n = d * q + 2 * d * kv + q * d + ((q + kv) if a.qk_norm else 0)
            return n + norm, n + norm
        if letter == "E":
            e = self.moe
            width = e.latent_size or d
            expert = 2 * width * e.expert_hidden
            shared = 2 * d * e.shared_expert_hidden
            latent = 2 * d * e.latent_size if e.latent_size else 0
            router = e.num_experts * d
            base = shared + latent + router + norm
            return base + e.num_experts * expert, base + e.top_k * expert
        if letter == "-":
            mats = 3 if self.mlp.activation == "swiglu" else 2
            n = mats * d * self.mlp.hidden
            return n + norm, n + norm
        raise ValueError(f"unknown pattern letter {letter!r}")

    def num_params(self) -> ParamCount:
        """Parameter counts from the config alone (no allocation).

        `total` and `active` cover the backbone, embeddings and LM head (what the papers report);
        the MTP module is counted separately in `mtp_total` / `mtp_active`. `active` counts the
        top-k routed experts of each MoE layer plus everything that is not routed.
        """
        d = self.d_model
        emb = self.vocab_size * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        total, active = emb + head + d, emb + head + d  # + final norm
        for c in self.pattern:
            t, a = self._block_params(c)
            total, active = total + t, active + a
        mtp_total = mtp_active = 0
        if self.mtp.pattern:
            frame = 2 * d + 2 * d * d + d  # enorm, hnorm, eh_proj, final_layernorm
            mtp_total = mtp_active = frame
            for c in self.mtp.pattern:
                t, a = self._block_params(c)
                mtp_total, mtp_active = mtp_total + t, mtp_active + a
            mtp_total *= self.mtp.heads  # per-depth heads: one of them runs per depth
        return ParamCount(
            total=total, active=active, embedding=emb, mtp_total=mtp_total, mtp_active=mtp_active
        )

    def flops_per_token(self, seq_len: int | None = None, *, training: bool = False) -> int:
        """Matmul FLOPs per token of one forward pass (x3 with `training=True`), MTP excluded.

        2 FLOPs per active weight (LM head included, embedding lookup excluded), plus causal
        attention over an average context of `seq_len / 2` (window-capped on sliding layers), plus
        the SSD state work 2*3*H*P*N per Mamba token (state update, decay and readout).
        """
        seq_len = seq_len or self.max_seq_len
        counts = self.num_params()
        weights = counts.active - counts.embedding - self.d_model * (1 + len(self.pattern))
        flops = 2 * weights
        a, m = self.attention, self.mamba
        for sliding in self.attention_is_sliding():
            ctx = min(seq_len, a.sliding_window) if sliding else seq_len
            flops += 2 * 2 * (ctx / 2) * a.num_heads * a.head_dim
        flops += self.pattern.count("M") * 2 * 3 * m.num_heads * m.head_dim * m.state_size
        return int(flops * (3 if training else 1))

    def kv_cache_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV-cache bytes one token adds across all attention layers (full-attention layers)."""
        a = self.attention
        return self.pattern.count("*") * 2 * a.num_kv_heads * a.head_dim * dtype_bytes

    def mamba_state_bytes_per_sequence(self, dtype_bytes: int = 4) -> int:
        """Conv + SSM state bytes one sequence holds across all Mamba layers (fixed in length)."""
        m = self.mamba
        per_layer = m.num_heads * m.head_dim * m.state_size + m.conv_dim * (m.conv_kernel - 1)
        return self.pattern.count("M") * per_layer * dtype_bytes


@dataclass(frozen=True)
class LayerSpec:
    """What a mixer is told about its place in the stack (built by `model.block.build_blocks`)."""

    index: int
    letter: str
    sliding: bool = False


@dataclass(frozen=True)
class ParamCount:
    total: int
    active: int
    embedding: int
    mtp_total: int = 0
    mtp_active: int = 0


def _check_pattern(pattern: str, name: str) -> None:
    if not pattern:
        raise ValueError(f"{name} must not be empty")
    bad = sorted(set(pattern) - set(MIXER_LETTERS))
    if bad:
        raise ValueError(
            f"{name} {pattern!r} has unknown letter(s) {bad}; use M (Mamba-2), * (attention), "
            "E (MoE) or - (MLP)"
        )


def _positive(obj: Any, prefix: str, *names: str) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            raise ValueError(f"{prefix}.{name} must be positive, got {getattr(obj, name)}")


# ---------------------------------------------------------------------- dict <-> dataclass
def write_mapping(path: str | Path, data: dict[str, Any]) -> None:
    """Write a config mapping as JSON (`.json`) or YAML (anything else)."""
    path = Path(path)
    text = (
        json.dumps(data, indent=2)
        if path.suffix == ".json"
        else yaml.safe_dump(data, sort_keys=False)
    )
    path.write_text(text)


def read_mapping(path: str | Path, what: str = "config") -> dict[str, Any]:
    """Read a YAML or JSON mapping; `.json` files parse as JSON (YAML 1.1 would read 1e-05 as a
    string). Missing files, parse errors and non-mappings are ValueErrors naming `what`."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} file not found: {path}")
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ValueError(f"cannot parse {what} file {path}: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} file {path} must hold a mapping, got {type(data).__name__}")
    return data


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build the typed dataclass `cls` from plain data (YAML / JSON), checking every field's
    type and naming the offending key (`prefix` + field) in the ValueError (`Config.from_dict`
    for config classes; this for any dataclass)."""
    return _from_dict(cls, data, prefix)


def _from_dict(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        what = prefix.rstrip(".") or f"a {getattr(cls, 'WHAT', 'config')}"
        raise ValueError(f"{what} must be a mapping, got {data!r}")
    for name in getattr(cls, "REQUIRED", ()):
        if name not in data:
            raise ValueError(f"a {cls.WHAT} needs a {name!r} section")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    moved = [k for k in unknown if k in getattr(cls, "MOVED", {})]
    if moved:
        raise ValueError(_moved_message(cls, moved, prefix))
    if unknown:
        # a mapping under an unknown name is most likely a misspelt section
        kind = "sections" if all(isinstance(data[k], dict) for k in unknown) else "key(s)"
        raise ValueError(f"unknown {kind} {[prefix + k for k in unknown]}; known: {sorted(names)}")
    # a field without a default left out (a source without its `name`): the constructor's
    # TypeError would not say which key of the file is missing
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.init
        and f.name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(f"missing key(s) {[prefix + k for k in missing]}")
    kwargs = {k: _coerce(hints[k], v, prefix + k) for k, v in data.items()}
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, name: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, name)
            except ValueError as err:
                # a mapping is meant for the section, not for a name (`parallel: {ep: 2}`)
                section = isinstance(value, dict) and dataclasses.is_dataclass(arg)
                errors.insert(0, str(err)) if section else errors.append(str(err))
        raise ValueError(errors[0])
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{name} must be one of {list(args)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{name} must be a list, got {value!r}")
        return [_coerce(args[0], v, f"{name}[{k}]") for k, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be a mapping, got {value!r}")
        return {str(k): _coerce(args[1], v, f"{name}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        # an empty YAML section (`train:`) reads as its defaults
        return _from_dict(tp, {} if value is None else value, name + ".")
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {value!r}")
        return value
    return value


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass a field's type names (unwrapping `X | None`, `ModelConfig | str`), or None."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    return next((c for c in (typing.get_args(hint) if union else (hint,)) if _is_class(c)), None)


def _is_class(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _item_hint(hint: Any) -> Any:
    """The element type of `list[X]` / `dict[str, X]` (None when unknown)."""
    args = typing.get_args(hint)
    return args[-1] if typing.get_origin(hint) in (list, dict) and args else None


def apply_overrides(cfg: C, overrides: Sequence[str]) -> C:
    """A new config with dotted `key=value` overrides applied (values parsed as YAML), validated.

    Integer parts index lists (`data.sources.0.max_files=20`); an unset optional section starts at
    its defaults (`attention.yarn.factor=2`); a name where a section may stand expands through the
    class's `EXPAND` (`model.d_model=128` on a preset name)."""
    top = type(cfg)
    data = cfg.to_dict()
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key=value, e.g. train.lr=1e-3")
        key, raw = item.split("=", 1)
        *path, last = key.strip().split(".")
        node: Any = data
        hint: Any = top
        for depth, part in enumerate(path):
            _check_moved(hint, part, item, path[:depth])
            node, hint = _descend(node, hint, part, item, ".".join(path[: depth + 1]))
        _check_moved(hint, last, item, path)
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:  # not YAML, e.g. a pattern such as *E*E (a YAML alias): the text
            value = raw.strip()
        if isinstance(node, list):
            node[_index(node, last, item)] = value
            continue
        known = _fields(hint) or set(node)
        if last not in known:
            raise ValueError(f"override {item!r}: unknown key {key.strip()!r}")
        node[last] = value
    out = top.from_dict(data)
    out.validate()
    return out


def _moved_message(cls: type, keys: list[str], prefix: str) -> str:
    moved = cls.MOVED  # type: ignore[attr-defined]
    where = ", ".join(f"{prefix}{k} is now {prefix}{moved[k]}" for k in keys)
    return f"the {cls.WHAT} has sections {sorted(f.name for f in dataclasses.fields(cls))}: {where}"


def _check_moved(hint: Any, part: str, item: str, where: list[str]) -> None:
    """The one-line error of an override that names a key its config moved (`Config.MOVED`)."""
    cls = _dataclass_in(hint)
    if cls is not None and part in getattr(cls, "MOVED", {}) and part not in _fields(cls):
        prefix = "".join(f"{w}." for w in where)
        raise ValueError(f"override {item!r}: " + _moved_message(cls, [part], prefix))


def _fields(hint: Any) -> set[str]:
    cls = _dataclass_in(hint)
    return {f.name for f in dataclasses.fields(cls)} if cls else set()


def _descend(node: Any, hint: Any, part: str, item: str, where: str) -> tuple[Any, Any]:
    """The child `part` of `node` (a mapping or list of plain config data) and its type hint."""
    if isinstance(node, list):
        k = _index(node, part, item)
        child, child_hint, expand = node[k], _item_hint(hint), None
        key: Any = k
    else:
        cls = _dataclass_in(hint)
        known = _fields(hint) or set(node)
        if part not in known:
            raise ValueError(f"override {item!r}: unknown section {part!r}; known: {sorted(known)}")
        child_hint = typing.get_type_hints(cls)[part] if cls else _item_hint(hint)
        child, expand, key = node[part], getattr(cls, "EXPAND", {}).get(part), part
    section = _dataclass_in(child_hint)
    if isinstance(child, str) and expand is not None:
        child = dataclasses.asdict(expand(child))
    elif child is None and section is not None:
        try:  # an unset optional section (attention.yarn) starts at its defaults
            child = dataclasses.asdict(section())
        except (TypeError, ValueError):
            raise ValueError(
                f"override {item!r}: {where} is unset; set the whole section instead, "
                f"e.g. {where}={{...}}"
            ) from None
    if not isinstance(child, (dict, list)):
        raise ValueError(f"override {item!r}: {part!r} is not a config section")
    node[key] = child
    return child, child_hint


def _index(node: list, part: str, item: str) -> int:
    if not part.lstrip("-").isdigit() or not -len(node) <= int(part) < len(node):
        raise ValueError(f"override {item!r}: {part!r} is not an index of a {len(node)}-item list")
    return int(part)
