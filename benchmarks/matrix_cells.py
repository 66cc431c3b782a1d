"""The cells of the "accepted means runs" matrix: enumerated from the records, decided, built and verified.

One cell is backend × layer kind × KV dtype × page size × mode × {eager, graph}. :func:`cells` enumerates the
product from the records, not from a hand list: backends are the registry's names (a hybrid is every ordered pair
of two of them as prefill/decode); KV dtypes are ``auto`` plus every KV dtype some record claims that is not a
compute dtype (the fp8 formats); head dims are those the backend's record claims (MHA kinds: ``head_dims_qk ∩
head_dims_v``, :data:`ANY_DIMS` for a record that takes any; MLA: DeepSeek's absorbed 576/512), cycled over the
other axes (a Latin-square turn) so every claimed dim meets every value of every axis; head counts cycle over
:data:`HEADS` (GQA groups 1, 4, 7: FlashInfer's CUDA-core and tensor-core decode paths). Each cell's model is a
one-layer bf16 :class:`~pipeline.core.contracts.ModelSpec` of its kind (mixed-kind models are the bundled configs' runs).

:func:`decide` asks :func:`pipeline.setup.build.decide_offline` — resolve, build-mode's plan and the checks made before
allocation, what ``attn-setup plan`` and ``run``'s preflight ask — whether a cell is accepted on a device profile;
a graph cell is accepted only when resolve keeps decode CUDA graphs on (no ``cuda_graph`` skip). :func:`run_cell`
builds and verifies an accepted cell through the public flow:

- eager: :func:`pipeline.build_attention_backends`, then :func:`pipeline.runtime.verify.verify_built` (every instance and
  the wrapper on the verification batch, against :func:`pipeline.runtime.reference.reference_attention` in float64);
- graph: a :class:`pipeline.runtime.runner.Runner` (pools, the pipeline, decode CUDA-graph capture — ``attn-setup run``'s
  flow), then ``verify_built`` on its build and :func:`pipeline.runtime.model_steps.verify_model_steps` (extend, chunked
  extend, decode replayed from the captured graph: a decode step that did not replay fails the cell).

Any exception or any result outside tolerance makes the cell ``failed``: an accepted combination that fails is a
bug to fix or a record to narrow, never a skip. Used by ``benchmarks/accepted_matrix.py`` (the script, GPU and CPU)
and ``tests/test_matrix.py`` (CI).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec  # noqa: E402

from pipeline.backends import registry  # noqa: E402
from pipeline.core.contracts import AttentionArgs, ModelSpec, PoolFacts, SetupRequest  # noqa: E402
from pipeline.core.errors import ConfigError  # noqa: E402
from pipeline.platforms.profiles import PROFILES  # noqa: E402

KINDS = ("full", "window", "softcap", "sinks", "chunked", "mla")
PAGE_SIZES = (1, 16, 64)
MODES = ("normal", "tbo", "hybrid", "pdmux", "spec")  # spec: a target worker verifying EAGLE trees (SPEC_TREE)
GRAPHS = ("eager", "graph")
HEADS = ((2, 2), (4, 1), (7, 1))  # (q heads, kv heads): GQA groups 1, 4, 7
ANY_DIMS = (64, 128, 256)  # MHA head dims tried for a record that claims any (head_dims None)
MLA_DIMS = (576, 512)  # absorbed qk / v dims (DeepSeek-V2/V3: kv_lora_rank 512 + rope 64)
WINDOW, CHUNK, SOFTCAP = 6, 5, 50.0  # window/chunk bite within the verification requests; Gemma-2's softcap
SM_GROUPS = 2  # PD-mux decode backends
SPEC_TREE = dict(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=4,
                 speculative_num_draft_tokens=8)  # sglang's top-k 4 and 8 draft tokens, 3 steps
DECODE_STEPS = 2
MAX_REQS = 8
GRAPH_BS = [MAX_REQS]  # one captured size; the 4-request model steps replay it padded
INTERPRET_SMS = 2
BACKEND_COST = {"triton": 4.0}  # a verification through the Triton interpreter vs torch_native, on CPU
AXES = ("backend", "kind", "kv", "page", "mode", "graph", "dims", "heads")


def kv_axis() -> list[str]:
    """``auto`` plus each KV dtype a record claims that is no compute dtype (the fp8 formats)."""
    caps = [registry.get(n).capability for n in registry.names()]
    q = {d for c in caps for d in c.q_dtypes}
    return ["auto"] + sorted({d for c in caps for d in c.kv_dtypes} - q)


def mha_dims(name: str) -> tuple[int, ...]:
    """MHA head dims ``name``'s record claims (qk and v alike), or :data:`ANY_DIMS` when it takes any."""
    cap = registry.get(name).capability
    if cap.head_dims_qk is None and cap.head_dims_v is None:
        return ANY_DIMS
    qk = set(cap.head_dims_qk or ANY_DIMS) & set(cap.head_dims_v or ANY_DIMS)
    return tuple(sorted(qk - {MLA_DIMS[0]})) or (min(cap.head_dims_qk or ANY_DIMS),)


@dataclass(frozen=True)
class Cell:
    """One combination: prefill/decode backends (equal unless ``mode == "hybrid"``), layer kind, KV dtype, page
    size, mode, eager/graph, head dims (qk, v) and head counts (q, kv; MLA: q heads over one latent head)."""

    prefill: str
    decode: str
    kind: str
    kv: str
    page: int
    mode: str
    graph: str
    dims: tuple[int, int]
    heads: tuple[int, int]

    @property
    def backend(self) -> str:
        return self.prefill if self.prefill == self.decode else f"{self.prefill}/{self.decode}"

    @property
    def label(self) -> str:
        d = f"d{self.dims[0]}" if self.dims[0] == self.dims[1] else f"d{self.dims[0]}x{self.dims[1]}"
        return (f"{self.backend}-{self.kind}-{self.kv}-p{self.page}-{self.mode}-{self.graph}-{d}"
                f"-h{self.heads[0]}x{self.heads[1]}")

    def values(self) -> dict[str, Any]:
        return {a: getattr(self, a) for a in AXES}

    def args(self) -> AttentionArgs:
        a: dict[str, Any] = dict(kv_cache_dtype=self.kv, page_size=self.page, disable_cuda_graph=self.graph == "eager")
        if self.mode == "hybrid":
            a.update(prefill_attention_backend=self.prefill, decode_attention_backend=self.decode)
        else:
            a["attention_backend"] = self.prefill
        if self.mode == "tbo":
            a["enable_two_batch_overlap"] = True
            a["moe_a2a_backend"] = "deepep"  # sglang's TBO needs an EP all-to-all (or attention DP)
        if self.mode == "pdmux":
            a.update(enable_pdmux=True, sm_group_num=SM_GROUPS)
        if self.mode == "spec":
            a.update(SPEC_TREE)
        if self.graph == "graph":
            a["cuda_graph_bs"] = list(GRAPH_BS)
        return AttentionArgs(**a)

    def model(self) -> ModelSpec:
        """A one-layer bf16 model of this layer kind (mixed-kind models are the bundled configs' runs)."""
        (dq, dv), (h, hkv) = self.dims, self.heads
        m: dict[str, Any] = dict(model_type="matrix", source=f"matrix:{self.kind}", hidden_size=256,
                                 num_hidden_layers=1, num_attention_heads=h, num_key_value_heads=hkv, head_dim=dq,
                                 v_head_dim=dv, scaling=dq ** -0.5, layer_types=["full"], dtype="bfloat16")
        if self.kind == "window":
            m.update(layer_types=["sliding"], sliding_window=WINDOW)
        elif self.kind == "chunked":
            m.update(layer_types=["chunked"], attention_chunk_size=CHUNK)
        elif self.kind == "softcap":
            m["logit_softcap"] = SOFTCAP
        elif self.kind == "sinks":
            m["has_attention_sinks"] = True
        elif self.kind == "mla":
            rope = dq - dv
            m.update(mla=dict(kv_lora_rank=dv, qk_rope_head_dim=rope, qk_nope_head_dim=128, v_head_dim=128),
                     head_dim=128 + rope, v_head_dim=128, num_key_value_heads=h, scaling=(128 + rope) ** -0.5)
        return msgspec.convert(m, ModelSpec)

    def request(self, device: str) -> SetupRequest:
        from pipeline.core.speculative import decide_speculative
        from pipeline.memory.pools import check_needs

        args, model = self.args(), self.model()
        slots = check_needs(MAX_REQS, self.page, DECODE_STEPS, decide_speculative(args, model)).slots  # + the trees
        return SetupRequest(args=args, model=model, device=device,
                            pool=PoolFacts(max_reqs=MAX_REQS, max_context_len=64, num_token_slots=slots,
                                           page_size=self.page))


def cells(backends: Optional[Sequence[str]] = None) -> list[Cell]:
    """The whole product for ``backends`` (default: every registered one); hybrid = every ordered pair."""
    names = list(backends or registry.names())
    kvs = kv_axis()
    out = []
    for (mi, mode), (ki, kv), (pi, page) in itertools.product(enumerate(MODES), enumerate(kvs), enumerate(PAGE_SIZES)):
        pairs = [(a, b) for a in names for b in names if a != b] if mode == "hybrid" else [(a, a) for a in names]
        for (pre, dec), (ti, kind), graph in itertools.product(pairs, enumerate(KINDS), GRAPHS):
            turn = mi + ki + pi + ti  # Latin-square cycling: each dim / head count meets every value of every axis
            if kind == "mla":
                dims = MLA_DIMS
            else:
                common = [d for d in mha_dims(pre) if d in mha_dims(dec)] or list(mha_dims(pre))
                d = common[turn % len(common)]
                dims = (d, d)
            heads = HEADS[(turn + mi) % len(HEADS)]
            out.append(Cell(pre, dec, kind, kv, page, mode, graph, dims, heads))
    return out


@dataclass
class Row:
    """A cell's outcome. ``status``: ``refused`` (with the error code / graph reason), ``passed``, ``failed``
    (wrong result or an error while building / running), ``needs_cuda`` (accepted, a graph cell on a CPU run)."""

    cell: Cell
    accepted: bool
    status: str
    reason: str = ""
    code: str = ""
    has_remedy: bool = False
    max_rel_err: Optional[float] = None
    tol: Optional[float] = None
    seconds: float = 0.0
    detail: str = ""
    results: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["cell"] = {**asdict(self.cell), "backend": self.cell.backend, "label": self.cell.label}
        return d


def decide(cell: Cell, facts: Any, installed: dict[str, bool]) -> Optional[Row]:
    """None when ``cell`` is accepted on ``facts``; else its ``refused`` Row (error code, message, remedy?)."""
    from pipeline.setup.build import decide_offline

    try:
        res, _plan = decide_offline(cell.request(facts.device_str), facts, installed)
    except ConfigError as e:
        return Row(cell, False, "refused", e.info.message, e.info.code, bool(e.info.remedy))
    skip = next((s for s in res.skips if s.what == "cuda_graph"), None)
    if cell.graph == "graph" and skip is not None:
        return Row(cell, False, "refused", skip.reason, "graph_" + ("downgrade" if skip.downgrade else "skipped"),
                   bool(skip.avoid))
    return None


def _worst(results: Iterable[Any]) -> tuple[float, float, str]:
    worst = max(results, key=lambda r: (r.max_rel_err if r.max_rel_err == r.max_rel_err else math.inf) / r.tol)
    return worst.max_rel_err, worst.tol, getattr(worst, "detail", "") or getattr(worst, "step", "")


def run_cell(cell: Cell, *, device: str, platform: Any = None, decode_steps: int = DECODE_STEPS) -> Row:
    """Build and verify an accepted ``cell`` (see the module docstring); any exception makes it ``failed``."""
    from pipeline import build_attention_backends
    from pipeline.runtime.verify import verify_built

    t0 = time.perf_counter()
    row = Row(cell, True, "failed")
    try:
        req = cell.request(device)
        if cell.graph == "graph":
            checks = _run_graph(req, platform, decode_steps)
        else:
            with build_attention_backends(req, platform=platform) as out:
                checks = verify_built(out, req, decode_steps=decode_steps)
        row.results = [{"what": getattr(c, "role", None) or f"model:{c.step}", "max_rel_err": c.max_rel_err,
                        "tol": c.tol, "passed": bool(c.passed), **({"graph": c.graph} if hasattr(c, "graph") else {})}
                       for c in checks]
        row.max_rel_err, row.tol, row.detail = _worst(checks)
        row.status = "passed" if checks and all(c.passed for c in checks) else "failed"
    except Exception as e:  # noqa: BLE001 - an accepted cell that raises is a failure, reported with its cause
        info = getattr(e, "info", None)
        row.reason = f"{type(e).__name__}: {info.message if info is not None else e}"[:500]
        row.code = info.code if info is not None else type(e).__name__
    row.seconds = time.perf_counter() - t0
    return row


def _run_graph(req: SetupRequest, platform: Any, decode_steps: int) -> list[Any]:
    from pipeline.runtime.runner import Runner, RunnerConfig
    from pipeline.runtime.model_steps import verify_model_steps
    from pipeline.runtime.verify import verify_built

    with Runner(RunnerConfig(request=req), platform=platform) as runner:
        runner.initialize()
        if runner.graphs is None:
            raise RuntimeError("accepted with CUDA graphs, but the runner captured none")
        checks = list(verify_built(runner.backends, runner.request, pools=runner.pools, decode_steps=decode_steps))
        spec = runner.backends.resolution.speculative
        steps = verify_model_steps(runner, decode_steps=decode_steps, spec=spec)
        captured = runner.graphs.mode.value  # a speculative target captures target verify, not decode
        eager = [s.step for s in steps if s.mode == captured and not s.graph]
        if eager or not any(s.mode == captured for s in steps):
            raise RuntimeError(f"{captured} steps {', '.join(eager)} ran eagerly instead of replaying the captured "
                               "graph")
        return checks + list(steps)


def covering(rows: Sequence[Row], pair_axes: Sequence[str] = AXES) -> list[Row]:
    """A covering subset of ``rows``: every pair of values of two ``pair_axes`` that occurs together in ``rows``
    occurs together in the subset, and every value of every other axis occurs at least once (greedy, most new
    pairs per unit of :func:`cost` first; deterministic)."""
    def items(c: Cell) -> set:
        v = c.values()
        pv = [(a, v[a]) for a in pair_axes]
        return set(itertools.combinations(pv, 2)) | {((a, v[a]),) for a in AXES if a not in pair_axes}

    todo = set().union(*(items(r.cell) for r in rows)) if rows else set()
    chosen, left = [], list(rows)
    while todo:
        best = max(left, key=lambda r: (len(items(r.cell) & todo) / cost(r.cell), -left.index(r)))
        chosen.append(best)
        todo -= items(best.cell)
        left.remove(best)
    for r in sorted(chosen, key=lambda r: -cost(r.cell)):  # drop what the others cover anyway, dearest first
        rest = set().union(*(items(o.cell) for o in chosen if o is not r))
        if items(r.cell) <= rest:
            chosen.remove(r)
    return sorted(chosen, key=lambda r: rows.index(r))


def cost(c: Cell) -> float:
    """Estimated verification work, for :func:`covering`: instances verified (each weighted by
    :data:`BACKEND_COST`; a hybrid verifies both halves and the wrapper) × graph × a head-count factor (the Triton
    interpreter runs one program per request and head)."""
    w = {b: BACKEND_COST.get(b, 1.0) for b in (c.prefill, c.decode)}
    if c.mode == "hybrid":
        work = 1.5 * (w[c.prefill] + w[c.decode])
    else:
        work = {"normal": 1, "tbo": 4, "pdmux": 1 + SM_GROUPS, "spec": 2}[c.mode] * w[c.prefill]  # spec: + verify
    return work * (2 if c.graph == "graph" else 1) * (1 + c.heads[0] / 4)


def profile_facts(profile: str, device: str) -> tuple[Any, Any, str]:
    """(facts decided on, platform built on, torch device) for ``--profile`` / ``--device``."""
    from pipeline.testing import FakePlatform

    facts = PROFILES[profile]
    if device == "cpu" and facts.type != "cpu":
        run_facts = msgspec.structs.replace(facts, sm_count=INTERPRET_SMS, source=facts.source + "; interpreted on CPU")
        return facts, FakePlatform(run_facts, "cpu"), "cpu"
    if device.startswith("cuda"):
        from pipeline.platforms import parse_device, platform_for

        plat = platform_for(device)
        real = plat.device_facts(parse_device(device)[1])
        if real.arch != facts.arch:
            raise SystemExit(f"--profile {profile} is {facts.arch}, but {device} is {real.arch} ({real.name})")
        return facts, None, device
    return facts, None, device


def evaluate(all_cells: Sequence[Cell], facts: Any, installed: dict[str, bool]) -> list[Row]:
    """Decide every cell; accepted ones get a pending Row (status ``accepted``)."""
    return [decide(c, facts, installed) or Row(c, True, "accepted") for c in all_cells]


def summary(rows: Sequence[Row]) -> dict[str, Any]:
    by = lambda s: sum(r.status == s for r in rows)  # noqa: E731
    codes: dict[str, int] = {}
    for r in rows:
        if r.status == "refused":
            codes[r.code] = codes.get(r.code, 0) + 1
    return {"cells": len(rows), "accepted": sum(r.accepted for r in rows), "passed": by("passed"),
            "failed": by("failed"), "needs_cuda": by("needs_cuda"), "not_in_subset": by("not_in_subset"),
            "other_shard": by("other_shard"),
            "refused": by("refused"),
            "refused_without_remedy": sum(r.status == "refused" and not r.has_remedy for r in rows),
            "refused_by_code": dict(sorted(codes.items()))}


def table(rows: Sequence[Row], *, accepted_only: bool = True) -> str:
    """Markdown table: combination → accepted → max_rel_err / tol → status (refused rows optional)."""
    lines = ["| backend | kind | kv | page | mode | graph | dims | heads | accepted | max_rel_err | tol | result |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if accepted_only and not r.accepted:
            continue
        c = r.cell
        err = "" if r.max_rel_err is None else f"{r.max_rel_err:.2e}"
        tol = "" if r.tol is None else f"{r.tol:.0e}"
        res = r.status + (f" ({r.code}: {r.reason[:80]})" if r.status in ("failed", "refused") else "")
        lines.append(f"| {c.backend} | {c.kind} | {c.kv} | {c.page} | {c.mode} | {c.graph} | {c.dims[0]}/{c.dims[1]} "
                     f"| {c.heads[0]}/{c.heads[1]} | {'yes' if r.accepted else 'no'} | {err} | {tol} | {res} |")
    return "\n".join(lines)


def grouped_table(rows: Sequence[Row]) -> str:
    """Markdown table per backend × mode × graph: accepted, passed, failed, not run, worst max_rel_err of the passed."""
    groups: dict[tuple[str, str, str], list[Row]] = {}
    for r in rows:
        if r.accepted:
            groups.setdefault((r.cell.backend, r.cell.mode, r.cell.graph), []).append(r)
    lines = ["| backend | mode | graph | accepted | passed | failed | not run | worst max_rel_err |",
             "|---|---|---|---|---|---|---|---|"]
    for (b, m, g), rs in groups.items():
        ok = [r.max_rel_err for r in rs if r.status == "passed"]
        bad = sum(r.status == "failed" for r in rs)
        lines.append(f"| {b} | {m} | {g} | {len(rs)} | {len(ok)} | {bad} | {len(rs) - len(ok) - bad} | "
                     f"{max(ok):.2e} |" if ok else f"| {b} | {m} | {g} | {len(rs)} | 0 | {bad} | {len(rs) - bad} | |")
    return "\n".join(lines)


@contextlib.contextmanager
def interpreter_rounding() -> Any:
    """Round float32 → bfloat16 casts in Triton's CPU interpreter to nearest even, as compiled kernels do.

    ``x.to(tl.bfloat16)`` rounds to nearest even on the GPU (Triton's ``fp_downcast_rounding`` default,
    ``"rtne"``), but the interpreter converts by dropping the low 16 bits (truncation, since triton-lang/triton
    PR #3811; still so in triton 3.9), which doubles the rounding error of every bf16 store and of the bf16
    probabilities a flash-attention kernel feeds its PV product: interpreted bf16 kernels then land at 1e-2
    relative error, where the same kernels compiled land near 4e-3. Inside this context the interpreter rounds
    as the GPU does (NaN kept NaN); everything else is untouched, and the patch is undone on exit.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as ti

    original = ti.InterpreterBuilder.cast_impl

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            f = np.asarray(src.data, dtype=np.float32)
            bits = f.view(np.uint32).astype(np.uint64)
            out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            out = np.where(np.isnan(f), ((bits >> 16) | 0x40).astype(np.uint16), out)
            return ti.TensorHandle(out, dst_type.scalar)
        return original(self, src, dst_type)

    ti.InterpreterBuilder.cast_impl = cast_impl
    try:
        yield
    finally:
        ti.InterpreterBuilder.cast_impl = original
