"""FlashInfer's kernel variants: which would compile, and each compile-or-load logged (docs/internals.md)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import structlog


_SHORT = {"float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2", "fp8_e4m3": "e4m3",
          "fp8_e5m2": "e5m2"}
TIMES_FILE = "attn-setup-warmup-times.json"


def module_name(v: Any) -> str:
    """The JIT module name of variant ``v`` in FlashInfer 0.7.2 (o dtype = q dtype, int32 indices, no RoPE in the
    kernel, no profiler); for a sink variant our own module name (:func:`sink_uri`)."""
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
    """Each variant that would compile here: ``{variant, module, nearest, differs, estimate_s}``. ``version``:
    FlashInfer's (default installed). ``estimate_s``: recorded seconds for the module, else the kind's median, else
    None."""
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


KINDS = ("decode", "prefill", "sink", "mla")
_SHORT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
# our KV-cache dtype names (``--kv-cache-dtype``) -> torch's, which FlashInfer's module generators take
_TORCH_NAME = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def _log():
    return structlog.get_logger("attn_setup")


@dataclass(frozen=True)
class Variant:
    """One FlashInfer kernel module. ``kind``: ``decode`` / ``prefill`` / ``sink`` / ``mla``; ``backend``:
    ``fa2``/``fa3``, ``"cuda_core"`` for decode; dtypes: torch names; ``sliding_window``/``logit_softcap``: compile-time
    switches; ``arch``: e.g. ``"sm90"``."""

    kind: str
    backend: str
    q_dtype: str
    kv_dtype: str
    head_dim_qk: int
    head_dim_vo: int
    sliding_window: bool = False
    logit_softcap: bool = False
    arch: str = ""

    @property
    def name(self) -> str:
        """Stable short name, e.g. ``prefill-fa2/bf16-bf16/d128/swa1/cap0/sm90``."""
        d = f"d{self.head_dim_qk}" if self.head_dim_qk == self.head_dim_vo else f"d{self.head_dim_qk}x{self.head_dim_vo}"
        q, kv = _SHORT.get(self.q_dtype, self.q_dtype), _SHORT.get(self.kv_dtype, self.kv_dtype)
        return (f"{self.kind}-{self.backend}/{q}-{kv}/{d}/swa{int(self.sliding_window)}"
                f"/cap{int(self.logit_softcap)}/{self.arch or 'any'}")

    def fields(self) -> dict[str, Any]:
        """The variant as a plain dict (for log events and JSON reports)."""
        return {"variant": self.name, **asdict(self)}


def variants_for(layer_kinds: Sequence[Any], prefill_backend: str, q_dtype: str, kv_dtype: str,
                 arch: str) -> list[Variant]:
    """The FlashInfer variants a backend needs for ``layer_kinds`` (torch-free). ``fa2`` adds CUDA-core decode kernels;
    sink kinds use the sink variant only, MLA kinds the MLA module (:func:`mla_backend`). Dtypes are torch names;
    ``fp8_e4m3``/``fp8_e5m2`` are accepted."""

    q_dtype, kv_dtype = _TORCH_NAME.get(q_dtype, q_dtype), _TORCH_NAME.get(kv_dtype, kv_dtype)
    out: list[Variant] = []
    for k in layer_kinds:
        swa, cap = bool(k.sliding_window), bool(k.logit_softcap)
        base = dict(q_dtype=q_dtype, kv_dtype=kv_dtype, head_dim_qk=k.head_dim_qk, head_dim_vo=k.head_dim_v, arch=arch)
        if getattr(k, "is_mla", False):
            out.append(Variant(kind="mla", backend=mla_backend(arch), **base))
            continue
        if k.has_sinks:
            out.append(Variant(kind="sink", backend=prefill_backend, sliding_window=swa, **base))
            continue
        out.append(Variant(kind="prefill", backend=prefill_backend, sliding_window=swa, logit_softcap=cap, **base))
        if prefill_backend == "fa2":
            out.append(Variant(kind="decode", backend="cuda_core", sliding_window=swa, logit_softcap=cap, **base))
    return list(dict.fromkeys(out))


def torch_dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the dtype names :class:`Variant` holds)."""
    return str(dtype).removeprefix("torch.")


def sink_uri(v: Variant, q_name: str, kv_name: str) -> str:
    """JIT module name of an attention-sink variant with every compile-time parameter (head dims, KV dtype) in it.
    FlashInfer's own name omits them, so a second sink head_dim would load the first one's kernel."""
    return (f"attn_setup_prefill_sink_q_{q_name}_kv_{kv_name}_d{v.head_dim_qk}x{v.head_dim_vo}"
            f"_swa_{v.sliding_window}_{v.backend}")


def sink_decl(backend: str, fi: Any = None) -> str:
    """FlashInfer's ``AttentionSink`` variant declaration (CUDA source) for ``backend``, from ``fi``'s
    ``attention_sink_decl`` when exposed, else imported."""
    variants = getattr(getattr(getattr(fi, "jit", None), "attention", None), "variants", None)
    if variants is None:
        from flashinfer.jit.attention import variants
    return variants.attention_sink_decl[backend]


def sink_jit_args(v: Variant, fi: Any = None) -> tuple[list[Any], dict[str, Any]]:
    """(jit_args, jit_kwargs) of the prefill module with the attention-sink variant, as FlashInfer 0.7.2 passes them
    (stride mode ``"independent"`` for fa2, ``"runtime"`` for fa3), named by :func:`sink_uri`."""
    import torch

    q, kv = getattr(torch, v.q_dtype), getattr(torch, v.kv_dtype)
    uri = sink_uri(v, _SHORT.get(v.q_dtype, v.q_dtype), _SHORT.get(v.kv_dtype, v.kv_dtype))
    args = [uri, q, kv, q, torch.int32, v.head_dim_qk, v.head_dim_vo, ["sink"], ["float"],
            ["sm_scale"], ["double"], "AttentionSink", sink_decl(v.backend, fi)]
    return args, {"use_sliding_window": v.sliding_window, "use_fp16_qk_reduction": False, "pos_encoding_mode": 0,
                  "paged_kv_stride_mode": "independent" if v.backend == "fa2" else "runtime",
                  "module_surface": "full"}


def _module_args(v: Variant) -> tuple:
    import torch

    q, kv = getattr(torch, v.q_dtype), getattr(torch, v.kv_dtype)
    return (q, kv, q, torch.int32, v.head_dim_qk, v.head_dim_vo, 0, v.sliding_window, v.logit_softcap)


def _mla_args(v: Variant) -> tuple:
    import torch

    q = getattr(torch, v.q_dtype)
    return (v.backend, q, getattr(torch, v.kv_dtype), q, torch.int32, v.head_dim_vo, v.head_dim_qk - v.head_dim_vo,
            False)


def spec_for(v: Variant) -> Any:
    """FlashInfer's ``JitSpec`` of the module ``v``'s wrappers load (writes sources, compiles nothing); fa2 prefill is
    the equal-KV-stride module."""
    from flashinfer.jit.attention import modules as m

    if v.kind == "mla":
        return m.gen_batch_mla_module(*_mla_args(v))
    if v.kind == "decode":
        return m.gen_batch_decode_module(*_module_args(v))
    if v.kind == "prefill":
        gen = m._gen_batch_prefill_primary_module if v.backend == "fa2" else m.gen_batch_prefill_module
        return gen(v.backend, *_module_args(v), False)
    args, kw = sink_jit_args(v)
    return m.gen_customize_batch_prefill_module(v.backend, *args, **kw)


def is_cached(v: Variant) -> bool:
    """True when the variant's shared library is already built (JIT cache or AOT package)."""
    spec = spec_for(v)
    return bool(spec.is_aot or spec.is_compiled)


def load_variant(v: Variant) -> Any:
    """Compile (if needed) and load ``v`` through FlashInfer's own cached loaders."""
    if v.kind == "mla":
        from flashinfer.mla import get_batch_mla_module

        return get_batch_mla_module(*_mla_args(v))
    if v.kind == "decode":
        from flashinfer.decode import get_batch_decode_module

        return get_batch_decode_module(*_module_args(v))
    if v.kind == "prefill":
        from flashinfer.prefill import get_batch_prefill_module

        return get_batch_prefill_module(v.backend, *_module_args(v), False)
    from flashinfer.prefill import get_customize_batch_prefill_module

    args, kw = sink_jit_args(v)
    return get_customize_batch_prefill_module(v.backend, *args, **kw)


@contextmanager
def heartbeat(what: str, every_s: float = 10.0, *, log: Any = None) -> Iterator[None]:
    """Emit ``jit_heartbeat`` ("still compiling ``what`` after N s") every ``every_s`` seconds
    from a daemon thread while the body runs; stops (and joins) when the body ends."""
    from pipeline.core.heartbeat import beating

    log = log or _log()

    def beat(n: float) -> None:
        log.info("jit_heartbeat", variant=what, elapsed_s=round(n, 1), message=f"still compiling {what} after {n:.0f} s")

    with beating(every_s, beat, name=f"jit-heartbeat-{what}"):
        yield


def ensure_compiled(v: Variant, *, heartbeat_s: float = 10.0, loader: Optional[Callable[[Variant], Any]] = None,
                    cached: Optional[Callable[[Variant], bool]] = None, log: Any = None) -> dict[str, Any]:
    """Log cached/compiling for ``v``, compile it with heartbeats, log the time: ``{"variant", "status", "seconds"}``.
    Re-raises the loader's exception after logging ``jit_variant_failed``."""
    log = log or _log()
    loader, cached = loader or load_variant, cached or is_cached
    status = "cached" if cached(v) else "compiling"
    log.info("jit_variant", status=status, **v.fields())
    started_ns, t0 = time.time_ns(), time.monotonic()
    try:
        if status == "compiling":
            from pipeline.core.heartbeat import doing  # many ranks: peers waiting on this one see what it compiles

            with heartbeat(v.name, heartbeat_s, log=log), doing(f"compiling FlashInfer JIT variant {v.name}"):
                loader(v)
        else:
            loader(v)
    except Exception as e:
        log.error("jit_variant_failed", variant=v.name, error=f"{type(e).__name__}: {e}"[:2000])
        raise
    dt = round(time.monotonic() - t0, 3)
    log.info("jit_variant_ready", variant=v.name, status=status, seconds=dt)
    return {"variant": v.name, "status": status, "seconds": dt, "started_ns": started_ns, "fields": v.fields()}


def _compile_in_child(fields: dict[str, Any]) -> dict[str, Any]:
    fields = {k: v for k, v in fields.items() if k != "variant"}
    v = Variant(**fields)
    t0 = time.monotonic()
    try:
        status = "cached" if is_cached(v) else "compiled"
        load_variant(v)
        return {"variant": v.name, "status": status, "seconds": round(time.monotonic() - t0, 3), "error": None}
    except Exception as e:  # reported per variant, the other variants still compile
        return {"variant": v.name, "status": "failed", "seconds": round(time.monotonic() - t0, 3),
                "error": f"{type(e).__name__}: {e}"[-2000:]}


def warmup_variants(variants: Sequence[Variant], jobs: int = 4) -> list[dict[str, Any]]:
    """Compile ``variants`` in ``jobs`` processes: per variant ``variant``, ``status``, ``seconds``, ``error``, in
    order. Logs ``jit_warmup_start`` / ``jit_warmup_variant`` / ``jit_warmup_done``; needs CUDA and FlashInfer."""
    import multiprocessing as mp

    log = _log()
    uniq = list(dict.fromkeys(variants))
    log.info("jit_warmup_start", variants=[v.name for v in uniq], jobs=jobs)
    t0 = time.monotonic()
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=mp.get_context("spawn")) as pool:
        futures = [pool.submit(_compile_in_child, v.fields()) for v in uniq]
        with heartbeat(f"{len(uniq)} variants", 15.0, log=log):
            results = [f.result() for f in futures]
    for r in results:
        log.info("jit_warmup_variant", **r)
    log.info("jit_warmup_done", seconds=round(time.monotonic() - t0, 3),
             failed=sum(r["status"] == "failed" for r in results))
    return results


# FlashInfer MLA backend per arch: fa3 on sm90 (2.1x fa2 at 128 heads, benchmarks/RESULTS.md, as FlashInfer's
# ``determine_mla_backend``); fa2 elsewhere.
MLA_FA3_ARCHS = ("sm90",)


def mla_backend(arch: str) -> str:
    """FlashInfer's MLA wrapper backend for ``arch`` (``"sm90"`` …): ``"fa3"`` on :data:`MLA_FA3_ARCHS`,
    else ``"fa2"``."""
    return "fa3" if arch in MLA_FA3_ARCHS else "fa2"
