"""transformers' configuration classes, loaded offline and torch-free, as the source of a model's structure.

:func:`text_config` builds the class transformers maps a ``model_type`` to (``CONFIG_MAPPING_NAMES``; never
``trust_remote_code``, no network, no weights) from a parsed ``config.json`` and returns its text (decoder) config,
or None when transformers does not know the ``model_type``. Only ``configuration_auto`` and the one
``configuration_<module>`` module are imported: the ``transformers`` / ``transformers.models`` package inits (a scan of
every model directory) are skipped, and while torch is not imported yet it is hidden so transformers does not import
it (``plan`` stays torch-free). :func:`forget_torchless` drops those modules so a later import that needs torch
(the model oracle) gets the whole library. :func:`read` gives what the reader takes from that config as a JSON-safe
:class:`Reading`, cached per file content and transformers version (a plan of a model read before imports no
transformers).

Raises ModelConfigError ``package_version_unsupported`` when the installed transformers is outside
:data:`TRANSFORMERS_SPEC` (or absent), ``model_config_malformed`` when the class refuses the file.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import pathlib
import sys
import types
from typing import Any, Mapping, Optional

import msgspec

from pipeline.core.errors import ModelConfigError

# The versions whose configuration classes attn-setup reads (pyproject.toml gives the same range; sglang 0.5.23 pins
# 5.19.0, the tested one).
TRANSFORMERS_SPEC = ">=5.17,<6"
CACHE_ENV = "ATTN_SETUP_CACHE_DIR"
_TORCHLESS = "_attn_setup_torchless"


def transformers_version() -> Optional[str]:
    """The installed transformers version by its metadata (no import), or None when absent."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def _check_version() -> None:
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    have = transformers_version()
    try:
        ok = have is not None and SpecifierSet(TRANSFORMERS_SPEC).contains(Version(have), prereleases=False)
    except InvalidVersion:
        ok = False
    if not ok:
        raise ModelConfigError(
            f"transformers {have or '(not installed)'} is outside the supported range {TRANSFORMERS_SPEC}: its "
            "configuration classes are what a model's layers are read from", code="package_version_unsupported",
            flags=[("transformers", have)], allowed=[f"transformers{TRANSFORMERS_SPEC}"],
            remedy=f"pip install 'transformers{TRANSFORMERS_SPEC}'")


def _import(name: str) -> Any:
    """``importlib.import_module(name)``; before torch is imported, without the package inits and with torch
    hidden (``sys.modules['torch'] = None`` makes transformers' ``is_torch_available()`` false): the modules so
    imported serve configuration classes only (:func:`forget_torchless`)."""
    if "torch" in sys.modules and sys.modules["torch"] is not None:
        return importlib.import_module(name)
    if "transformers" not in sys.modules:
        spec = importlib.util.find_spec("transformers")
        root = spec.submodule_search_locations[0]
        for pkg, path in (("transformers", root), ("transformers.models", f"{root}/models")):
            mod = types.ModuleType(pkg)
            mod.__path__, mod.__spec__ = [path], spec if pkg == "transformers" else None
            mod.__version__ = transformers_version()
            setattr(mod, _TORCHLESS, True)
            sys.modules[pkg] = mod
        sys.modules["transformers"].models = sys.modules["transformers.models"]
    # trio: an optional async backend of httpcore2 (imported by huggingface_hub); packages_distributions(): a scan of
    # every installed distribution transformers' import_utils runs at import (each ~0.1 s; neither is read here)
    hidden = [n for n in ("torch", "trio") if n not in sys.modules]
    for n in hidden:
        sys.modules[n] = None  # type: ignore[assignment]
    scan, importlib.metadata.packages_distributions = importlib.metadata.packages_distributions, dict
    try:
        return importlib.import_module(name)
    finally:
        importlib.metadata.packages_distributions = scan
        for n in hidden:
            del sys.modules[n]


_STASH: dict[str, types.ModuleType] = {}


class _TorchlessModules:
    """Around one reading: the torch-free transformers modules an earlier reading imported are put back into
    ``sys.modules`` (unless the whole library was imported since), and taken out again after, so nothing imported
    later in the process (torch's and FlashInfer's optional integrations, an engine) finds the partial package."""

    def __enter__(self) -> None:
        top = sys.modules.get("transformers")
        if top is None:
            sys.modules.update(_STASH)
        elif not getattr(top, _TORCHLESS, False):
            _STASH.clear()
            _CLASSES.clear()

    def __exit__(self, *exc: object) -> None:
        top = sys.modules.get("transformers")
        if top is not None and getattr(top, _TORCHLESS, False):
            for name in [n for n in sys.modules if n == "transformers" or n.startswith("transformers.")]:
                _STASH[name] = sys.modules.pop(name)


def forget_torchless() -> None:
    """Drop transformers' modules if :func:`text_config` imported them without torch, so the next import loads the
    whole library with torch (class identities of configs built before then are not kept)."""
    top = sys.modules.get("transformers")
    if top is not None and getattr(top, _TORCHLESS, False):
        for name in [n for n in sys.modules if n == "transformers" or n.startswith("transformers.")]:
            del sys.modules[name]
    _STASH.clear()
    _CLASSES.clear()


_CLASSES: dict[str, Optional[type]] = {}


def config_class(model_type: str) -> Optional[type]:
    """The configuration class transformers maps ``model_type`` to, or None when it has none."""
    _check_version()
    if model_type in _CLASSES:
        return _CLASSES[model_type]
    auto = _import("transformers.models.auto.configuration_auto")
    name = auto.CONFIG_MAPPING_NAMES.get(model_type)
    cls = None
    if name is not None:
        module = auto.model_type_to_module_name(model_type)
        cls = getattr(_import(f"transformers.models.{module}.configuration_{module}"), name)
    _CLASSES[model_type] = cls
    return cls


def build(cls: type, data: Mapping[str, Any]) -> Any:
    """``cls(**data)``; a value the class's type check refuses on a field attention is not read from (Llama-4's
    published ``attn_temperature_tuning: 4`` for a bool) is left to the class default. Raises what the class raises."""
    import copy

    # a copy: the classes standardize nested dicts in place (rope_parameters gains rope_theta), the caller's file stays
    kwargs = copy.deepcopy({k: v for k, v in data.items() if k not in ("transformers_version", "architectures",
                                                                        "auto_map")})
    for _ in range(8):
        try:
            return cls(**kwargs)
        except Exception as e:  # noqa: BLE001 - huggingface_hub's StrictDataclassFieldValidationError and kin
            field = _refused_field(e)
            if field is None or not _drop(kwargs, field):
                raise
    raise ValueError("too many fields refused")


def text_config(data: Mapping[str, Any], model_type: str) -> Optional[Any]:
    """transformers' text config built from ``data`` (the whole config.json) by ``model_type``'s class, or None when
    transformers does not know ``model_type``. Raises ModelConfigError (``model_config_malformed``) naming the class
    and its message when the class refuses the values."""
    cls = config_class(model_type)
    if cls is None:
        return None
    import logging

    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # class-default notes ("forcing last layer to full_attention") are not ours to print
    try:
        cfg = build(cls, data)
        return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    except Exception as e:  # noqa: BLE001 - the class's own validation, whatever it raises
        raise ModelConfigError(
            f"transformers {transformers_version()} {cls.__name__} refuses this config: {str(e)[:300]}",
            code="model_config_malformed", json_path="$", flags=[("model_type", model_type)],
            allowed=[f"a config {cls.__name__} accepts"],
            remedy="compare config.json with the model's published one on the Hub") from None
    finally:
        quiet.setLevel(level)


# Fields attention is read from: a value the class refuses here is the file's problem, never dropped.
_READ_FIELDS = frozenset({"num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "v_head_dim",
                          "hidden_size", "layer_types", "layers_block_type", "sliding_window", "attention_chunk_size",
                          "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "query_pre_attn_scalar",
                          "attn_logit_softcapping", "use_sliding_window", "max_window_layers", "text_config",
                          "model_type", "global_head_dim", "num_global_key_value_heads", "attention_k_eq_v",
                          "attention_multiplier", "index_topk", "rope_scaling", "rope_parameters", "rope_theta"})


def _refused_field(e: Exception) -> Optional[str]:
    """The field a strict-dataclass type check refused, when it is one attention is not read from."""
    import re

    if type(e).__name__ != "StrictDataclassFieldValidationError":
        return None
    m = re.search(r"field '([^']+)'", str(e))
    return m.group(1) if m and m.group(1) not in _READ_FIELDS else None


def _drop(kwargs: dict[str, Any], field: str) -> bool:
    """Remove ``field`` from ``kwargs`` or its ``text_config`` (copied); whether it was there."""
    if field in kwargs:
        del kwargs[field]
        return True
    inner = kwargs.get("text_config")
    if isinstance(inner, Mapping) and field in inner:
        kwargs["text_config"] = {k: v for k, v in inner.items() if k != field}
        return True
    return False


class Reading(msgspec.Struct, frozen=True, kw_only=True):
    """What the reader takes from transformers' text config (JSON-safe, so it can be cached): the class name, its
    fields (class defaults and derived ones included; values JSON cannot hold read as null), the per-layer list and
    its key (``layer_types`` / ``layers_block_type``, a property on some classes), the per-layer heads / kv heads /
    head dim of a heterogeneous config, and whether the class has a ``v_head_dim`` field of its own."""

    cls: str
    fields: dict[str, Any]
    layers: Optional[list[Any]] = None
    layers_key: Optional[str] = None
    per_layer: Optional[list[dict[str, Any]]] = None
    has_v_field: bool = False


_PER_LAYER_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim")
# Bumped when what a Reading holds changes: cached readings of an older layout are not used.
READING_VERSION = 1


def _reading(cfg: Any) -> Reading:
    fields = as_dict(cfg)
    layers, key = None, None
    for key in ("layer_types", "layers_block_type"):
        layers = fields.get(key) if fields.get(key) is not None else getattr(cfg, key, None)
        if layers is not None:
            break
    per_layer = None
    if getattr(cfg, "is_heterogeneous", False):
        per_layer = [{k: getattr(lc, k, None) for k in _PER_LAYER_KEYS} for lc in cfg.per_layer_config]
    safe = msgspec.json.decode(msgspec.json.encode(fields, enc_hook=lambda o: None))
    return Reading(cls=type(cfg).__name__, fields=safe, layers=None if layers is None else list(layers),
                   layers_key=key if layers is not None else None, per_layer=per_layer,
                   has_v_field="v_head_dim" in getattr(type(cfg), "__annotations__", {}))


def _cache_path(data: Mapping[str, Any], model_type: str) -> Optional[pathlib.Path]:
    """Where the reading of ``data`` is cached (``$ATTN_SETUP_CACHE_DIR``, else ``$XDG_CACHE_HOME/attn-setup``, else
    ``~/.cache/attn-setup``; ``ATTN_SETUP_CACHE_DIR=off``: none), keyed by the file's content, the model_type, the
    transformers version and :data:`READING_VERSION`."""
    base = os.environ.get(CACHE_ENV)
    if base == "off":
        return None
    if not base:
        base = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "attn-setup")
    try:
        key = msgspec.json.encode([data, model_type, transformers_version(), READING_VERSION], order="sorted")
    except (TypeError, ValueError, msgspec.EncodeError):  # a value JSON cannot hold (a 5000-digit integer): uncached
        return None
    return pathlib.Path(base) / "hf-readings" / f"{hashlib.sha256(key).hexdigest()[:32]}.json"


def read(data: Mapping[str, Any], model_type: str) -> Optional[Reading]:
    """:func:`text_config` of ``data`` as a :class:`Reading` (None when transformers does not know ``model_type``),
    from the cache when this file was read before by this transformers version (a reading needs transformers'
    import, ~0.3 s; a cached one a file read). Raises as :func:`text_config`."""
    _check_version()
    path = _cache_path(data, model_type)
    if path is not None and path.is_file():
        try:
            return msgspec.json.decode(path.read_bytes(), type=Reading)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            pass
    with _TorchlessModules():
        cfg = text_config(data, model_type)
        try:
            reading = None if cfg is None else _reading(cfg)
        except Exception as e:  # noqa: BLE001 - the class's to_dict on a value it took (a dtype list)
            raise ModelConfigError(f"transformers cannot read this config back: {type(e).__name__}: {str(e)[:200]}",
                                   code="model_config_malformed", json_path="$", flags=[("model_type", model_type)],
                                   allowed=["a config transformers reads"],
                                   remedy="compare config.json with the model's published one on the Hub") from None
    if reading is None:
        return None
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(msgspec.json.encode(reading))
            os.replace(tmp, path)
        except OSError:
            pass  # an unwritable cache only costs the next read its import
    return reading


def as_dict(cfg: Any) -> dict[str, Any]:
    """A config object's fields (class defaults included) as a plain dict, per-layer attributes read globally."""
    het = getattr(cfg, "is_heterogeneous", False)
    if het:
        cfg.allow_global_per_layer_attribute_access = True
    try:
        out = {k: v for k, v in vars(cfg).items() if not k.startswith("_")} | cfg.to_dict()
        for key in ("num_hidden_layers", "layers_block_type"):  # properties on some classes (NemotronHConfig)
            if out.get(key) is None and getattr(cfg, key, None) is not None:
                out[key] = getattr(cfg, key)
        return out
    finally:
        if het:
            cfg.allow_global_per_layer_attribute_access = False
