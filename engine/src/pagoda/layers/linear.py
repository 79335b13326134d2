"""Linear layers whose weights come from a checkpoint, including fused projections."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from pagoda.quantization.loading import QuantizedSource


class LinearKernel(Protocol):
    """What :meth:`Linear.set_kernel` takes (see :mod:`pagoda.layers.linear_kernels`)."""

    name: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def float_output(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x).float()``, for kernels that can write it in one pass."""
        ...


_WEIGHTS_ON_META = contextvars.ContextVar("pagoda_linear_weights_on_meta", default=False)


@contextlib.contextmanager
def linear_weights_on_meta() -> Iterator[None]:
    """Linear layers built inside this block get their dense weight on the meta device (no memory): the loader of a
    quantized checkpoint removes the quantized layers' weights and then :func:`materialize_linear_weights` the rest.
    Without it a 70B AWQ model would first allocate its whole bf16 size on the GPU."""
    token = _WEIGHTS_ON_META.set(True)
    try:
        yield
    finally:
        _WEIGHTS_ON_META.reset(token)


def materialize_linear_weights(model: nn.Module, device: torch.device | str) -> None:
    """Allocate (uninitialised, on ``device``) every Linear weight still on the meta device."""
    for layer in model.modules():
        if isinstance(layer, Linear) and layer.weight is not None and layer.weight.is_meta:
            shape, dtype = layer.weight.shape, layer.weight.dtype
            layer.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T + b. Storage is left uninitialised: every value is overwritten by the loader.

    After loading, :func:`pagoda.layers.linear_kernels.prepare_linear_layers` may hand the layer a
    kernel (a prepacked or quantized copy of the weight); the plain weight is then released.
    """

    # Never quantized at load (--quantization int8 / fp8): a mixture of experts' router, whose logits pick the
    # experts; quantizing it changes which experts tokens go to, not just a rounding step. Checkpoints leave it dense.
    keep_dense: bool = False
    # One kernel, one weight copy: no row-count dispatch between two kernels that each hold the weight
    # (kernel_timing.ModelKernelSelector). Set on routed experts, which hold most of a mixture of experts' bytes.
    one_weight_copy: bool = False

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        shared_weight: Optional[nn.Parameter] = None,  # e.g. an lm_head tied to the embedding
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        if shared_weight is not None:
            assert shared_weight.shape == (out_features, in_features), shared_weight.shape
            self.weight = shared_weight
        else:
            device = "meta" if _WEIGHTS_ON_META.get() else None  # None: the default (or torch.device context)
            self.weight = nn.Parameter(
                torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
            )
        self.bias: Optional[nn.Parameter] = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        )
        self.kernel: Optional[LinearKernel] = None
        # A quantized checkpoint's tensors for this layer until its kernel is built (see hold_quantized_source).
        self.quant_source: Optional[QuantizedSource] = None
        # The adapters' slots when LoRA is on (a pagoda.lora.layers.LinearLoRA): their delta is added to the output.
        self.lora: Optional[Any] = None

    def hold_quantized_source(self, source: QuantizedSource) -> None:
        """Take the layer's weight from a quantized checkpoint: the dense ``weight`` parameter goes (None: the loader
        must not expect one) and ``source`` collects the checkpoint's tensors until
        :func:`~pagoda.layers.linear_kernels.prepare_linear_layers` builds the kernel from them."""
        self.quant_source = source
        del self.weight
        self.register_parameter("weight", None)

    def set_kernel(self, kernel: LinearKernel) -> None:
        """Multiply with ``kernel`` from now on and drop this layer's reference to the plain weight
        (a tied embedding keeps its own reference)."""
        self.kernel = kernel
        if self.weight is not None:  # None: a quantized layer, which never had a dense weight
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, in] -> [num_tokens, out]
        out = self.kernel(x) if self.kernel is not None else F.linear(x, self.weight, self.bias)
        if self.lora is not None:
            self.lora.add_to(out, x)  # the step's adapters, on their rows
        return out

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        """``forward(x).float()``: the output rounded to the layer's dtype, then widened (logits, as in HF).

        The native CPU kernels write that in one pass; for a [32, 151936] lm_head the separate
        conversion cost ~4 ms of a 135 ms decode step.
        """
        if self.kernel is not None:
            return self.kernel.float_output(x)
        return self.forward(x).float()

    def extra_repr(self) -> str:
        kernel = "" if self.kernel is None else f", kernel={getattr(self.kernel, 'name', 'custom')}"
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}{kernel}"


class Embedding(nn.Module):
    """Token embedding table [vocab, hidden]; uninitialised like :class:`Linear`.

    Vocab-parallel under tensor parallelism: this rank holds rows ``[vocab_start, vocab_start + num_embeddings)``,
    looks up the ids in that range, writes zeros for the others, and one all-reduce sums the ranks' rows (each id
    is non-zero on exactly one rank, so the sum is exact).
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, vocab_start: int = 0, tp: Any = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype), requires_grad=False)
        self.vocab_start = vocab_start
        self.tp = tp  # a pagoda.distributed.parallel.TensorParallel; None: the whole table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [num_tokens] -> [num_tokens, dim]
        if self.tp is None or self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])  # [num_tokens] ids another rank holds
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)  # [num_tokens, dim]
        rows.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(rows)


class MergedLinear(Linear):
    """Several projections of the same input stored as one matrix, so they run as one GEMM.

    Output rows are the concatenation of the parts in order (e.g. [q | k | v] or [gate | up]);
    each checkpoint tensor is copied into its part with :meth:`load_part`. ``gated`` marks a
    [gate | up] pair whose kernel may compute ``silu(gate) * up`` itself (:meth:`forward_silu_and_mul`).
    """

    def __init__(
        self, in_features: int, output_sizes: Sequence[int], bias: bool, dtype: torch.dtype, gated: bool = False
    ) -> None:
        super().__init__(in_features, sum(output_sizes), bias, dtype)
        self.output_sizes = tuple(output_sizes)
        if gated and (len(self.output_sizes) != 2 or self.output_sizes[0] != self.output_sizes[1]):
            raise ValueError(f"a gated projection has two equal parts, not {self.output_sizes}")
        self.gated = gated

    def forward_silu_and_mul(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """``silu(gate) * up`` in one pass when the kernel has that epilogue for ``x`` (see
        :class:`~pagoda.layers.cpu_linear.NativeGatedBf16Linear`); None otherwise."""
        if self.lora is not None and self.lora.active(x.shape[0]):
            return None  # the adapters' delta goes in before the activation
        fused = getattr(self.kernel, "silu_and_mul", None) if self.gated else None
        return None if fused is None else fused(x)  # x: [num_tokens, in] -> [num_tokens, intermediate]

    def part_rows(self, index: int) -> slice:
        """Rows of the fused weight that hold part ``index``."""
        start = sum(self.output_sizes[:index])
        return slice(start, start + self.output_sizes[index])

    def load_part(self, param_name: str, index: int, tensor: torch.Tensor) -> None:
        """Copy one part's checkpoint ``weight`` or ``bias`` into the fused parameter."""
        param = getattr(self, param_name)
        assert param is not None, f"{param_name} is not a parameter of this layer"
        target = param.data[self.part_rows(index)]
        if target.shape != tensor.shape:
            raise ValueError(f"expected shape {tuple(target.shape)}, checkpoint has {tuple(tensor.shape)}")
        target.copy_(tensor)
