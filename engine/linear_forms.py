"""
The CPU forms of a Linear a decoding step can run on, and the swaps that put a model in them:
oneDNN-packed fp32 and bf16 (PackedLinear), int8 weights with int8 activations (Int8Linear), and
4-bit weights in groups of 32 with bf16 activations (Int4Linear). Each is frozen (inference only)
and gives a row of its output the same bits whatever rows come with it, where verification needs
that (tests/test_model.py checks it). Which form a run takes is layouts.py's.
"""
import torch
import torch.nn as nn



class PackedLinear(nn.Module):
    """A frozen nn.Linear (fp32 or bf16) whose weight sits in oneDNN's blocked layout, for the
    small-batch matmuls of decoding (1 token) and verification (k+1 tokens), where nn.Linear's path
    reads the weights at a lower bandwidth on some CPUs. Which layout is fastest differs between CPU
    models: `--dtype auto` measures it on yours."""

    def __init__(self, linear: nn.Linear, batch_hint: int):
        super().__init__()
        self.out_features = linear.out_features
        self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x):
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self.weight, self.bias,
                                               "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


def dense_weight(linear: nn.Module) -> torch.Tensor:
    """The (out, in) weight of an nn.Linear or of any of the frozen forms below, as an ordinary tensor."""
    w = linear.weight
    return w.to_dense() if w.layout == torch._mkldnn else w


def packable(dtype: torch.dtype) -> bool:
    """Whether oneDNN can hold weights of this dtype in its blocked layout here (bf16 needs AVX-512)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_for_cpu(model: nn.Module, batch_hint: int = 8) -> nn.Module:
    """Swap every nn.Linear of an fp32 or bf16 CPU inference model for a PackedLinear (in place)."""
    p = next(model.parameters())
    if p.device.type != "cpu" or not packable(p.dtype):
        return model
    for module in [m for m in model.modules() if any(type(c) is nn.Linear for c in m.children())]:
        for name, child in list(module.named_children()):  # (each replaced Linear is freed at once)
            if type(child) is nn.Linear:
                setattr(module, name, PackedLinear(child, batch_hint))
    return model


class Int8Linear(nn.Module):
    """A frozen nn.Linear with int8 weights (symmetric, one scale per output channel) that quantizes
    its input per token (one scale per row) and multiplies in integers (torch._int_mm). Integer
    sums are exact, so each row's output depends on that row alone: verifying k+1 tokens in one
    forward gives each token exactly what a one-token step gives it, and greedy speculative
    decoding reproduces plain decoding of this model bit for bit. (fbgemm's dynamic int8 Linear
    quantizes the whole input with one scale, so its outputs change with the batch around them.)"""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()  # (out, in)
        self.out_features = linear.out_features
        self.register_buffer("weight_scale", w.abs().amax(1).clamp_min(1e-12) / 127)  # (out,)
        weight_int8 = (w / self.weight_scale[:, None]).round().to(torch.int8)  # (out, in)
        self.register_buffer("weight_int8", weight_int8)
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1]).float()  # (m, in)
        scale = rows.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127  # (m, 1): per token
        xq = (rows / scale).round().to(torch.int8)
        y = torch._int_mm(xq, self.weight_int8.t()) * (scale * self.weight_scale)  # (m, out) int32 -> fp32
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    @property
    def weight(self):  # what dense_weight and the draft initialisation read
        return self.weight_int8.float() * self.weight_scale[:, None]


def quantize_int8(model: nn.Module, keep=()) -> nn.Module:
    """Swap every nn.Linear of a CPU inference model for an Int8Linear (in place), but those named
    in keep: int8 weights, fp32 everywhere else (embeddings, norms, attention). A decode step on a
    CPU waits for the bytes of its weights, and int8 ones are a quarter of fp32's."""
    p = next(model.parameters())
    if p.device.type != "cpu":
        raise ValueError("int8 weights run on the CPU only; use bfloat16 on a GPU")
    for module in [m for m in model.modules() if any(type(c) is nn.Linear for c in m.children())]:
        for name, child in list(module.named_children()):  # (each replaced Linear is freed at once)
            if type(child) is nn.Linear and name not in keep:
                setattr(module, name, Int8Linear(child))
    return model


INT4_GROUP = 32  # inputs per scale and offset, as in the GGUF Q4_1 blocks the default target ships in


class Int4Linear(nn.Module):
    """A frozen nn.Linear with 4-bit weights: each run of 32 inputs of an output row has its own
    scale and offset (min-max rounding, asymmetric), multiplied by torch's CPU int4 kernel with bf16
    activations. Q4_1 blocks are min-max rounded over 32 inputs too, so a weight dequantized from
    the default target's GGUF file comes back to its original 4-bit code: for that target the
    layout changes only the rounding of the scales (to bf16), not the weights' codes. A step reads
    a quarter of bf16's bytes."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()  # (out, in)
        out_features, in_features = w.shape
        groups = w.view(out_features, in_features // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(-1), groups.amax(-1)  # (out, in / 32)
        scale = ((high - low) / 15).clamp_min(1e-12)
        codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15)
        self.out_features = out_features
        # the kernel computes (code - 8) * scale + zero
        self.register_buffer("weight_int4", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).view(out_features, in_features), 1))
        scales_and_zeros = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1)  # (in / 32, out, 2)
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous().to(torch.bfloat16))
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)

    def forward(self, x):
        # (inputs are bf16 in a model quantize_int4 made: the casts are skipped, not called, as
        # each call counts in a one-token step)
        rows = x.reshape(-1, x.shape[-1])  # (m, in)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows if x.dtype == torch.bfloat16 else rows.to(torch.bfloat16),
                                                       self.weight_int4, INT4_GROUP, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        y = y.view(*x.shape[:-1], self.out_features)
        return y if x.dtype == torch.bfloat16 else y.to(x.dtype)

    @property
    def weight(self):  # what dense_weight and the draft initialisation read
        eye = torch.eye(self.scales_and_zeros.shape[0] * INT4_GROUP, dtype=torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.weight_int4, INT4_GROUP,
                                                          self.scales_and_zeros).t().float()


def quantize_int4(model: nn.Module) -> nn.Module:
    """Swap the nn.Linear layers of a CPU inference model for Int4Linear (in place) and make the
    rest bf16, which the int4 kernel multiplies with. Quantize from fp32 weights: rounding them to
    bf16 first would move some of a GGUF weight's codes. The output head shares the embedding table
    (8-bit in the GGUF file, not 4) and stays bf16 in oneDNN's layout, as do layers whose inputs are
    not a whole number of 32-input groups or whose outputs are not a multiple of 16."""
    p = next(model.parameters())
    if p.device.type != "cpu":
        raise ValueError("int4 weights run on the CPU only; use bfloat16 on a GPU")
    for module in [m for m in model.modules() if any(type(c) is nn.Linear for c in m.children())]:
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and name != "lm_head" and child.in_features % INT4_GROUP == 0 \
                    and child.out_features % 16 == 0:  # (what torch's int4 packing takes)
                setattr(module, name, Int4Linear(child))
    return pack_for_cpu(model.to(torch.bfloat16))
