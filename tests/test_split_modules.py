"""Issue 15's module splits keep every name importable from the module that held it.

``OLD_NAMES`` is what each split module exposed at 6adc991 (before the split: every public top-level name,
imported ones included, recorded from that commit); each must still be there and be the same object as in the
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
        '_render_runner', '_report', 'add_parser', 'check_context', 'check_num_layers', 'check_pool_for_checks',
        'check_warm_cache', 'cmd', 'error_info_from', 'is_gpu_device', 'log_path', 'model_line', 'open_log',
        'preflight', 'request_from', 'runner_config', 'summary_obj', 'timeline_rows', 'timeline_title',
        '_model_steps', '_verify', '_verify_runner', '_ended_by', '_rank_group',
    ],
}

NEW_HOMES = {
    "pipeline.core.events": ["pipeline.core.event_base", "pipeline.core.events_setup", "pipeline.core.events_runner",
                             "pipeline.core.events_observe", "pipeline.core.event_wire"],
    "pipeline.core.model_spec": ["pipeline.core.config_reader", "pipeline.core.layer_rules"],
    "pipeline.setup.distributed": ["pipeline.setup.rank_exchange"],
    "pipeline.backends.flashinfer": ["pipeline.backends.flashinfer_wrappers", "pipeline.backends.flashinfer_plan"],
    "pipeline.backends.triton.launch_mla": ["pipeline.backends.triton.mla_configs"],
    "states.graph_memory": ["states.cuda_allocator"],
    "pipeline.runtime.table": ["pipeline.runtime.pool_steps"],
    "pipeline.observe.trace": ["pipeline.observe.trace_decode", "pipeline.observe.trace_view"],
    "pipeline.cli.run": ["pipeline.cli.run_checks", "pipeline.cli.run_report"],
}


@pytest.mark.parametrize("module", sorted(OLD_NAMES))
def test_every_old_name_still_there(module):
    if module.startswith(("pipeline.backends.flashinfer", "pipeline.backends.triton")):
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
                                    "pipeline.observe.trace_decode", "pipeline.observe.trace_view"])
def test_split_core_modules_stay_torch_free(module):
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent)


def test_record_modules_split_by_emitter():
    """Every record type lives in one of the three record modules, and the union lists each once."""
    from pipeline.core import events as ev

    homes = {c.__module__ for c in ev.EVENT_TYPES}
    assert homes == {"pipeline.core.events_setup", "pipeline.core.events_runner", "pipeline.core.events_observe"}
    assert len(set(ev.EVENT_TYPES)) == len(ev.EVENT_TYPES) == len({ev.event_name(c) for c in ev.EVENT_TYPES})
