"""The speculative-decoding shape of a start — steps, top-k, draft tokens — settled as sglang 0.5.23 settles it
(docs/internals.md)."""

from __future__ import annotations

from typing import Any, Optional

from pipeline.core.contracts import SpeculativeParams
from pipeline.core.errors import ConflictingOptions

# sglang's _auto_choose_speculative_params: (num_steps, topk, num_draft_tokens) per target architecture
AUTO_TREE_ARCHS = ("LlamaForCausalLM", "Grok1ForCausalLM", "Grok1VForCausalLM")
AUTO_TREE = (5, 4, 8)
AUTO_CHAIN = (3, 1, 4)
NGRAM_TOPK = 10  # sglang's speculative_ngram_max_bfs_breadth default
NGRAM_DRAFT_TOKENS = 12
FIELDS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")


def max_draft_tokens(num_steps: int, topk: int) -> int:
    """The most tree nodes EAGLE can verify: the bonus token plus every draft candidate,
    ``1 + topk + (num_steps - 1) * topk**2`` (``num_steps + 1`` for a chain)."""
    if topk == 1:
        return num_steps + 1
    return 1 + topk + (num_steps - 1) * topk * topk


def _refuse(message: str, flags: list[tuple[str, Any]], fixes: list[dict[str, Any]],
            allowed: Optional[list[str]] = None) -> None:
    """Raise ConflictingOptions with ``fixes`` (alternatives; a None value drops the field) as its remedy and as data
    (``err.fixes``: resolve completes each with what the rest of the request needs, as for its mode refusals)."""
    err = ConflictingOptions(message, state="resolve", flags=flags, allowed=allowed or [],
                             remedy=" or ".join(_fix(f) for f in fixes))
    err.fixes = fixes  # type: ignore[attr-defined]
    raise err


def _fix(fix: dict[str, Any]) -> str:
    """One alternative in the library's remedy wording (``set a=1 and b=2, and drop c``)."""
    sets = [f"{k}={v}" for k, v in fix.items() if v is not None]
    drops = [k for k, v in fix.items() if v is None]
    out = "set " + " and ".join(sets) if sets else ""
    return out + (", and " if out and drops else "") + ("drop " + " and ".join(drops) if drops else "")


def _steps_for(draft: int, topk: int) -> int:
    """The fewest draft steps whose tree of top-k ``topk`` holds ``draft`` tokens (:func:`max_draft_tokens`)."""
    steps = 1
    while max_draft_tokens(steps, topk) < draft:
        steps += 1
    return steps


def _auto(algorithm: str, target: Any) -> tuple[tuple[int, int, int], str]:
    arch = (getattr(target, "architectures", None) or [""])[0]
    if algorithm != "STANDALONE" and arch in AUTO_TREE_ARCHS:
        return AUTO_TREE, f"auto:{arch}"
    return AUTO_CHAIN, f"auto:{arch or getattr(target, 'model_type', '') or 'unknown'}"


def _ngram(args: Any) -> SpeculativeParams:
    if args.speculative_eagle_topk is not None:
        _refuse(f"speculative_eagle_topk={args.speculative_eagle_topk} has no effect with speculative_algorithm NGRAM "
                f"(sglang replaces it with the n-gram BFS breadth, {NGRAM_TOPK})",
                [("speculative_eagle_topk", args.speculative_eagle_topk), ("speculative_algorithm", "NGRAM")],
                [{"speculative_eagle_topk": None}])
    draft = args.speculative_num_draft_tokens or NGRAM_DRAFT_TOKENS
    steps = args.speculative_num_steps or max(draft // NGRAM_TOPK, 1)
    return SpeculativeParams(algorithm="NGRAM", num_steps=steps, topk=NGRAM_TOPK, num_draft_tokens=draft,
                             source="ngram")


def _without_steps(args: Any, auto: tuple[int, int, int]) -> list[dict[str, Any]]:
    """The remedy for top-k / draft tokens given without steps: steps that make the given values a valid shape, or
    dropping them for the model's defaults."""
    topk, draft = args.speculative_eagle_topk, args.speculative_num_draft_tokens
    given = tuple(f for f in FIELDS[1:] if getattr(args, f) is not None)
    if topk is None:  # draft tokens alone: a chain of draft - 1 steps
        keep = {"speculative_num_steps": draft - 1, "speculative_eagle_topk": 1} if draft >= 2 else None
    elif draft is None:
        keep = {"speculative_num_steps": auto[0]} if topk == 1 else \
            {"speculative_num_steps": auto[0], "speculative_num_draft_tokens": min(auto[2], max_draft_tokens(auto[0],
                                                                                                            topk))}
    else:
        steps = draft - 1 if topk == 1 else _steps_for(draft, topk)
        keep = {"speculative_num_steps": steps} if steps >= 1 else None
    return ([keep] if keep else []) + [{f: None for f in given}]


def decide_speculative(args: Any, target: Any) -> Optional[SpeculativeParams]:
    """The (steps, top-k, draft tokens) this start serves, or None without ``speculative_algorithm``; ``target``: the
    target model's spec (picks sglang's defaults). Raises :class:`~pipeline.core.errors.ConflictingOptions` (exit 3) for
    combinations sglang asserts on or rewrites, with a remedy."""
    if args.speculative_algorithm is None:
        return None
    algo = args.speculative_algorithm.upper()
    if algo == "NGRAM":
        return _ngram(args)
    algo = "EAGLE" if algo == "NEXTN" else algo
    steps, topk, draft = args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens
    if steps is None:
        auto, source = _auto(algo, target)
        given = [(f, getattr(args, f)) for f in FIELDS[1:] if getattr(args, f) is not None]
        if given:
            _refuse(f"{' and '.join(f for f, _ in given)} set without speculative_num_steps: sglang sets the three "
                    f"together or takes all three from the target model (here steps {auto[0]}, top-k {auto[1]}, "
                    f"draft tokens {auto[2]})", given + [("speculative_num_steps", None)], _without_steps(args, auto))
        return SpeculativeParams(algorithm=algo, num_steps=auto[0], topk=auto[1], num_draft_tokens=auto[2],
                                 source=source)
    if topk is None:
        drop = ("speculative_num_draft_tokens",) if draft is not None and draft != steps + 1 else ()
        _refuse("speculative_num_steps is set without speculative_eagle_topk (sglang compares the unset top-k with 1 "
                "and fails)", [("speculative_num_steps", steps), ("speculative_eagle_topk", None)],
                [{"speculative_eagle_topk": 1, **{f: None for f in drop}}])
    if topk == 1:
        if draft is not None and draft != steps + 1:
            _refuse(f"speculative_num_draft_tokens={draft} with speculative_eagle_topk=1: a chain of {steps} steps "
                    f"verifies {steps + 1} tokens (sglang overwrites the value with a warning)",
                    [("speculative_num_draft_tokens", draft), ("speculative_eagle_topk", 1),
                     ("speculative_num_steps", steps)],
                    [{"speculative_num_draft_tokens": steps + 1}, {"speculative_num_draft_tokens": None}],
                    [str(steps + 1)])
        return SpeculativeParams(algorithm=algo, num_steps=steps, topk=1, num_draft_tokens=steps + 1,
                                 source="flags" if draft is not None else "flags:topk1")
    top = max_draft_tokens(steps, topk)
    if draft is None:
        _refuse(f"speculative_eagle_topk={topk} > 1 needs speculative_num_draft_tokens (the verified tree's nodes, "
                f"2..{top} for {steps} steps)", [("speculative_eagle_topk", topk),
                                                 ("speculative_num_draft_tokens", None)],
                [{"speculative_num_draft_tokens": min(AUTO_TREE[2], top)}], [f"2..{top}"])
    if draft > top:
        _refuse(f"speculative_num_draft_tokens={draft} exceeds the {top} tree nodes {steps} steps of top-k {topk} can "
                f"propose (the bonus token and the best of topk + (steps - 1) * topk^2 candidates)",
                [("speculative_num_draft_tokens", draft), ("speculative_eagle_topk", topk),
                 ("speculative_num_steps", steps)],
                [{"speculative_num_draft_tokens": top}, {"speculative_num_steps": _steps_for(draft, topk)}],
                [f"1..{top}"])
    return SpeculativeParams(algorithm=algo, num_steps=steps, topk=topk, num_draft_tokens=draft, source="flags")


def chain_fix(args: Any, spec: SpeculativeParams) -> tuple[tuple[str, Any], ...]:
    """The field changes that make ``spec`` a chain (top-k 1) with its steps: what a backend without tree masks needs.
    ``speculative_num_draft_tokens`` is dropped (derived), ``speculative_num_steps`` set when it came from the model."""
    out: list[tuple[str, Any]] = []
    if args.speculative_num_steps is None:
        out.append(("speculative_num_steps", spec.num_steps))
    out.append(("speculative_eagle_topk", 1))
    if args.speculative_num_draft_tokens is not None:
        out.append(("speculative_num_draft_tokens", None))
    return tuple(out)


def settled(request: Any) -> Optional[SpeculativeParams]:
    """The shape a ``SetupRequest`` serves, for sizing before resolve (``run``'s check batches, ``plan``'s
    minimums); None without speculative decoding or when resolve will refuse the flags (it names them there)."""
    try:
        return decide_speculative(request.args, request.model)
    except ConflictingOptions:
        return None
