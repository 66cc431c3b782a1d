"""FlashInfer's compile cache read without importing torch or flashinfer: which variants would compile.

Where FlashInfer 0.7.2 keeps a built module (``flashinfer/jit/env.py``, ``flashinfer/jit/core.py``; as 0.6.13 did):

- JIT cache: ``$FLASHINFER_WORKSPACE_BASE`` (default: the home directory) ``/.cache/flashinfer/<version>/
  <arch>/cached_ops/<module>/<module>.so``, ``<arch>`` the target arch as nvcc names it without
  ``compute_`` (``compilation_context.py``: SM 9.x and SM ≥ 10 get an ``a`` suffix, SM 12.0 ``0f``:
  ``90a``, ``100a``, ``120f``; below SM 9 none: ``80``, ``89``);
- AOT modules shipped in the package: ``<flashinfer package>/data/aot/<module>/<module>.so``
  (found with ``importlib.util.find_spec``, which locates the package without running it).
  A ``flashinfer-jit-cache`` package's directory is not looked at (it needs the package imported).

``<module>`` is the name of the module the variant's wrappers load (0.7.2's ``flashinfer/jit/attention/modules.py``:
``get_batch_decode_uri``; ``get_batch_prefill_uri`` plus ``_kv_stride_equal`` for fa2, the module
``get_batch_prefill_module`` builds for fa2; ``get_batch_mla_uri``, which gained ``_planabi2``; our own complete
name for the attention-sink module, :func:`pipeline.backends.flashinfer_jit.sink_uri`), rebuilt by :func:`module_name`
for the :class:`pipeline.backends.flashinfer_jit.Variant` fields; ``tests/gpu/test_flashinfer_api.py`` compares them
with FlashInfer's own ``JitSpec`` names. ``attn-setup warmup`` records each compiled variant's
seconds in ``attn-setup-warmup-times.json`` beside ``cached_ops`` (:func:`record_seconds`), which
``plan`` reads to estimate the compile time of what would compile.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

_SHORT = {"float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2", "fp8_e4m3": "e4m3",
          "fp8_e5m2": "e5m2"}
TIMES_FILE = "attn-setup-warmup-times.json"


def module_name(v: Any) -> str:
    """The JIT module name of variant ``v`` in FlashInfer 0.7.2 (o dtype = q dtype, int32 indices, no RoPE in the
    kernel, no profiler); for a sink variant our own module name
    (:func:`~pipeline.backends.flashinfer_jit.sink_uri`)."""
    from pipeline.backends.flashinfer_jit import sink_uri

    q, kv = _SHORT.get(v.q_dtype, v.q_dtype), _SHORT.get(v.kv_dtype, v.kv_dtype)
    sm90 = "_sm90" if v.backend == "fa3" else ""
    dtypes = f"dtype_q_{q}_dtype_kv_{kv}_dtype_o_{q}_dtype_idx_i32_"
    if v.kind == "mla":
        return (f"batch_mla_attention_{dtypes}head_dim_ckv_{v.head_dim_vo}_head_dim_kpe_{v.head_dim_qk - v.head_dim_vo}"
                f"_profiler_False_planabi2{sm90}")
    if v.kind == "sink":
        return sink_uri(v, q, kv)
    head = f"{dtypes}head_dim_qk_{v.head_dim_qk}_head_dim_vo_{v.head_dim_vo}_posenc_0_use_swa_{v.sliding_window}"
    if v.kind == "decode":
        return f"batch_decode_with_kv_cache_{head}_use_logits_cap_{v.logit_softcap}"
    stride = "_kv_stride_equal" if v.backend == "fa2" else ""
    return f"batch_prefill_with_kv_cache_{head}_use_logits_cap_{v.logit_softcap}_f16qk_False{sm90}{stride}"


def arch_dir(arch: str) -> str:
    """``sm90`` → ``90a`` (FlashInfer's per-arch cache directory name); ``""`` for an unknown arch."""
    m = re.fullmatch(r"sm(\d+?)(\d)", arch or "")
    if m is None:
        return ""
    major, minor = int(m.group(1)), int(m.group(2))
    if major == 12 and minor == 0:
        return "120f"
    return f"{major}{minor}" + ("a" if major >= 9 else "")


def flashinfer_version() -> Optional[str]:
    """The installed ``flashinfer-python`` version (package metadata, no import), or None."""
    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def cache_dir(version: str, arch: str, env: Mapping[str, str] = os.environ) -> Path:
    """``…/.cache/flashinfer/<version>/<arch dir>`` (``cached_ops`` and the warmup times live in it)."""
    base = Path(env.get("FLASHINFER_WORKSPACE_BASE") or Path.home())
    return base / ".cache" / "flashinfer" / version / arch_dir(arch)


def aot_dir() -> Optional[Path]:
    """The installed flashinfer package's ``data/aot`` (located, not imported), or None."""
    try:
        spec = importlib.util.find_spec("flashinfer")
    except (ImportError, ValueError):
        spec = None
    locs = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locs[0]) / "data" / "aot" if locs else None


def cached_modules(version: str, arch: str, env: Mapping[str, str] = os.environ) -> set[str]:
    """Module names with a built ``.so`` in the JIT cache or the package's AOT directory."""
    out: set[str] = set()
    for root in (cache_dir(version, arch, env) / "cached_ops", aot_dir()):
        if root is not None and root.is_dir():
            out |= {d.name for d in root.iterdir() if (d / f"{d.name}.so").is_file()}
    return out


def _fields(name: str) -> dict[str, str]:
    """The key fields a module name spells (kind, dtypes, head dims, switches, sm90), for comparing two."""
    kind = ("decode" if name.startswith("batch_decode") else "mla" if name.startswith("batch_mla") else
            "sink" if "_sink_" in name else "prefill" if name.startswith("batch_prefill") else name)
    out = {"kind": kind, "backend": "fa3" if name.endswith(("_sm90", "_fa3")) else "fa2/cuda_core"}
    for key, pat in (("q_dtype", r"(?:dtype_q|_q)_([a-z0-9]+)"), ("kv_dtype", r"(?:dtype_kv|_kv)_([a-z0-9]+)"),
                     ("head_dim_qk", r"(?:head_dim_qk_|_d)(\d+)"), ("head_dim_vo", r"(?:head_dim_vo_|_d\d+x)(\d+)"),
                     ("sliding_window", r"_swa_(True|False)"), ("logit_softcap", r"use_logits_cap_(True|False)")):
        m = re.search(pat, name)
        out[key] = m.group(1) if m else "-"
    return out


def nearest(name: str, cached: Iterable[str]) -> tuple[Optional[str], list[str]]:
    """The cached module differing from ``name`` in the fewest key fields, and those fields (None, [] if none)."""
    want, best = _fields(name), (None, [])
    for c in sorted(cached):
        diff = [k for k, v in _fields(c).items() if want.get(k) != v]
        if best[0] is None or len(diff) < len(best[1]):
            best = (c, diff)
    return best


def recorded_seconds(version: str, arch: str, env: Mapping[str, str] = os.environ) -> dict[str, float]:
    """``{module: seconds}`` that ``warmup`` recorded beside the cache ({} when none or unreadable)."""
    try:
        data = json.loads((cache_dir(version, arch, env) / TIMES_FILE).read_text())
        return {str(k): float(v) for k, v in data.items() if isinstance(v, (int, float))}
    except (OSError, ValueError, AttributeError):
        return {}


def record_seconds(version: str, arch: str, results: Iterable[tuple[str, float]],
                   env: Mapping[str, str] = os.environ) -> None:
    """Merge ``(module, compile seconds)`` into the times file (written whole, then renamed)."""
    d = cache_dir(version, arch, env)
    d.mkdir(parents=True, exist_ok=True)
    times = {**recorded_seconds(version, arch, env), **dict(results)}
    tmp = d / f"{TIMES_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(times, sort_keys=True))
    os.replace(tmp, d / TIMES_FILE)


def cold_variants(variants: Iterable[Any], arch: str, version: Optional[str] = None,
                  env: Mapping[str, str] = os.environ) -> list[dict[str, Any]]:
    """Each variant that would compile on this machine: ``{variant, module, nearest, differs, estimate_s}``.

    ``version``: FlashInfer's (default: the installed one; without one nothing can be cached, so
    every variant would compile). ``estimate_s``: the seconds ``warmup`` recorded for that module, else
    the median recorded for the same kind, else None (no record beside the cache).
    """
    version = version or flashinfer_version()
    cached = cached_modules(version, arch, env) if version else set()
    times = recorded_seconds(version, arch, env) if version else {}
    out = []
    for v in variants:
        name = module_name(v)
        if name in cached:
            continue
        near, differs = nearest(name, cached)
        same = sorted(s for m, s in times.items() if _fields(m)["kind"] == v.kind)
        est = times.get(name, same[len(same) // 2] if same else None)
        out.append({"variant": v.name, "module": name, "nearest": near, "differs": differs, "estimate_s": est,
                    "flashinfer_version": version})
    return out
