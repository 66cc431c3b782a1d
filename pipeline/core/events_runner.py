"""The runner's and the command's event records (``attn-setup run``: its outer states, the model stack, the memory
pool, CUDA graphs, verification, the command's start and exit). Import them from :mod:`pipeline.core.events`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pipeline.core.event_base import Event


class InstanceVerified(Event, tag="instance_verified", kw_only=True):
    """One built instance checked on a real batch against the float64 reference."""

    role: str
    backend: str
    max_rel_err: float
    tol: float
    passed: bool
    duration_ms: float = 0.0  # wall time of this instance's check (0 in traces written before it was recorded)


class RunnerStarted(Event, tag="runner_started", kw_only=True):
    """The runner's outer ``initialize()`` began: its own settings (layers, memory budget, aux layers)."""

    config: dict[str, Any]


class RunnerTransition(Event, tag="runner_transition", kw_only=True):
    """The runner's outer machine moved ``from`` → ``to`` by ``trigger``; ``duration_ms`` spent in ``from``."""

    from_state: str = msgspec.field(name="from")
    to: str
    trigger: str
    duration_ms: float


class DistributedInitialized(Event, tag="distributed_initialized", kw_only=True):
    """init-distributed: the world this rank belongs to and whether a CPU process group exists."""

    world_size: int
    has_cpu_group: bool
    source: str


class ModelLoaded(Event, tag="model_loaded", kw_only=True):
    """load-model: the attention stack built (random weights, fixed seed) and its size in bytes.

    ``num_layers``: the hidden layers the stack spans (ids ``0..num_layers-1``); ``attention_layers``: how many of
    them are attention layers, built; ``skipped_layers``: the others (``[{kind, layer_ids}]``: a hybrid's
    linear-attention / mamba layers, not built). Both None in traces written before they were logged."""

    num_layers: int
    num_hidden_layers: int
    param_bytes: int
    dtype: str
    seed: int
    aux_hidden_state_layers: list[int] | None = None
    attention_layers: int | None = None
    skipped_layers: list[dict[str, Any]] | None = None


class MemoryPoolSized(Event, tag="memory_pool_sized", kw_only=True):
    """init-memory-pool: where the size came from, tokens and bytes of ``req_to_token`` and the K/V buffers.

    ``graph_bytes_estimate``: the decode CUDA graphs' estimated private pool (:mod:`pipeline.memory.graphs`), taken
    out of a ``mem_fraction`` budget before the pools were sized (``budget_bytes`` is what was left for them) and
    counted with them against free memory; 0 without graphs and in traces written before it was estimated."""

    source: str
    budget_bytes: int | None = None
    bytes_per_token: int
    num_token_slots: int
    max_reqs: int
    max_context_len: int
    page_size: int
    req_to_token_bytes: int
    kv_bytes: int
    graph_bytes_estimate: int = 0


class CudaGraphCaptured(Event, tag="cuda_graph_captured", kw_only=True):
    """One decode CUDA graph captured: batch size and capture time (warm-up run included).

    ``graph_bytes``: bytes this batch size's capture added to the graphs' private memory pool (the sizes share one
    pool, captured largest first, so smaller sizes mostly reuse it); ``device_bytes``: device memory free before
    the capture minus free after (``torch.cuda.mem_get_info``; can be 0 or below when the allocator released
    cached blocks to make room). Both 0 in traces written before they were measured. ``graph_bytes_estimate``:
    what :mod:`pipeline.memory.graphs` estimated this size's capture adds to the pool (0 in older traces). ``mode``:
    the captured step (``decode``; a speculative worker's ``target_verify`` or ``draft_decode``, whose ``bs``
    requests hold ``num_draft_tokens`` or ``topk`` rows each).
    """

    bs: int
    capture_ms: float
    backend: str
    graph_bytes: int = 0
    device_bytes: int = 0
    graph_bytes_estimate: int = 0
    mode: str = "decode"


class CudaGraphMemory(Event, tag="cuda_graph_memory", kw_only=True):
    """Decode-graph capture done: what it took against what :mod:`pipeline.memory.graphs` estimated (bytes).

    Estimated, by part: ``pool_estimate`` (the graphs' private pool), ``state_estimate`` (buffers kept for replay:
    the runner's inputs, the backend's graph state and per-size wrappers), ``warmup_estimate`` (the warm-up stream's
    cached temporaries and its cuBLAS workspace, ``blas_workspace_bytes`` of it), ``total_estimate`` (their sum,
    what pool sizing set aside). Measured: ``pool_bytes`` (the private pool's segments,
    ``torch.cuda.memory_snapshot()``) and ``step_device_bytes`` (free device memory before the capture step's first
    buffer minus after its last capture). ``prime_device_bytes``: free device memory the process's one-time capture
    costs took before the pool budget was read (:func:`pipeline.platforms.cuda.prime_capture`: PyTorch's
    stream pool, lazily loaded graph machinery), outside the step and its estimate; 0 when the process had paid them
    before, and in older traces.
    """

    backend: str
    batch_sizes: list[int]
    pool_estimate: int
    state_estimate: int
    warmup_estimate: int
    blas_workspace_bytes: int
    total_estimate: int
    pool_bytes: int
    step_device_bytes: int
    prime_device_bytes: int = 0

    @property
    def kept_estimate(self) -> int:
        """Bytes the estimate says the capture step keeps once it is done: ``total_estimate`` less the warm-up's
        temporaries (``warmup_estimate`` minus its cuBLAS workspace), which ``torch.cuda.graph`` gives back with the
        ``empty_cache()`` before each capture. Compare it with ``step_device_bytes`` (measured after the last
        capture); ``total_estimate`` is the step's peak, what pool sizing sets aside."""
        return self.total_estimate - self.warmup_estimate + self.blas_workspace_bytes


class ModelStepVerified(Event, tag="model_step_verified", kw_only=True):
    """One extend/decode step of the attention stack checked against the float64 dense reference.

    ``reference``: which one (:attr:`pipeline.runtime.model_steps.StepCheck.reference`): ``rounded``, or for an MLA
    stack ``mla-absorbed`` (the kernel check) and ``mla-unabsorbed`` (the absorption check, two records per step);
    ``""`` in traces written before it was recorded."""

    step: str
    mode: str
    batch_size: int
    graph: bool
    max_rel_err: float
    tol: float
    passed: bool
    reference: str = ""


class RunnerReady(Event, tag="runner_ready", kw_only=True):
    """The runner reached ``ready``: total ``duration_ms``, the captured decode batch sizes and how the
    ranks agreed on the resolution (``single rank``, ``resolution_agreed``, or the recorded skip reason)."""

    duration_ms: float
    graph_batch_sizes: list[int] = []
    rank_agreement: str = ""


class CommandStarted(Event, tag="command_started", kw_only=True):
    """A command-line launch began (``attn-setup run``): the subcommand and its arguments.

    A launch that has one is ok (``inspect``) only when its ``command_finished`` says exit code 0:
    one killed after the runner reached ``ready`` but before its checks ended is incomplete.
    """

    command: str
    argv: list[str] = []


class CommandFinished(Event, tag="command_finished", kw_only=True):
    """The command's last record, on every exit it controls: ``exit_code`` (README's table; 130 after
    SIGINT) and ``duration_ms`` since ``command_started``."""

    command: str
    exit_code: int
    duration_ms: float
