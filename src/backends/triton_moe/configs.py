"""Launch configurations: tuned JSON tables, nearest-batch lookup, and a heuristic default.

Owns :class:`LaunchConfig`, :class:`ConfigKey`, the table file format and
:class:`ConfigTables` (the lookup). A table is one JSON file per
(experts, intermediate size, device, dtype), named like vLLM's::

    E=128,N=768,device_name=NVIDIA_H200,dtype=bfloat16.json

holding ``{"triton_version": "3.x", "configs": {"<batch tokens>": {"block_m": .., "block_n":
.., "block_k": .., "group_m": .., "num_warps": .., "num_stages": ..}}}``. A lookup for T
tokens takes the entry whose key is nearest to T (ties to the smaller key). Tables are looked
for in the folders given, in order, then in the ``configs/`` folder of this package; without
one, :func:`default_config` decides. ``benchmarks/moe_tune.py`` writes tables.

Example::

    tables = ConfigTables()
    cfg = tables.pick(ConfigKey(8, 14336, "NVIDIA_H200", "bfloat16"), num_tokens=16)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from pipeline.errors import ArtifactError, InvalidValueError

PACKAGE_TABLES = Path(__file__).parent / "configs"
FIELDS = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")


def _power_of_two(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1 or value & (value - 1):
        raise InvalidValueError(attribute.name, value, "must be a power of two")


@attrs.frozen
class LaunchConfig:
    """Tile sizes (powers of two), row-block grouping, warps and pipeline stages."""

    block_m: int = attrs.field(validator=_power_of_two)
    block_n: int = attrs.field(validator=_power_of_two)
    block_k: int = attrs.field(validator=_power_of_two)
    group_m: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    num_warps: int = attrs.field(default=4, validator=_power_of_two)
    num_stages: int = attrs.field(default=3, validator=attrs.validators.ge(1))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LaunchConfig:
        """From a table entry; an unknown or missing key is an error."""
        unknown = set(data) - set(FIELDS)
        if unknown:
            raise InvalidValueError("launch config", sorted(unknown),
                                    f"unknown keys; known: {', '.join(FIELDS)}")
        missing = {"block_m", "block_n", "block_k"} - set(data)
        if missing:
            raise InvalidValueError("launch config", sorted(missing), "missing keys")
        return cls(**{k: int(v) for k, v in data.items()})

    def to_dict(self) -> dict[str, int]:
        """The table entry for this config."""
        return attrs.asdict(self)


@attrs.frozen
class ConfigKey:
    """What a table is tuned for: experts, intermediate size, device name, dtype name."""

    num_experts: int
    intermediate: int
    device: str
    dtype: str

    @property
    def file_name(self) -> str:
        """The table's file name."""
        device = self.device.replace(" ", "_")
        return (f"E={self.num_experts},N={self.intermediate},device_name={device},"
                f"dtype={self.dtype}.json")


INTERPRETER_DEVICE = "interpreter"


def default_config(num_tokens: int, num_experts: int, top_k: int,
                   device: str = "") -> LaunchConfig:
    """The untuned default. On a GPU, vLLM's: small row blocks while experts see about one
    token each. Under the Triton interpreter, whose cost is per program and per operation
    rather than per element, wide tiles (fewer programs)."""
    if device == INTERPRETER_DEVICE:
        return LaunchConfig(block_m=16, block_n=128, block_k=128, group_m=1)
    if num_tokens * top_k <= num_experts or num_tokens <= 32:
        return LaunchConfig(block_m=16, block_n=32, block_k=64, group_m=1)
    return LaunchConfig(block_m=64, block_n=64, block_k=32, group_m=8)


def read_table(path: Path) -> dict[int, LaunchConfig]:
    """The ``{batch tokens: config}`` map of one table file; raises
    :class:`~pipeline.errors.ArtifactError` naming the file when it is malformed."""
    try:
        data = json.loads(path.read_text())
        entries = data["configs"]
        table = {int(m): LaunchConfig.from_dict(c) for m, c in entries.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ArtifactError(f"MoE launch table {path.name} is unusable: {exc}") from exc
    if not table:
        raise ArtifactError(f"MoE launch table {path.name} has no entries")
    return table


def write_table(folder: Path, key: ConfigKey, table: Mapping[int, LaunchConfig],
                triton_version: str) -> Path:
    """Write ``table`` for ``key`` into ``folder``; returns the file's path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / key.file_name
    body = {"triton_version": triton_version,
            "configs": {str(m): table[m].to_dict() for m in sorted(table)}}
    path.write_text(json.dumps(body, indent=1) + "\n")
    return path


def nearest(table: Mapping[int, LaunchConfig], num_tokens: int) -> LaunchConfig:
    """The entry whose batch size is nearest ``num_tokens`` (ties to the smaller)."""
    return table[min(table, key=lambda m: (abs(m - num_tokens), m))]


class ConfigTables:
    """Finds and caches tables; one instance per MoE function, so files are read once."""

    def __init__(self, folders: Sequence[Path] = ()) -> None:
        self.folders = (*folders, PACKAGE_TABLES)
        self._tables: dict[ConfigKey, dict[int, LaunchConfig] | None] = {}

    def table(self, key: ConfigKey) -> dict[int, LaunchConfig] | None:
        """The table for ``key`` from the first folder that has one, else ``None``."""
        if key not in self._tables:
            found = next((f / key.file_name for f in self.folders
                          if (f / key.file_name).is_file()), None)
            self._tables[key] = read_table(found) if found else None
        return self._tables[key]

    def pick(self, key: ConfigKey, num_tokens: int, top_k: int = 1) -> LaunchConfig:
        """The tuned config nearest ``num_tokens``, or :func:`default_config`."""
        table = self.table(key)
        if table is None:
            return default_config(num_tokens, key.num_experts, top_k, key.device)
        return nearest(table, num_tokens)
