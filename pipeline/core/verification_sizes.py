"""The requests ``attn-setup run``'s checks put through the stack, and what they need of the pools: token slots and
context length. Torch-free, so that ``plan`` refuses what ``run`` would refuse for them (``--max-context-len``
shorter than the longest verification request, ``--num-token-slots`` below the slots the batches hold) and its
remedies name values ``run`` accepts.

Two batches (their modules hold the code that runs them):

* the built instances' check (:mod:`pipeline.runtime.verify`): up to 5 requests with cached prefixes
  ``PREFIX_LENS`` and new tokens ``NEW_LENS``, then ``decode_steps`` decode steps;
* the model steps (:mod:`pipeline.runtime.model_steps`): up to 4 requests extending ``EXTEND_LENS`` tokens, then a
  chunked extend of ``CHUNK_LENS``, then ``decode_steps`` decode steps.

A batch takes its first ``min(len, max_reqs)`` requests. Each request holds whole pages of ``page_size`` slots, and
page 0 is reserved (sglang's allocator never hands it out).
"""

from __future__ import annotations

__all__ = ["PREFIX_LENS", "NEW_LENS", "EXTEND_LENS", "CHUNK_LENS", "DEFAULT_DECODE_STEPS", "verify_slots_needed",
           "verify_context_needed", "steps_slots_needed", "steps_context_needed", "slots_needed", "context_needed"]

PREFIX_LENS = (0, 3, 21, 0, 10)
NEW_LENS = (9, 4, 2, 6, 1)
EXTEND_LENS = (5, 9, 2, 7)
CHUNK_LENS = (3, 1, 4, 2)
DEFAULT_DECODE_STEPS = 3   # run's --decode-steps default


def _slots(firsts: tuple[int, ...], seconds: tuple[int, ...], max_reqs: int, page_size: int, steps: int) -> int:
    b = min(len(firsts), max_reqs)
    return page_size * (1 + sum(-(-(x + y + steps) // page_size) for x, y in zip(firsts[:b], seconds[:b])))


def _context(firsts: tuple[int, ...], seconds: tuple[int, ...], max_reqs: int, steps: int) -> int:
    b = min(len(firsts), max_reqs)
    return max(x + y for x, y in zip(firsts[:b], seconds[:b])) + steps


def verify_slots_needed(max_reqs: int, page_size: int, decode_steps: int = DEFAULT_DECODE_STEPS) -> int:
    """Token slots the built instances' check allocates (whole pages per request, plus the reserved page 0)."""
    return _slots(PREFIX_LENS, NEW_LENS, max_reqs, page_size, decode_steps)


def verify_context_needed(max_reqs: int, decode_steps: int = DEFAULT_DECODE_STEPS) -> int:
    """Tokens the longest request of the built instances' check reaches (the ``max_context_len`` it needs)."""
    return _context(PREFIX_LENS, NEW_LENS, max_reqs, decode_steps)


def steps_slots_needed(max_reqs: int, page_size: int, decode_steps: int = DEFAULT_DECODE_STEPS) -> int:
    """Token slots the model steps allocate (whole pages per request, plus the reserved page 0)."""
    return _slots(EXTEND_LENS, CHUNK_LENS, max_reqs, page_size, decode_steps)


def steps_context_needed(max_reqs: int, decode_steps: int = DEFAULT_DECODE_STEPS) -> int:
    """Tokens the longest request of the model steps reaches (the ``max_context_len`` it needs)."""
    return _context(EXTEND_LENS, CHUNK_LENS, max_reqs, decode_steps)


def slots_needed(max_reqs: int, page_size: int, decode_steps: int = DEFAULT_DECODE_STEPS) -> int:
    """Token slots a pool must hold for both of ``run``'s batches (the larger; they run one after the other)."""
    return max(verify_slots_needed(max_reqs, page_size, decode_steps),
               steps_slots_needed(max_reqs, page_size, decode_steps))


def context_needed(max_reqs: int, decode_steps: int = DEFAULT_DECODE_STEPS) -> int:
    """The ``max_context_len`` both of ``run``'s batches need (the longer)."""
    return max(verify_context_needed(max_reqs, decode_steps), steps_context_needed(max_reqs, decode_steps))
