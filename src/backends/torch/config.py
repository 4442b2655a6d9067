"""``ModelSpec``: a decoder-only model's shape and math, read from a Hugging Face ``config.json``.

Supported architectures: ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``
(per-head q/k RMSNorm), ``Qwen2MoeForCausalLM`` (sigmoid-gated shared expert),
``Qwen3MoeForCausalLM`` and ``MixtralForCausalLM``; RoPE kinds ``default``, ``linear``,
``llama3`` and ``yarn``; sliding-window attention where the config turns it on.

A ``config.json`` carries many keys that only matter for training or for other tools, so
:meth:`ModelSpec.from_hf_config` reads the keys it knows, takes ``transformers``' own default
for the ones a file leaves out, and raises :class:`~pipeline.errors.ArtifactError` for
anything that would change the math in a way this backend does not implement (another
architecture, activation, RoPE kind, partial rotary, quantization). Nothing that matters is
dropped silently.

Example::

    spec = ModelSpec.from_hf_config(json.loads(Path("model/config.json").read_text()))
    assert spec.num_heads % spec.num_kv_heads == 0
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from backends.torch.moe import RoutingSpec
from pipeline.errors import ArtifactError

ARCHITECTURES = (
    "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM", "MixtralForCausalLM",
)
"""The ``architectures`` values :meth:`ModelSpec.from_hf_config` accepts."""

ROPE_KINDS = ("default", "linear", "llama3", "yarn")
DTYPES = ("float32", "float16", "bfloat16")

_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}

_QWEN = {"rms_norm_eps": 1e-6, "rope_theta": 1e4, "max_position_embeddings": 32768,
         "sliding_window": 4096, "max_window_layers": 28}
# transformers' class defaults for the keys read here (config.json usually spells them out).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"rms_norm_eps": 1e-6, "rope_theta": 1e4,
                         "max_position_embeddings": 2048},
    "Qwen2ForCausalLM": _QWEN,
    "Qwen3ForCausalLM": {**_QWEN, "head_dim": 128},
    "Qwen2MoeForCausalLM": {**_QWEN, "num_experts": 60, "num_experts_per_tok": 4,
                            "moe_intermediate_size": 1408,
                            "shared_expert_intermediate_size": 5632, "qkv_bias": True},
    "Qwen3MoeForCausalLM": {**_QWEN, "num_experts": 128, "num_experts_per_tok": 8,
                            "moe_intermediate_size": 768, "num_key_value_heads": 4},
    "MixtralForCausalLM": {"rms_norm_eps": 1e-5, "rope_theta": 1e6,
                           "max_position_embeddings": 131072, "num_experts": 8,
                           "num_experts_per_tok": 2, "num_key_value_heads": 8,
                           "sliding_window": None},
}


@attrs.frozen
class RopeSpec:
    """Rotary embedding parameters, with every default already resolved.

    ``kind`` is one of :data:`ROPE_KINDS`. ``factor``: the scaling factor (``linear``,
    ``llama3``, ``yarn``). ``original_max_position``: the pre-training context (``llama3``,
    ``yarn``). ``low_freq_factor``/``high_freq_factor``: ``llama3`` only. ``beta_fast``,
    ``beta_slow``, ``truncate``: ``yarn`` only. ``attention_factor`` multiplies cos and sin
    (``yarn``; 1 otherwise).
    """

    kind: str = attrs.field(validator=attrs.validators.in_(ROPE_KINDS))
    theta: float
    factor: float = 1.0
    original_max_position: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


@attrs.frozen
class MoeSpec:
    """The sparse feed-forward of the MoE layers.

    ``intermediate_size`` is one routed expert's; ``shared_intermediate_size`` is the
    sigmoid-gated shared expert's (Qwen2-MoE), 0 when there is none.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    routing: RoutingSpec
    shared_intermediate_size: int = 0

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ArtifactError(f"num_experts_per_tok={self.top_k} outside 1..{self.num_experts}")


@attrs.frozen
class ConditioningSpec:
    """Which conditioning a model adds to embedding inputs (``config.json``'s
    ``"embedding_conditioning": {"time": bool, "self_condition": bool}``; see
    :mod:`backends.torch.conditioning`)."""

    time: bool = False
    self_condition: bool = False


def _positive(inst: Any, attr: attrs.Attribute[int], value: int) -> None:
    if value <= 0:
        raise ArtifactError(f"{attr.name}={value!r} must be > 0")


@attrs.frozen
class ModelSpec:
    """A decoder-only transformer: pre-norm RMSNorm blocks, GQA attention with RoPE, SwiGLU MLPs.

    ``intermediate_size`` is the dense MLP's. ``sliding_windows[i]`` is layer i's attention
    window (a query at p sees keys at p-w+1..p) or None for full causal attention.
    ``moe_layers`` lists the layers whose MLP is ``moe``; ``qkv_bias``/``o_bias``/``mlp_bias``
    say which projections have a bias; ``qk_norm`` adds per-head RMSNorm on q and k (Qwen3).
    ``dtype`` is the checkpoint's weight dtype (one of :data:`DTYPES`).
    """

    architecture: str
    vocab_size: int = attrs.field(validator=_positive)
    hidden_size: int = attrs.field(validator=_positive)
    intermediate_size: int = attrs.field(validator=_positive)
    num_layers: int = attrs.field(validator=_positive)
    num_heads: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    rms_norm_eps: float
    max_position_embeddings: int = attrs.field(validator=_positive)
    rope: RopeSpec
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_windows: tuple[int | None, ...] = ()
    moe: MoeSpec | None = None
    moe_layers: tuple[int, ...] = ()
    dtype: str = attrs.field(default="float32", validator=attrs.validators.in_(DTYPES))
    conditioning: ConditioningSpec | None = None

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ArtifactError(f"num_attention_heads={self.num_heads} is not a multiple of "
                                f"num_key_value_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ArtifactError(f"head_dim={self.head_dim} must be even for RoPE")
        if len(self.sliding_windows) != self.num_layers:
            raise ArtifactError(f"{len(self.sliding_windows)} sliding windows for "
                                f"{self.num_layers} layers")
        if (self.moe is None) != (not self.moe_layers) or any(
                not 0 <= i < self.num_layers for i in self.moe_layers):
            raise ArtifactError(f"moe_layers={self.moe_layers} do not fit moe={self.moe} "
                                f"and {self.num_layers} layers")

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelSpec:
        """The spec of a Hugging Face ``config.json`` (already parsed); see the module doc."""
        arch = _architecture(cfg)
        c = _Config(arch, cfg)
        _reject_unsupported(c)
        heads = c.integer("num_attention_heads")
        layers = c.integer("num_hidden_layers")
        moe, moe_layers = _moe(c, layers)
        qkv_bias, o_bias = _attention_biases(c)
        return cls(
            architecture=arch, vocab_size=c.integer("vocab_size"), hidden_size=c.integer("hidden_size"),
            intermediate_size=c.integer("intermediate_size"), num_layers=layers, num_heads=heads,
            num_kv_heads=c.integer("num_key_value_heads", heads),
            head_dim=c.integer("head_dim", c.integer("hidden_size") // heads),
            rms_norm_eps=c.number("rms_norm_eps"),
            max_position_embeddings=c.integer("max_position_embeddings"), rope=_rope(c),
            tie_word_embeddings=c.flag("tie_word_embeddings", False), qkv_bias=qkv_bias,
            o_bias=o_bias, mlp_bias=arch == "LlamaForCausalLM" and c.flag("mlp_bias", False),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_windows=_sliding_windows(c, layers), moe=moe, moe_layers=moe_layers,
            dtype=_dtype(c), conditioning=_conditioning(c))


class _Config:
    """Typed reads from a config mapping; a missing or null key takes the architecture default."""

    def __init__(self, arch: str, cfg: Mapping[str, Any]) -> None:
        self.arch = arch
        self.raw = cfg

    def get(self, key: str, default: Any = None) -> Any:
        value = self.raw.get(key)
        if value is None:
            return _DEFAULTS[self.arch].get(key, default)
        return value

    def _typed(self, key: str, default: Any, kind: type[Any]) -> Any:
        value = self.get(key, default)
        if value is None:
            raise ArtifactError(f"{self.arch} config.json lacks {key!r}")
        if kind is bool and not isinstance(value, bool):
            raise ArtifactError(f"{self.arch} config.json: {key}={value!r} is not a boolean")
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ArtifactError(f"{self.arch} config.json: {key}={value!r} is not an integer")
        if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ArtifactError(f"{self.arch} config.json: {key}={value!r} is not a number")
        return kind(value)

    def integer(self, key: str, default: int | None = None) -> int:
        return int(self._typed(key, default, int))

    def number(self, key: str, default: float | None = None) -> float:
        return float(self._typed(key, default, float))

    def flag(self, key: str, default: bool | None = None) -> bool:
        return bool(self._typed(key, default, bool))


def _architecture(cfg: Mapping[str, Any]) -> str:
    names = cfg.get("architectures") or []
    if not names and cfg.get("model_type") in _MODEL_TYPES:
        names = [_MODEL_TYPES[cfg["model_type"]]]
    if not isinstance(names, list) or len(names) != 1 or names[0] not in ARCHITECTURES:
        raise ArtifactError(f"unsupported architecture {names!r} (model_type "
                            f"{cfg.get('model_type')!r}); supported: {', '.join(ARCHITECTURES)}")
    return str(names[0])


def _reject_unsupported(c: _Config) -> None:
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise ArtifactError(f"{c.arch}: hidden_act={act!r} is not supported (only 'silu')")
    if c.raw.get("quantization_config") is not None:
        raise ArtifactError(f"{c.arch}: quantized checkpoints are not supported")
    params = c.raw.get("rope_parameters") or c.raw.get("rope_scaling") or {}
    partial = params.get("partial_rotary_factor", c.raw.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ArtifactError(f"{c.arch}: partial_rotary_factor={partial!r} is not supported")


def _attention_biases(c: _Config) -> tuple[bool, bool]:
    if c.arch == "Qwen2ForCausalLM":
        return True, False
    if c.arch == "Qwen2MoeForCausalLM":
        return c.flag("qkv_bias"), False
    if c.arch == "MixtralForCausalLM":
        return False, False
    bias = c.flag("attention_bias", False)
    return bias, bias


def _moe(c: _Config, layers: int) -> tuple[MoeSpec | None, tuple[int, ...]]:
    if c.arch == "MixtralForCausalLM":
        experts = _num_experts(c)
        spec = MoeSpec(experts, c.integer("num_experts_per_tok"), c.integer("intermediate_size"),
                       RoutingSpec(renormalize=True, weights_in_float32=True))
        return spec, tuple(range(layers))
    if c.arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return None, ()
    experts = _num_experts(c)
    step = c.integer("decoder_sparse_step", 1)
    dense = set(c.get("mlp_only_layers", []))
    chosen = tuple(i for i in range(layers)
                   if i not in dense and experts > 0 and (i + 1) % step == 0)
    if not chosen:
        return None, ()
    shared = c.integer("shared_expert_intermediate_size") if c.arch == "Qwen2MoeForCausalLM" else 0
    spec = MoeSpec(experts, c.integer("num_experts_per_tok"), c.integer("moe_intermediate_size"),
                   RoutingSpec(renormalize=c.flag("norm_topk_prob", False)), shared)
    return spec, chosen


def _num_experts(c: _Config) -> int:
    # transformers 5.x writes Qwen3-MoE's and Mixtral's count as num_local_experts, older files
    # (and Qwen2-MoE) as num_experts; the two names are aliases.
    for key in ("num_experts", "num_local_experts"):
        if c.raw.get(key) is not None:
            return c.integer(key)
    return c.integer("num_experts")


def _sliding_windows(c: _Config, layers: int) -> tuple[int | None, ...]:
    if c.arch == "LlamaForCausalLM":
        return (None,) * layers
    if c.arch == "MixtralForCausalLM":
        window = c.raw.get("sliding_window")
        return (int(window) if window else None,) * layers
    use = c.flag("use_sliding_window", False)
    window = c.integer("sliding_window") if use else None
    if c.arch == "Qwen3MoeForCausalLM":
        return (window or None,) * layers
    kinds = c.raw.get("layer_types") or _default_layer_types(c, layers, window)
    if len(kinds) != layers or not set(kinds) <= {"full_attention", "sliding_attention"}:
        raise ArtifactError(f"{c.arch}: layer_types={kinds!r} do not describe {layers} layers")
    return tuple((window or None) if k == "sliding_attention" else None for k in kinds)


def _default_layer_types(c: _Config, layers: int, window: int | None) -> list[str]:
    # Mirrors the two configs' __post_init__: Qwen2-MoE alternates below max_window_layers,
    # Qwen2/Qwen3 slide from max_window_layers up.
    top = c.integer("max_window_layers")
    if c.arch == "Qwen2MoeForCausalLM":
        sliding = [bool(window) and (i + 1) % 2 == 1 and i < top for i in range(layers)]
    else:
        sliding = [window is not None and i >= top for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _rope(c: _Config) -> RopeSpec:
    params = dict(c.raw.get("rope_parameters") or c.raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta") or c.number("rope_theta"))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_KINDS:
        raise ArtifactError(f"{c.arch}: rope_type {kind!r} is not supported; supported: "
                            f"{', '.join(ROPE_KINDS)}")
    if kind == "default":
        return RopeSpec("default", theta)
    factor = params.get("factor")
    if kind == "linear":
        return RopeSpec("linear", theta, factor=_rope_number(c, params, "factor"))
    # transformers prefers a top-level original_max_position_embeddings (Phi-3 style).
    original = int(c.raw.get("original_max_position_embeddings")
                   or params.get("original_max_position_embeddings")
                   or c.integer("max_position_embeddings"))
    if kind == "llama3":
        return RopeSpec("llama3", theta, factor=_rope_number(c, params, "factor"),
                        original_max_position=original,
                        low_freq_factor=_rope_number(c, params, "low_freq_factor"),
                        high_freq_factor=_rope_number(c, params, "high_freq_factor"))
    factor = float(factor) if factor is not None else c.integer("max_position_embeddings") / original
    return RopeSpec("yarn", theta, factor=factor, original_max_position=original,
                    beta_fast=float(params.get("beta_fast") or 32),
                    beta_slow=float(params.get("beta_slow") or 1),
                    truncate=bool(params.get("truncate", True)),
                    attention_factor=_yarn_attention_factor(params, factor))


def _rope_number(c: _Config, params: Mapping[str, Any], key: str) -> float:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArtifactError(f"{c.arch}: rope parameter {key}={value!r} is missing or not a number")
    return float(value)


def _yarn_attention_factor(params: Mapping[str, Any], factor: float) -> float:
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def _conditioning(c: _Config) -> ConditioningSpec | None:
    """``embedding_conditioning`` (None when absent); unknown keys and non-booleans refused."""
    raw = c.raw.get("embedding_conditioning")
    if raw is None:
        return None
    known = ("time", "self_condition")
    if not isinstance(raw, Mapping) or set(raw) - set(known) or not all(
            isinstance(v, bool) for v in raw.values()):
        raise ArtifactError(f"{c.arch}: embedding_conditioning={raw!r} must map some of "
                            f"{', '.join(known)} to booleans")
    return ConditioningSpec(**raw)


def _dtype(c: _Config) -> str:
    value = c.raw.get("dtype") or c.raw.get("torch_dtype") or "float32"
    if value not in DTYPES:
        raise ArtifactError(f"{c.arch}: dtype {value!r} is not supported; supported: "
                            f"{', '.join(DTYPES)}")
    return str(value)
