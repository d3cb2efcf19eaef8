"""Which class of work a profiled kernel (CUDA) or operator (CPU) is: the rows of the ``moe layer`` profile.

A CUDA kernel is named by its launcher: cuBLAS and cuBLASLt (``sm90_xmma_gemm_...``, ``nvjet_tst_...``,
``cutlass_80_tensorop_...gemm``), torch's flash and memory-efficient attention (``pytorch_flash::flash_fwd_kernel``,
``fmha_cutlassF_...``), CUTLASS's grouped GEMM under ``torch._grouped_mm`` (``cutlass::gemm::GroupProblemShape``,
``KernelPtrArray...``), ATen's own kernels (``at::native::vectorized_elementwise_kernel``,
``at::native::reduce_kernel``, ``indexSelectLargeIndex``, ``CatArrayBatchedCopy``, ``multi_tensor_apply_kernel``),
Inductor's Triton kernels (``triton_poi_fused_...``, ``triton_red_fused_...``), NCCL, and the copies and sets the
profiler records as ``Memcpy DtoD`` and ``Memset``. :func:`classify` sorts a name by rules tried in a fixed order
(:data:`RULES`): the specific classes first, because their names also hold the generic words (a flash-attention
kernel names ``cutlass``, a grouped GEMM names ``gemm``, an index kernel names ``elementwise``).

On CPU the profile sees ATen operators instead (``aten::mm``, ``aten::_grouped_mm``, ...); their names go through
the same rules, and :func:`classify_event` also looks at the operators that called them (on CPU ``_grouped_mm`` runs
one ``aten::mm`` per expert, which belongs to the grouped GEMM).
"""

from __future__ import annotations

import re

CLASSES = (
    "grouped GEMM",
    "attention",
    "GEMM",
    "index/gather/copy",
    "elementwise/reduce",
    "optimizer",
    "communication",
    "other",
)
"""The classes, in the order the profile prints them."""

CONTEXT_CLASSES = ("grouped GEMM", "attention", "optimizer", "communication")
"""Classes an operator passes on to everything it calls (:func:`classify_event`)."""

RULES: tuple[tuple[str, re.Pattern], ...] = tuple(
    (cls, re.compile(pattern, re.IGNORECASE))
    for cls, pattern in (
        ("communication", r"nccl|c10d::|allreduce|all_reduce|allgather|all_gather|reduce_scatter|alltoall"),
        (
            "optimizer",
            r"adam|multi_tensor_apply|_foreach_|lpnorm_cleanup|Optimizer\.step|optimizer\.step",
        ),
        (
            "attention",
            r"flash_fwd|flash_bwd|pytorch_flash|flash_attention|fmha|attention|scaled_dot_product|sdpa",
        ),
        ("grouped GEMM", r"grouped_?mm|grouped_?gemm|gemmgrouped|groupproblemshape|ptrarray"),
        (
            "GEMM",
            r"gemm|xmma|nvjet|cublas|cutlass|wgmma|gemv|splitkreduce|s16816|s1688|h16816|"
            r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|mv|addmv|dot)$",
        ),
        ("elementwise/reduce", r"^triton_|elementwise_kernel_with_index"),
        (
            "index/gather/copy",
            r"index|gather|scatter|catarray|copy|memcpy|memset|^aten::(cat|stack|fill_|zero_|zeros|contiguous|"
            r"clone|_to_copy|to|select|slice|narrow|where|masked_select|masked_fill_?|nonzero|sort|argsort|"
            r"topk|embedding\w*|take|put_?|repeat_interleave|split\w*|chunk|unbind)$|radixsort|sort|topk|"
            r"embedding|masked|nonzero|unique|fill",
        ),
        (
            "elementwise/reduce",
            r"elementwise|reduce|softmax|norm|silu|gelu|activation|functor|vectorized|unrolled|scan|moments|"
            r"cross_entropy|distribution|^aten::",
        ),
    )
)
"""(class, pattern) in the order they are tried; a name no pattern matches is ``other``."""


def classify(name: str) -> str:
    """The class of a CUDA kernel's or an ATen operator's name (:data:`RULES`, first match)."""
    for cls, pattern in RULES:
        if pattern.search(name):
            return cls
    return "other"


def classify_event(event) -> str:
    """The class of a profiler event (a ``torch.autograd.profiler_util.FunctionEvent``): the nearest operator on
    its chain of callers (itself first) whose class is one of :data:`CONTEXT_CLASSES`, else its own name's class."""
    e = event
    while e is not None:
        cls = classify(e.name)
        if cls in CONTEXT_CLASSES:
            return cls
        e = e.cpu_parent
    return classify(event.name)
