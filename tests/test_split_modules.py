"""Issue 15's module splits keep every name importable from the module that held it.

``OLD_NAMES`` is what each split module exposed before its split (6adc991 for the first splits, f98388f for the
size splits after them: every public top-level name, imported ones included, typing's names left out, and the
private ones that moved); each must still be there and be the same object as in the
module that now defines it. The new modules must not import torch where the old one did not.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

OLD_NAMES = {
    "pipeline.core.events": [
        'AnyEvent', 'BackendBuilt', 'BackendsAnnotated', 'BackendsResolved', 'BuildPlanned', 'CommandFinished',
        'CommandStarted', 'CudaGraphCaptured', 'DeviceFacts', 'DeviceInitialized', 'DistributedInitialized',
        'ENVELOPE', 'EVENT_TYPES', 'EnvVarLookalike', 'ErrorInfo', 'Event', 'FLOAT_FIELDS', 'FeatureDowngraded',
        'Heartbeat', 'InstancePlan', 'InstanceVerified', 'JitVariantLoaded', 'LayerGroup', 'LazyMemInitialized',
        'MAX_DEPTH', 'MemoryBalanced', 'MemoryPoolSized', 'Mode', 'ModelLoaded', 'ModelStepVerified', 'NONFINITE',
        'Ns', 'Outcome', 'PhaseTime', 'RankRow', 'RankStalled', 'ReferenceFallback', 'Rejection',
        'ResolutionAgreed', 'ResourcesReleased', 'RunFailed', 'RunFinished', 'RunInterrupted', 'RunStarted',
        'RunnerReady', 'RunnerStarted', 'RunnerTransition', 'SCHEMA_VERSION', 'SettingResolved', 'SlowPhase',
        'StartupSummary', 'StateTransition', 'StepSkipped', 'TOO_DEEP', 'WorkspacePlan', 'catalogue',
        'catalogue_markdown', 'clean_str', 'decode_line', 'encode', 'event_name', 'restore_floats', 'to_wire',
    ],
    "pipeline.core.model_spec": [
        'ATTENTION_LAYER_TYPES', 'BUNDLED_CONFIG_DIR', 'CONFIG_REMEDY', 'DEFAULT_MODEL_CONFIG', 'DEFAULT_RULE',
        'DEFAULT_UPPER', 'LAYER_RULES', 'LayerRule', 'MAX_CONFIG_BYTES', 'MAX_INT_DIGITS', 'MLADims',
        'MSCALE_RANGE', 'ModelConfigError', 'ModelSpec', 'PRE_ATTN_SCALAR_RANGE', 'SOFTCAP_RANGE', 'UPPER',
        'UsageError', 'YARN_FACTOR_RANGE', 'attention_layer_ids', 'attention_prefix', 'format_layer_ids',
        'is_text', 'layer_kinds', 'layers_covering_every_kind', 'load_model_spec', 'yarn_mscale',
    ],
    "pipeline.setup.distributed": [
        'ACCELERATORS', 'AttentionArgs', 'ConfigError', 'DEFAULT_TIMEOUT_S', 'DeviceFacts', 'ErrorInfo',
        'MAX_TIMEOUT_S', 'MAX_WORLD_SIZE', 'RankDivergence', 'RankExchangeError', 'RankGroup', 'RankReport',
        'RankRow', 'Resolution', 'UsageError', 'agree_on_resolution', 'check_launch_env', 'check_rank_device',
        'check_timeout', 'gather', 'init_from_env', 'rank_device', 'table_text',
    ],
    "pipeline.backends.flashinfer": [
        'AttentionBackend', 'AttentionLayer', 'BackendUnavailable', 'CapabilityMismatch', 'ConfigError',
        'FlashInferBackend', 'ForwardBatch', 'ForwardMode', 'GraphState', 'KindWrappers', 'LayerKind',
        'MLAWrappers', 'MLA_DIMS', 'PACKAGE', 'PlannedLayers', 'Variant', 'create', 'create_fa3',
        'ensure_compiled', 'gather_kv_indices', 'host_page_meta', 'import_flashinfer', 'is_fp8', 'layer_kv_scales',
        'variants_for',
    ],
    "pipeline.backends.triton.launch_mla": [
        'MLADecodeConfig', 'MLAExtendConfig', 'MLA_DECODE_CONFIGS', 'MLA_EXTEND_CONFIGS', 'MLA_MAX_LATENT_DIM',
        'MLA_MAX_ROPE_DIM', 'Q_DTYPES', 'SPLIT_GAIN', 'SWEEP_DECODE', 'bad', 'check_mla_decode',
        'check_mla_extend', 'default_mla_decode_config', 'default_mla_extend_config', 'mla_decode_attention',
        'mla_decode_max_splits', 'mla_decode_scratch_numel', 'mla_extend_attention', 'mla_split_candidates',
        'prefetch_constexprs',
    ],
    "states.graph_memory": [
        'BLAS_WORKSPACE_32MIB_ARCHS', 'ELEM_BYTES', 'GraphMemoryEstimate', 'K_LARGE_BUFFER', 'K_MIN_BLOCK',
        'K_MIN_LARGE_ALLOC', 'K_ROUND_LARGE', 'K_SMALL_BUFFER', 'K_SMALL_SIZE', 'LayerKind', 'MiB', 'ModelSpec',
        'PoolModel', 'blas_workspace_bytes', 'estimate_for_decided', 'estimate_graph_memory', 'iter_sizes',
    ],
    "pipeline.runtime.table": [
        'CAPTURE_PRECONDITIONS', 'CaptureDecision', 'ConfigError', 'Guard', 'LoadDecision', 'RUNNER', 'RunnerModel',
        'RunnerState', 'Step', 'StepTable', 'alloc_pools', 'attention_layer_ids', 'attention_request',
        'available_bytes', 'budget_from_fraction', 'build_attention', 'capture', 'check_fits', 'check_mem_fraction',
        'decide_attention', 'decide_capture', 'decide_model', 'decide_pools', 'fraction_remedy', 'graph_estimate',
        'graph_reserve_bytes', 'init_distributed', 'kv_dtype', 'load_model', 'model_dtype', 'served_field',
        'size_for', 'size_pools', 'truncate_spec',
    ],
    "pipeline.observe.trace": [
        'ErrorInfo', 'MAX_DEPTH', 'MAX_LINE_BYTES', 'Run', 'SCHEMA_VERSION', 'SKIP_DETAILS', 'SkippedLine', 'Trace',
        'TraceReader', 'UPGRADERS', 'UsageError', 'as_trace', 'dataclass', 'decode_record', 'field',
        'nothing_readable', 'read_trace', 'timeline', 'verification_failure',
    ],
    "pipeline.cli.run": [
        'AttnSetupError', 'ConfigError', 'DEFAULT_LAYERS', 'EXIT_FAILED', 'EXIT_INTERRUPTED', 'EXIT_OK', 'ErrorInfo',
        'ModelSpec', 'SetupRequest', 'UsageError', '_PLACEHOLDER', '_graph_line', '_pool_line', '_print',
        '_render_runner', '_report', 'add_parser', 'check_context', 'check_pool_for_checks',
        'check_warm_cache', 'cmd', 'error_info_from', 'is_gpu_device', 'log_path', 'model_line', 'open_log',
        'preflight', 'request_from', 'runner_config', 'summary_obj', 'timeline_rows', 'timeline_title',
        '_model_steps', '_verify', '_verify_runner', '_ended_by', '_rank_group',
    ],
    "pipeline.core.event_wire": [
        'AnyEvent', 'BackendBuilt', 'BackendsAnnotated', 'BackendsResolved', 'BuildPlanned', 'CommandFinished',
        'CommandStarted', 'CudaGraphCaptured', 'CudaGraphMemory', 'DeviceInitialized', 'DistributedInitialized',
        'ENVELOPE', 'EVENT_TYPES', 'EnvVarLookalike', 'Event', 'FLOAT_FIELDS', 'FeatureDowngraded', 'Heartbeat',
        'InstanceVerified', 'JitVariantLoaded', 'LazyMemInitialized', 'MAX_DEPTH', 'MemoryBalanced', 'MemoryPoolSized',
        'ModelLoaded', 'ModelStepVerified', 'NONFINITE', 'RankStalled', 'ReferenceFallback', 'ResolutionAgreed',
        'ResourcesReleased', 'RunFailed', 'RunFinished', 'RunInterrupted', 'RunStarted', 'RunnerReady', 'RunnerStarted',
        'RunnerTransition', 'SettingResolved', 'SlowPhase', 'StartupSummary', 'StateTransition', 'StepSkipped',
        'TOO_DEEP', 'clean_str', 'decode_line', 'encode', 'event_name', 'restore_floats', 'to_wire',
        '_float_spec', '_restore', '_float_text',
    ],
    "pipeline.core.contracts": [
        'ATTENTION_LAYER_TYPES', 'AttentionArgs', 'AttentionLayerType', 'BuildPlan', 'DeviceFacts', 'DtypeChoice',
        'ErrorInfo', 'Flag', 'ForwardMode', 'InstancePlan', 'LayerGroup', 'LayerKind', 'LayerType', 'MLADims', 'Mode',
        'ModelSpec', 'NOT_ATTENTION_LAYER_TYPES', 'PoolFacts', 'Rejection', 'Resolution', 'ResolvedAttentionBackendStr',
        'Rule', 'SCHEMA_VERSION', 'SetupRequest', 'SetupWarning', 'Skip', 'WorkspacePlan', 'check_attention_args',
        'check_pool_facts', 'check_setup_request',
    ],
    "pipeline.cli.inspect": [
        'EXIT_FAILED', 'EXIT_OK', 'RankDifferences', 'RankSummary', 'Run', 'StartupSummary', 'Trace', 'TraceReader',
        'add_parser', 'cmd', 'explain', 'failure_of', 'format_layer_ids', 'nothing_readable', 'rank_differences',
        'render', 'render_run', 'render_tail', 'report_obj', 'run_lines', 'run_obj', 'summary_lines', 'summary_of',
        'summary_rows', 'terminal_cols', '_decision_lines', '_safe', '_fit', '_is_tty',
    ],
    "pipeline.runtime.verify": [
        'AttentionBackend', 'AttentionLayer', 'BuildError', 'ForwardMode', 'KVPool', 'LayerKind', 'ModelSpec',
        'NEW_LENS', 'PREFIX_LENS', 'PageAllocator', 'ReqToTokenPool', 'SetupRequest', 'TOLERANCE', 'VERIFY_CHUNK',
        'VERIFY_WINDOW', 'VerifyResult', 'context_needed', 'dequantize_kv', 'layer_kv_scales', 'make_forward_batch',
        'norm_dtype', 'quantize_kv', 'reference_attention', 'rel_err', 'slots_needed', 'tolerance', 'torch_dtype',
        'verification_model', 'verify_all', 'verify_backend', 'verify_built', '_Case', '_check_case_step',
    ],
    "pipeline.backends.memory": [
        'BuildError', 'ConfigError', 'FP8_DTYPES', 'ForwardBatch', 'ForwardMode', 'KVPool', 'LayerKind',
        'PageAllocator', 'ReqToTokenPool', 'dequantize_kv', 'is_fp8', 'layer_kv_scales', 'make_forward_batch',
        'quantize_kv', 'torch_dtype', '_TORCH_DTYPES',
    ],
    "pipeline.backends.base": [
        'AttentionBackend', 'AttentionLayer', 'ForwardBatch', 'ForwardMode', 'GUARDED_METHODS', 'LAYER_FIELDS',
        'LayerField', 'LayerKind', 'LayerMismatch', 'PlannedLayers', 'attrgetter', 'check_layer', 'dataclass', 'field',
        'mark_closed',
    ],
    "states.resolve": [
        'AttentionArgs', 'BackendUnavailable', 'BackendUnknown', 'CapabilityMismatch', 'ConfigError',
        'ConflictingOptions', 'DeviceFacts', 'Explicit', 'ModelSpec', 'PDMUX_SM_PARTITION_ARCHS', 'Reason', 'Rejection',
        'Remedies', 'Resolution', 'ResolvedAttentionBackendStr', 'Rule', 'StrictRefusal', 'Survey', 'assignments',
        'auto_candidates', 'check_has_attention', 'check_modes', 'complete_fix', 'decide', 'decide_for_run',
        'explicit_choice', 'format_layer_ids', 'graph_skips', 'minimal', 'reference_fallback', 'refuse_strict',
        'resolve_dtype', 'suggest', 'warnings_for',
    ],
    "pipeline.backends.triton.backend": [
        'AttentionBackend', 'AttentionLayer', 'BuildError', 'CapabilityMismatch', 'ForwardBatch', 'ForwardMode',
        'LayerKind', 'PlannedLayers', 'TritonAttnBackend', 'create', 'dataclass', 'kv_scales', 'stored_kv',
    ],
}

NEW_HOMES = {
    "pipeline.core.events": ["pipeline.core.event_base", "pipeline.core.events_setup", "pipeline.core.events_runner",
                             "pipeline.core.events_observe", "pipeline.core.event_wire"],
    "pipeline.core.model_spec": ["pipeline.core.config_reader", "pipeline.core.layer_rules"],
    "pipeline.setup.distributed": ["pipeline.setup.rank_exchange"],
    "pipeline.backends.flashinfer": ["pipeline.backends.flashinfer_wrappers", "pipeline.backends.flashinfer_plan"],
    "pipeline.backends.triton.launch_mla": ["pipeline.backends.triton.mla_configs"],
    "states.graph_memory": ["states.cuda_allocator", "states.decode_trace"],
    "pipeline.runtime.table": ["pipeline.runtime.pool_steps"],
    "pipeline.observe.trace": ["pipeline.observe.trace_decode", "pipeline.observe.trace_view",
                               "pipeline.observe.trace_lines"],
    "pipeline.cli.run": ["pipeline.cli.run_checks", "pipeline.cli.run_report", "pipeline.cli.run_exit"],
    "pipeline.core.event_wire": ["pipeline.core.event_floats"],
    "pipeline.core.contracts": ["pipeline.core.decisions"],
    "pipeline.cli.inspect": ["pipeline.cli.inspect_text"],
    "pipeline.runtime.verify": ["pipeline.runtime.verify_case"],
    "pipeline.backends.memory": ["pipeline.backends.kv_quant"],
    "pipeline.backends.base": ["pipeline.backends.closed"],
    "states.resolve": ["states.modes"],
    "pipeline.backends.triton.backend": ["pipeline.backends.triton.backend_checks"],
}


@pytest.mark.parametrize("module", sorted(OLD_NAMES))
def test_every_old_name_still_there(module):
    if module.startswith(("pipeline.backends.flashinfer", "pipeline.backends.triton")):  # they import triton
        pytest.importorskip("triton")
    mod = importlib.import_module(module)
    missing = [n for n in OLD_NAMES[module] if not hasattr(mod, n)]
    assert not missing
    for home in NEW_HOMES[module]:
        new = importlib.import_module(home)
        for name, value in vars(new).items():
            if name in OLD_NAMES[module] and callable(value):
                assert getattr(mod, name) is value, (module, name, home)


@pytest.mark.parametrize("module", ["pipeline.core.events", "pipeline.core.model_spec", "pipeline.core.event_wire",
                                    "pipeline.core.config_reader", "pipeline.core.layer_rules",
                                    "states.graph_memory", "states.cuda_allocator", "pipeline.runtime.table",
                                    "pipeline.runtime.pool_steps", "pipeline.observe.trace",
                                    "pipeline.observe.trace_decode", "pipeline.observe.trace_view",
                                    "pipeline.observe.trace_lines", "pipeline.core.event_floats",
                                    "pipeline.core.decisions", "states.modes", "states.decode_trace",
                                    "states.resolve"])
def test_split_core_modules_stay_torch_free(module):
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent)


def test_record_modules_split_by_emitter():
    """Every record type lives in one of the three record modules, and the union lists each once."""
    from pipeline.core import events as ev

    homes = {c.__module__ for c in ev.EVENT_TYPES}
    assert homes == {"pipeline.core.events_setup", "pipeline.core.events_runner", "pipeline.core.events_observe"}
    assert len(set(ev.EVENT_TYPES)) == len(ev.EVENT_TYPES) == len({ev.event_name(c) for c in ev.EVENT_TYPES})
