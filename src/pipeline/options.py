"""Backend options: how a model is loaded and run, as one validated value.

Owns :class:`BackendOptions` (device, compute dtype, slots, window, the key/value pool's
size and block size, weight packing, the MoE kernel, quantized GGUF weights, and options for third-party
backends) and :func:`check_device`, which refuses a device this machine lacks with an error
that says what to use instead. ``build(options=...)``, ``pipeline run``, ``pipeline chat``
and ``pipeline serve`` all go through this one value, so a value is checked the same way
wherever it comes from. The value itself does not depend on the machine (it may be written
on one machine for another); only :func:`check_device` asks the machine, and ``build()``
calls it before anything loads.

Example::

    opts = BackendOptions(device="cuda:1", dtype="bfloat16", num_slots=4)
    build("Qwen3-0.6B/", options=opts)
    build("Qwen3-0.6B/", options={"dtype": "bfloat16"})     # the same, from a mapping
    build("tiny", options={"dtpye": "float32"})   # UnknownFieldError: did you mean 'dtype'?
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Never

import attrs

from pipeline.errors import InvalidValueError, UnknownFieldError, closest

if TYPE_CHECKING:  # torch loads when a device other than "cpu" is parsed or a model built:
    import torch   # counting tokens (`pipeline count`) never needs it

DEVICE_TYPES = ("cpu", "cuda", "mps")
"""Device types the torch backend runs on."""
DTYPES = ("float32", "bfloat16", "float16")
"""Compute dtypes the torch backend runs in."""
MOE_KERNELS = ("torch", "triton")
"""Named routed-expert functions (a callable with ``moe_forward``'s signature works too)."""
MAX_SLOTS = 4096
"""Most concurrent sequences one backend may preallocate caches for."""
MAX_BLOCK_SIZE = 1024
"""Most positions one key/value block may hold."""
DEFAULT_BLOCK_SIZE = 16
"""Positions per key/value block unless said otherwise, the engine's block manager's too
(vLLM's and nano-vllm's defaults are 16 and 256; 16 wastes at most 15 positions a
sequence)."""

MoeChoice = str | Callable[..., Any]


def device_name(value: Any) -> str:
    """A device name as torch spells it (``"cuda"``, ``"cuda:1"``), or InvalidValueError."""
    if value == "cpu":  # the default, spelt as torch spells it: no need to load torch
        return "cpu"
    import torch

    if isinstance(value, torch.device):
        device = value
    elif isinstance(value, str):
        try:
            device = torch.device(value)
        except (RuntimeError, ValueError):
            raise InvalidValueError("device", value, "not a torch device: use 'cpu', 'cuda', "
                                    "'cuda:N' or 'mps'") from None
        if device.index is not None and str(device.index) != value.rpartition(":")[2]:
            # torch keeps the index in 8 bits: "cuda:999" would silently be "cuda:-25"
            raise InvalidValueError("device", value, "the device index is out of range")
    else:
        raise InvalidValueError("device", value, "must be a device name such as 'cpu' or 'cuda'")
    if device.type not in DEVICE_TYPES:
        raise InvalidValueError("device", value, f"device type {device.type!r} is not "
                                "supported: use 'cpu', 'cuda', 'cuda:N' or 'mps'")
    return str(device)


def dtype_name(value: Any) -> str | None:
    """A dtype name from :data:`DTYPES` (a ``torch.dtype`` becomes its name), or None."""
    if value is None:
        return None
    name = value
    if not isinstance(value, str):
        import torch

        name = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
    if not isinstance(name, str) or name not in DTYPES:
        hint = closest(name, DTYPES) if isinstance(name, str) else None
        guess = f" (did you mean {hint!r}?)" if hint else ""
        raise InvalidValueError("dtype", value, f"must be one of {', '.join(DTYPES)}{guess}")
    return name


def _moe(value: Any) -> MoeChoice:
    if callable(value):
        return value  # type: ignore[no-any-return]
    if isinstance(value, str) and value in MOE_KERNELS:
        return value
    hint = closest(value, MOE_KERNELS) if isinstance(value, str) else None
    guess = f" (did you mean {hint!r}?)" if hint else ""
    raise InvalidValueError("moe", value, f"must be 'torch', 'triton' or a callable with "
                            f"moe_forward's signature{guess}")


def _paths(value: Any) -> tuple[Path, ...]:
    if isinstance(value, (str, Path)):
        return (Path(value),)
    if not isinstance(value, Iterable):
        raise InvalidValueError("moe_configs", value, "must be a list of folders")
    out = tuple(value)
    for item in out:
        if not isinstance(item, (str, Path)):
            raise InvalidValueError("moe_configs", item, "each entry must be a folder path")
    return tuple(Path(p) for p in out)


def _extra(value: Any) -> Mapping[str, Any]:
    if value is None:
        return MappingProxyType({})
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise InvalidValueError("extra", value, "must be a mapping of option names to values")
    return MappingProxyType(dict(value))


def _count(lo: int, hi: int | None = None) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    """An attrs validator: None is allowed by the caller's ``optional``; else an int in range."""

    def validate(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo
        if not ok or (hi is not None and value > hi):
            bound = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise InvalidValueError(attribute.name, value, f"must be an integer {bound}")

    return validate


def _flag(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidValueError(attribute.name, value, "must be True or False")


KV_CACHE_DTYPES = ("int8",)
"""What ``kv_cache_dtype`` may name (None: the compute dtype)."""


def _kv_dtype(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and value not in KV_CACHE_DTYPES:
        raise InvalidValueError(attribute.name, value, "must be 'int8' or None (the compute "
                                "dtype)")


EXPERT_CACHE_POLICIES = ("lru", "lfu")
"""What ``expert_cache_policy`` may name."""


def _policy(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in EXPERT_CACHE_POLICIES:
        raise InvalidValueError(attribute.name, value, "must be 'lru' or 'lfu'")


@attrs.frozen(init=False)
class BackendOptions:
    """How the model backend loads and runs a model; every field is checked when it is built.

    - ``device``: ``"cpu"`` (default), ``"cuda"``, ``"cuda:N"`` or ``"mps"`` (parsed by
      ``torch.device``; whether this machine has it is checked by ``build()``);
    - ``dtype``: compute dtype, ``"float32"``, ``"bfloat16"`` or ``"float16"`` (a
      ``torch.dtype`` is taken too); None: the checkpoint's own (float32 for GGUF files);
    - ``num_slots``: sequences that can run at once (each gets a preallocated key/value
      cache), 1..4096, default 8;
    - ``max_context``: the window in tokens (None: the model's own, or for GGUF files what
      ``kv_cache_bytes`` holds);
    - ``kv_cache_bytes``: the key/value pool's byte budget: the pool is the blocks it holds,
      and when ``max_context`` is not given the window is cut to what it holds for
      ``num_slots`` slots (GGUF files: the window is cut to 1 GiB's worth unless given);
    - ``kv_blocks``: the key/value pool's size in blocks, >= 1 (None: ``num_slots`` windows,
      or what ``kv_cache_bytes`` holds; give at most one of the two); a pool must hold at
      least one window;
    - ``block_size``: positions per key/value block, 1..1024, default 16 (the unit of
      prefix-cache sharing and of KV memory allocation);
    - ``kv_cache_dtype``: ``"int8"`` keeps keys and values as int8 with a float32 scale per
      position and head, dequantized as attention reads them (D + 4 bytes a head and
      position instead of 4·D in float32: about 3.8 times the context in the same memory;
      ``benchmarks/kv_int8.py`` measures the logit error and greedy agreement); None (the
      default): the compute dtype;
    - ``expert_cache_bytes``: a memory cap for an MoE model's routed experts: at most this
      many bytes of them stay resident (converted, on the device), the rest are read from the
      memory-mapped weight file when routing asks for them, with identical results
      (``benchmarks/expert_tiers.py`` measures the speed against the fraction resident);
      None (the default): every expert loaded; ``expert_cache_policy``: whom a miss evicts,
      ``"lfu"`` (default: the least often routed recently) or ``"lru"``;
    - ``pack``: oneDNN-packed copies of float32 CPU weights (faster, twice the memory),
      default True;
    - ``quantized``: keep a GGUF file's quantized matrices in their encoding: Q4_0, Q4_1,
      Q4_K, Q5_K and Q8_0 on torch's int4 kernel with bfloat16 activations (Q6_K as a
      bfloat16 copy), a quantized token table and output head
      in float16 (a fifth of the memory and several times the decode speed of float32 on a
      CPU; logits agree with the dequantized float32 model to about 1e-2 relative); None (the
      default) turns it on for GGUF files on a CPU at the float32 compute dtype
      (:meth:`keeps_quantized`); True for a Hugging Face folder is an error;
    - ``moe``: the routed-experts function of MoE layers, ``"torch"`` (the reference),
      ``"triton"`` (fused kernels) or a callable with ``moe_forward``'s signature;
      ``moe_configs``: folders of tuned Triton launch tables;
    - ``threads``: the CPU threads a model's products use, 1..1024 (set process-wide with
      ``torch.set_num_threads`` when the model is built); None (the default) keeps torch's
      count and lets the torch backend choose, for each decode step, between one thread and
      that count by measuring which is faster lately (on a machine whose other cores are busy
      one thread is often faster: :mod:`backends.torch.threads`);
    - ``batch_invariant``: a sequence's results independent of the batch it runs in and of how
      its prompt was cut into chunks, in every dtype (fixed-size product tiles, grid-aligned
      prompt attention; ``docs/performance.md`` has the cost); None (the default) turns it on
      for CPU devices and off for others (:attr:`invariant` is the resolved value);
    - ``extra``: options for a third-party backend, passed to it as given (the built-in
      backends refuse any).

    An unknown name, as a keyword or a mapping key, is an
    :class:`~pipeline.errors.UnknownFieldError` suggesting the closest field; a bad value an
    :class:`~pipeline.errors.InvalidValueError` naming the field.
    """

    device: str = attrs.field(converter=device_name)
    dtype: str | None = attrs.field(converter=dtype_name)
    num_slots: int = attrs.field(validator=_count(1, MAX_SLOTS))
    max_context: int | None = attrs.field(validator=attrs.validators.optional(_count(1)))
    kv_cache_bytes: int | None = attrs.field(validator=attrs.validators.optional(_count(1)))
    kv_blocks: int | None = attrs.field(validator=attrs.validators.optional(_count(1)))
    block_size: int = attrs.field(validator=_count(1, MAX_BLOCK_SIZE))
    kv_cache_dtype: str | None = attrs.field(validator=_kv_dtype)
    expert_cache_bytes: int | None = attrs.field(
        validator=attrs.validators.optional(_count(1)))
    expert_cache_policy: str = attrs.field(validator=_policy)
    pack: bool = attrs.field(validator=_flag)
    quantized: bool | None = attrs.field(validator=attrs.validators.optional(_flag))
    moe: MoeChoice = attrs.field(converter=_moe, eq=False)
    moe_configs: tuple[Path, ...] = attrs.field(converter=_paths)
    batch_invariant: bool | None = attrs.field(
        validator=attrs.validators.optional(_flag))
    threads: int | None = attrs.field(validator=attrs.validators.optional(_count(1, 1024)))
    extra: Mapping[str, Any] = attrs.field(converter=_extra, eq=False)

    def __init__(self, *, device: str | torch.device = "cpu",
                 dtype: str | torch.dtype | None = None, num_slots: int = 8,
                 max_context: int | None = None, kv_cache_bytes: int | None = None,
                 kv_blocks: int | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 kv_cache_dtype: str | None = None, expert_cache_bytes: int | None = None,
                 expert_cache_policy: str = "lfu", pack: bool = True, quantized: bool | None = None, moe: MoeChoice = "torch",
                 moe_configs: Iterable[str | Path] = (), batch_invariant: bool | None = None,
                 threads: int | None = None, extra: Mapping[str, Any] | None = None, **unknown: Never) -> None:
        if unknown:
            raise UnknownFieldError("BackendOptions", sorted(unknown)[0], field_names())
        self.__attrs_init__(
            device=device, dtype=dtype, num_slots=num_slots, max_context=max_context,
            kv_cache_bytes=kv_cache_bytes, kv_blocks=kv_blocks, block_size=block_size,
            kv_cache_dtype=kv_cache_dtype, expert_cache_bytes=expert_cache_bytes,
            expert_cache_policy=expert_cache_policy, pack=pack, quantized=quantized, moe=moe, moe_configs=moe_configs,
            batch_invariant=batch_invariant, threads=threads, extra=extra)

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        """Pickled as its fields (``extra`` as a plain dict): an engine process's recipe."""
        fields = {name: getattr(self, name) for name in field_names()}
        fields["extra"] = dict(self.extra)
        return BackendOptions.from_dict, (fields,)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BackendOptions:
        """Build from a mapping of field names; an unknown key is an error naming the closest."""
        if not isinstance(data, Mapping):
            raise InvalidValueError("options", data, "must be a mapping of option names")
        for key in data:
            if not isinstance(key, str) or key not in field_names():
                raise UnknownFieldError("BackendOptions", str(key), field_names())
        return cls(**data)

    @classmethod
    def coerce(cls, value: BackendOptions | Mapping[str, Any] | None) -> BackendOptions:
        """What ``build(options=...)`` accepts: None (the defaults), a value, or a mapping."""
        if value is None:
            return cls()
        if isinstance(value, BackendOptions):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        raise InvalidValueError("options", value,
                                "must be a BackendOptions or a mapping of its fields")

    @property
    def invariant(self) -> bool:
        """``batch_invariant`` resolved: as given, else on for a CPU device."""
        if self.batch_invariant is not None:
            return self.batch_invariant
        return _device_type(self.device) == "cpu"

    @property
    def keeps_quantized(self) -> bool:
        """``quantized`` resolved for a GGUF file: as given, else on for a CPU device at the
        float32 compute dtype (the file's default)."""
        if self.quantized is not None:
            return self.quantized
        return _device_type(self.device) == "cpu" and self.dtype in (None, "float32")

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """``dtype`` as a ``torch.dtype`` (None: the checkpoint's own)."""
        import torch

        return None if self.dtype is None else getattr(torch, self.dtype)

    def refuse_extra(self, backend: str) -> None:
        """A built-in backend has no settings beyond the named fields: refuse ``extra`` ones
        rather than ignore a setting the caller believes took effect."""
        if self.extra:
            raise InvalidValueError("extra", dict(self.extra), f"the {backend} backend takes "
                                    "no extra options (they are for third-party backends)")

    def check_device(self) -> None:
        """Raise :class:`~pipeline.errors.InvalidValueError` unless this machine has
        ``device`` (see :func:`check_device`)."""
        check_device(self.device)


def field_names() -> tuple[str, ...]:
    """The fields of :class:`BackendOptions`, in declaration order."""
    return tuple(a.name for a in attrs.fields(BackendOptions))


def _device_type(name: str) -> str:
    """``"cuda"`` of ``"cuda:1"``: the type of a device name :func:`device_name` gave."""
    return name.partition(":")[0]


def check_device(device: str | torch.device) -> None:
    """Raise :class:`~pipeline.errors.InvalidValueError` unless this machine can run on
    ``device``, saying why not (torch built without CUDA, no visible device, an index past
    the devices there are, no MPS) and what to use instead."""
    import torch

    name = device_name(device)
    dev = torch.device(name)
    why = None
    if dev.type == "cuda":
        why = _cuda_problem(dev)
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        why = ("MPS is not available on this machine (it needs Apple silicon and a torch "
               "built with MPS)")
    if why is not None:
        raise InvalidValueError("device", name, f"{why}; use device='cpu'")


def _cuda_problem(dev: torch.device) -> str | None:
    import torch

    if not torch.backends.cuda.is_built():  # type: ignore[no-untyped-call]
        return (f"CUDA is not available on this machine: this torch ({torch.__version__}) "
                "was built without CUDA")
    if not torch.cuda.is_available():
        return ("CUDA is not available on this machine: torch finds no CUDA device (check "
                "the driver and CUDA_VISIBLE_DEVICES)")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        return (f"this machine has {count} CUDA device{'s' if count != 1 else ''} "
                f"(cuda:0..cuda:{count - 1})")
    return None
