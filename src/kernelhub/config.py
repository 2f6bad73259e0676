"""kernelhub configuration: which repository each layer comes from, pinned per capability and per device.

Read from `kernelhub.toml` (top level) or `pyproject.toml` (`[tool.kernelhub]`); schema in docs/config.md.
`KernelhubConfig.repository_for(layer, device, capability, default)` is what `kernelize` asks.
"""

from __future__ import annotations

import difflib
import keyword
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    PrivateAttr,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from kernelhub._fetch import check_repo_id
from kernelhub.errors import ConfigError  # re-exported: its earlier import path
from kernelhub.hub import LayerRepository, LocalLayerRepository, LockedLayerRepository, deferred_lock_check

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["ConfigError", "KernelhubConfig", "LayerConfig", "PinConfig", "load_config"]

_CAPABILITY_RE = re.compile(r"^(\d+)\.(\d)$")
# One spelling per device, as torch prints it: "cuda:01" would never equal f"{type}:{index}".
# (CPU tensors have no index: "cpu:0" never matches either.)
_DEVICE_RE = re.compile(r"^(cuda|xpu|npu|mps):(0|[1-9]\d*)$")
# A Hub namespace (user or org), as in the first half of a repo id.
_PUBLISHER_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?$")


def _revision_problem(v: str) -> str | None:
    """Why `v` is not a branch, tag or commit name (git's ref rules), or None.

    A revision is joined into cache paths (`refs/<revision>`) and URLs: "..", a leading "/", a
    backslash or a control character there would leave the cache or mean something else.
    """
    if not v.strip() or v != v.strip():
        return "must be a non-empty string without surrounding spaces"
    if len(v) > 255:
        return "must be at most 255 characters"
    if any(ord(c) < 0x20 or c == "\x7f" for c in v) or any(c in v for c in " ~^:?*[\\"):
        return "must not contain spaces, control characters or any of ~^:?*[\\"
    if ".." in v or "@{" in v or v == "@":
        return "must not contain '..' or '@{'"
    parts = v.split("/")
    if any(not part or part.startswith(".") or part.endswith(".lock") for part in parts) or v.endswith("."):
        return "must be a branch, tag or commit: no empty, '.'-leading or '.lock' path parts, no trailing '.'"
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(cls.model_fields))
            if unknown:
                raise ValueError(f"unknown key {unknown[0]!r}; allowed keys: {sorted(cls.model_fields)}")
        return data


class PinConfig(_Strict):
    """Where a layer comes from: a Hub repo or a local path, a version or revision, a layer class name."""

    # strict str: bytes (or `revision = 1` from a dict) are mistakes, not text
    repo: StrictStr | None = None
    path: StrictStr | None = None
    # strict: TOML `version = true` or `"1"` is a mistake, not version 1 (the Python API refuses them too)
    version: StrictInt | None = None
    revision: StrictStr | None = None
    layer: StrictStr | None = None
    trust_remote_code: StrictBool | None = None  # None: as get_kernel's default (see hub._check_trust)

    @field_validator("repo")
    @classmethod
    def _repo(cls, v: str | None) -> str | None:
        if v is not None:
            try:  # the rule get_kernel applies ("--", "..", a trailing "." would fail at load time)
                check_repo_id("config", v)
            except ValueError as e:
                why = str(e).partition("is not a valid Hub id: ")[2]
                detail = f": {why}" if why else ""
                raise ValueError(f"`repo` must be a Hub id like 'org/name', got {v!r}{detail}") from None
        return v

    @field_validator("path")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        return _check_path("path", v)

    @field_validator("revision")
    @classmethod
    def _revision(cls, v: str | None) -> str | None:
        if v is not None and (problem := _revision_problem(v)):
            raise ValueError(f"`revision` {problem}, got {v!r}")
        return v

    @field_validator("layer")
    @classmethod
    def _layer(cls, v: str | None) -> str | None:
        if v is not None and (not v.isidentifier() or keyword.iskeyword(v)):
            raise ValueError(f"`layer` must be a layer class name, got {v!r}")
        return v

    @field_validator("version")
    @classmethod
    def _version(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"`version` must be an int >= 1, got {v!r}")
        return v

    @model_validator(mode="after")
    def _exclusive(self) -> PinConfig:
        if self.repo is not None and self.path is not None:
            raise ValueError("give `repo` (Hub) or `path` (local), not both")
        if self.version is not None and self.revision is not None:
            raise ValueError("give `version` or `revision`, not both")
        if self.path is not None and (self.version is not None or self.revision is not None):
            raise ValueError("`version`/`revision` apply to a Hub `repo`, not to a local `path`")
        return self

    def has_source(self) -> bool:
        return self.repo is not None or self.path is not None


class LayerConfig(PinConfig):
    """A layer's general entry plus overrides: `capability."9.0"` pins and `device."cuda:1"` overrides."""

    capability: dict[str, PinConfig] = {}
    device: dict[str, PinConfig] = {}

    @field_validator("capability")
    @classmethod
    def _capability_keys(cls, v: dict[str, PinConfig]) -> dict[str, PinConfig]:
        seen: dict[int, str] = {}
        for key in v:
            m = _CAPABILITY_RE.match(key)
            if not m:
                raise ValueError(f"capability key {key!r} must be a capability like '9.0' or '8.6'")
            cap = int(m.group(1)) * 10 + int(m.group(2))
            if cap in seen:
                raise ValueError(f"capability keys {seen[cap]!r} and {key!r} name the same capability")
            seen[cap] = key
        return v

    @field_validator("device")
    @classmethod
    def _device_keys(cls, v: dict[str, PinConfig]) -> dict[str, PinConfig]:
        for key in v:
            if not _DEVICE_RE.match(key):
                hint = ""
                if key.startswith("cpu"):
                    hint = " (CPU tensors have no device index: the layer's general entry covers the CPU)"
                elif re.match(r"^[a-z]+:0\d+$", key):
                    hint = f" (write the index without leading zeros: {key.split(':')[0]}:{int(key.split(':')[1])})"
                raise ValueError(f"device key {key!r} must be a GPU with an index like 'cuda:1'{hint}")
        return v

    def capability_pins(self) -> dict[int, PinConfig]:
        out = {}
        for key, pin in self.capability.items():
            major, minor = _CAPABILITY_RE.match(key).groups()
            out[int(major) * 10 + int(minor)] = pin
        return out


class KernelhubConfig(_Strict):
    """The whole `[tool.kernelhub]` table."""

    layers: dict[str, LayerConfig] = {}
    trusted_publishers: list[StrictStr] = []
    lockfile: StrictStr | None = None
    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)

    @field_validator("layers")
    @classmethod
    def _layer_names(cls, v: dict[str, LayerConfig]) -> dict[str, LayerConfig]:
        for key in v:
            if not key.isidentifier() or keyword.iskeyword(key):
                raise ValueError(f"layer name {key!r} must be an identifier like 'SwiGLUMLP'")
        return v

    @field_validator("trusted_publishers")
    @classmethod
    def _publishers(cls, v: list[str]) -> list[str]:
        # A publisher that no repo id can have (" org", "", "org/x") would trust nothing, silently.
        for name in v:
            if not _PUBLISHER_RE.match(name) or "--" in name or ".." in name:
                raise ValueError(
                    f"`trusted_publishers` entries must be Hub user or org names like 'my-org', got {name!r}"
                )
        return v

    @field_validator("lockfile")
    @classmethod
    def _lockfile(cls, v: str | None) -> str | None:
        return _check_path("lockfile", v)

    @classmethod
    def from_dict(
        cls, data: dict, *, base_dir: str | Path | None = None, source: str = "config"
    ) -> KernelhubConfig:
        """Validate a `[tool.kernelhub]` table; relative `path`/`lockfile` resolve against `base_dir`."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a table, got {type(data).__name__}")
        if base_dir is not None and not isinstance(base_dir, (str, Path)):
            raise TypeError(
                f"KernelhubConfig.from_dict: `base_dir` must be a str or Path, got {type(base_dir).__name__}"
            )
        try:
            config = cls.model_validate(data)
        except ValidationError as e:
            lines = []
            for err in e.errors():
                loc = ".".join(str(x) for x in err["loc"])
                msg = err["msg"].removeprefix("Value error, ")
                lines.append(f"{source}: {loc or '<top>'}: {msg}")
            raise ConfigError("\n".join(lines)) from None
        config._base_dir = Path(base_dir) if base_dir is not None else Path.cwd()
        if config.lockfile is not None and (config._base_dir / config.lockfile).is_dir():
            raise ConfigError(f"{source}: lockfile: `lockfile` {config.lockfile!r} is a directory, not a lock file")
        return config

    # -- building repositories -------------------------------------------------------------------
    def _hub(self, repo: str, layer: str, version: int | None, revision: str | None, trust: bool | None):
        if self.lockfile is not None:
            with deferred_lock_check():  # a kernel the lock lacks is kernelize's load failure, not a crash
                return LockedLayerRepository(
                    repo,
                    layer_name=layer,
                    lockfile=self._base_dir / self.lockfile,
                    version=version,
                    revision=revision,
                )
        trusted = True if trust or repo.split("/", 1)[0] in self.trusted_publishers else trust
        return LayerRepository(
            repo, layer_name=layer, version=version, revision=revision, trust_remote_code=trusted
        )

    def _build(self, pin: PinConfig, layer: str, base, where: str):
        """The repository `pin` describes, on top of `base` (the repository it overrides, may be None)."""
        layer = pin.layer or layer
        if pin.repo is not None:
            return self._hub(pin.repo, layer, pin.version, pin.revision, pin.trust_remote_code)
        if pin.path is not None:
            return LocalLayerRepository(self._base_dir / pin.path, layer_name=layer)
        if pin.version is not None or pin.revision is not None:
            repo_id = getattr(base, "repo_id", None)
            if repo_id is None:
                raise ConfigError(
                    f"config: {where} sets version/revision but names no `repo`, and the repository "
                    f"it overrides is {base.describe() if base else 'none'} (not a Hub repository)"
                )
            trust = pin.trust_remote_code
            if trust is None:
                trust = getattr(base, "trust_remote_code", None)
            return self._hub(repo_id, layer, pin.version, pin.revision, trust)
        if base is None:
            if pin.layer is None:
                return None
            raise ConfigError(
                f"config: {where} chooses layer {pin.layer!r} but no repository is configured or "
                "registered to take it from (add `repo` or `path`)"
            )
        return base.with_layer_name(layer) if layer != base.layer_name else base

    def repository_for(self, layer_name: str, device: torch.device | None, capability: int | None, default):
        """The repository this config wants for `layer_name` on `device`, or None if it says nothing.

        Precedence: a `device."cuda:N"` override for that index, then a `capability."X.Y"` pin, then the
        layer's general entry. Overrides apply on top of the general entry (or of `default`, the
        registry's choice, when the entry names no repo/path): a pin with only `layer` picks another
        layer class of the same repository; with only `version`/`revision`, another ref of the same
        Hub repository.
        """
        entry = self.layers.get(layer_name)
        if entry is None:
            return None
        where = f"layers.{layer_name}"
        base = self._build(
            entry, default.layer_name if (default and not entry.has_source()) else layer_name, default, where
        )
        pin, pin_where = None, where
        if device is not None and device.index is not None:
            key = f"{device.type}:{device.index}"
            pin, pin_where = entry.device.get(key), f"{where}.device.{key}"
        if pin is None and capability is not None:
            pin = entry.capability_pins().get(capability)
            pin_where = f"{where}.capability.{capability // 10}.{capability % 10}"
        if pin is None:
            return base
        return self._build(pin, base.layer_name if base is not None else layer_name, base, pin_where)

    def hub_kernels(self) -> list[tuple[str, int | None, str | None]]:
        """Distinct (repo_id, version, revision) of every Hub kernel the config names (for lock/download)."""
        out: list[tuple[str, int | None, str | None]] = []
        for entry in self.layers.values():
            for pin in [entry, *entry.capability.values(), *entry.device.values()]:
                repo = pin.repo or (entry.repo if pin is not entry and pin.path is None else None)
                if repo is None:
                    continue
                ref = (
                    (pin.version, pin.revision)
                    if (pin.repo or pin.version or pin.revision)
                    else (entry.version, entry.revision)
                )
                item = (repo, *ref)
                if item not in out:
                    out.append(item)
        return out


def _check_path(key: str, v: str | None) -> str | None:
    if v is not None and (not v.strip() or "\x00" in v):
        raise ValueError(f"`{key}` must be a non-empty string (a file path), got {v!r}")
    return v


def _read_toml(path: Path) -> dict:
    # TOML is UTF-8 by definition (not the locale's encoding)
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"load_config: {path} is not UTF-8 text (byte {e.start}): TOML must be UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"load_config: {path} is not valid TOML: {e}") from e
    except RecursionError:  # the parser recurses once per nesting level of arrays and tables
        raise ConfigError(f"load_config: {path} is not valid TOML: nested too deeply") from None


def _tool_table(data: dict, path: Path) -> dict:
    """`data["tool"]`, which TOML allows to be any value (`tool = "kernelhub"`)."""
    tools = data.get("tool", {})
    if not isinstance(tools, dict):
        raise ConfigError(f"load_config: {path}: `tool` must be a table ([tool.kernelhub]), got {tools!r}")
    return tools


def load_config(path: str | Path | None = None) -> KernelhubConfig | None:
    """Load `[tool.kernelhub]` from `path` (a pyproject.toml or kernelhub.toml, or a directory to search).

    With None, search the current directory: `kernelhub.toml`, then a `pyproject.toml` that has a
    `[tool.kernelhub]` table. Returns None when there is none.
    """
    if path is not None and not isinstance(path, (str, Path)):
        raise TypeError(f"load_config: `path` must be a str or Path, got {type(path).__name__}")
    if isinstance(path, str) and not path.strip():  # Path("") is "." : a silent search of the cwd
        raise ValueError(f"load_config: `path` must name a file or directory, got {path!r}")
    if path is None or Path(path).is_dir():
        folder = Path(path) if path is not None else Path.cwd()
        if (folder / "kernelhub.toml").is_file():
            return load_config(folder / "kernelhub.toml")
        pyproject = folder / "pyproject.toml"
        if pyproject.is_file():
            tools = _tool_table(_read_toml(pyproject), pyproject)
            if "kernelhub" in tools:
                return load_config(pyproject)
            near = difflib.get_close_matches("kernelhub", [str(k) for k in tools], n=1, cutoff=0.8)
            if near:  # `[tool.kernelhubb]` would otherwise be ignored without a word
                warnings.warn(f"load_config: {pyproject} has [tool.{near[0]}] but no [tool.kernelhub]; "
                              "a typo? It is not read.", UserWarning, stacklevel=2)
        return None
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_config: `path` {path} does not exist")
    data = _read_toml(path)
    if path.name == "pyproject.toml" or "tool" in data:
        if "kernelhub" not in _tool_table(data, path):
            raise ConfigError(f"load_config: {path} has no [tool.kernelhub] table")
        return KernelhubConfig.from_dict(
            data["tool"]["kernelhub"], base_dir=path.parent, source=f"{path} [tool.kernelhub]"
        )
    return KernelhubConfig.from_dict(data, base_dir=path.parent, source=str(path))
