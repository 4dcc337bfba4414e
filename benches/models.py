#!/usr/bin/env python3
"""Fusions from real model families: kiln against torch eager and torch.compile on the GPU.

Run on the H200 (torch with CUDA, CuPy and kiln installed)::

    python3 benches/models.py [--quick] [--only NAME ...] [--out DIR]

and anywhere, without a GPU or torch, to validate the kiln definitions here::

    python3 benches/models.py --cpu-check

Workloads. Each is a fusion of one model family at the size its issue gives: GPT-2's bias +
GELU(tanh) written with ``pow(h, 3.0)``, LLaMA's SwiGLU, RMSNorm and RoPE, logsumexp,
log-softmax and cross-entropy over 32000 and 128256 vocabularies, a [B, S, H] -> [B, H, S]
permute with SiLU, BERT's residual + LayerNorm, a pre-LN residual + LayerNorm with two
outputs, Gemma's RMSNorm, BERT and GPT-2 attention softmaxes, BatchNorm2d in training,
AdamW and SGD-momentum steps and gradient-norm clipping over 64M parameters, GPT-2's
embedding + positions (also of a [B, S] batch as ATen writes it), timm's LayerNorm2d,
Megatron's [S, B, H] -> [B, S, H] + bias + residual, ReLU backward with the bias gradient and
LayerNorm backward.
The kiln side reuses ``tests/families.py`` where a family exists (an unscheduled
``FusionDefinition``, an input maker, a float64 reference, the minimum traffic) and defines
the rest here in the same form; every fusion is left unscheduled, so kiln's automatic
schedulers pick the schedule. Each peer is the torch
code the model runs, written the way the model's code writes it (HF transformers,
``torch.nn.functional``, ``torch.optim``'s single-tensor steps, which update their state in
place, and the ATen backward that autograd calls), eager and under
``torch.compile(dynamic=False)``, on the same CUDA tensors as kiln.

Inputs are drawn on the GPU (``torch.randn`` for every float input, in its declared dtype);
integer and boolean inputs are the family's own (column indices, causal masks, ignored
labels), with random token ids and labels, a padding mask, non-negative second moments,
LayerNorm statistics of the input and an active clipping threshold filled in per workload.

Timing, as in benches/gpu_peers.py: the GPU first runs 1 GiB copies for about two seconds
so that its clocks are up. Then, per workload, kiln, torch eager and torch.compile are
timed in 5 interleaved rounds of 20 calls (the order rotates every round; each round starts
with 3 warm-up calls; both compile during the checks before). Every call is bracketed by its own pair
of CUDA events and the median of the 100 calls is reported in microseconds (``--quick``:
2 rounds of 5, about a quarter of the rows). Before each timed call L2 lines held with an
evict_last priority are returned to normal (``cuCtxResetPersistingL2Cache``), a 256 MiB
buffer is read to flush L2, and a ``torch.cuda._sleep`` kernel is queued so that the host
runs ahead of the GPU: the events time the GPU work of the call, not the Python launch.

Host-inclusive time: per round, N = 20 calls (5 with ``--quick``) run back to back with the
host in the loop (no sleep kernel, L2 flushed once before them), timed by the wall clock
from a synchronized GPU to a synchronized GPU and divided by N; the median over the rounds
is reported for kiln, torch.compile and torch eager. It includes Python dispatch, guards
and launch overhead wherever the GPU does not hide them.

Effective GB/s = the minimum traffic (inputs read once, outputs written once; a gather
counts only the rows it reads) / median time, against a device-to-device copy of a 1 GiB
tensor (bytes read + written / time) as the roofline. ``kiln / best peer`` = the fastest
peer's time / kiln's time (>= 1.0: kiln at least as fast; a peer whose result disagrees
with torch eager is left out). Kernels = ``len(fd.lower(inputs).kernels)`` of the automatic
schedule on the inputs timed, beside the fewest that can do it.

Checks: kiln's outputs (and torch.compile's) are compared with torch eager's on the same
inputs, peers that update their state in place running on copies of it: where the peer
returns fewer outputs than kiln (the loss alone for cross-entropy; y and the running
statistics for BatchNorm), the ones it returns. Tolerances per output: twice the family's
tolerance against float64 (each side may be that far from the exact result), relative at
least 2 ulps of the output dtype (bf16 1.6e-2, half 2e-3). A mismatch is marked loudly; an
exception from kiln is recorded (its text goes into the JSON) and the run goes on.

``--cpu-check`` needs no GPU and no torch: it builds every workload at small, awkward sizes
and runs it through kiln's CPU interpreter (``fd.execute`` on NumPy arrays) against the
float64 NumPy reference with the family's tolerances, and lowers it at the issue's size on
the default target (132 SMs) for the kernel count. Without ``ml_dtypes`` NumPy has no
bfloat16: the bf16 definitions of this file are then checked with float32 inputs and outputs
cast to and from bf16 inside the fusion (the same bf16 math), and the bf16 families of
tests/families.py are skipped (tests/test_families.py covers them where ml_dtypes is).

Notes: the kiln families return new tensors where torch.optim's steps, clip_grad_norm_ and
BatchNorm's running statistics update in place (kiln's ``add_output(out, alias_input=inp)``
copies after the launch, which would add traffic; no family uses it); the minimum traffic is
the same either way. The RoPE peer leaves HF's strided [B, H, S, D] view of a [B, S, H, D]-ordered
tensor, and so does kiln (``families.llama_rope_view``, ``add_output(..., stride_order)``;
``families.llama_rope`` writes [B, H, S, D] in order); the [B, S, H] -> [B, H, S] peer materializes its
permute with ``.contiguous()``, as kiln does. torch.compile compiles every workload anew
(``torch._dynamo.reset()`` between them), so a full run takes a while: split it with
``--only`` where a command's time is limited.

Writes ``models.json`` and ``models.png`` (when matplotlib imports) into ``--out`` and prints
the table last. Exit status: 0 when every kiln result matches, 1 when any mismatches, 2 when
none mismatches but kiln raised on some workload, or the peer did (no reference), or there
is no CUDA device.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple
from unittest import mock

import kiln
import numpy as np
from kiln import DataType, FusionDefinition

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import families as fams  # noqa: E402

Sizes = Tuple[int, ...]
Family = fams.Family

ROUNDS_FULL, RUNS_PER_ROUND_FULL = 5, 20
ROUNDS_QUICK, RUNS_PER_ROUND_QUICK = 2, 5
WARMUP = 3
CLOCK_WARMUP_S = 2.0
COPY_BYTES = 1 << 30
FLUSH_BYTES = 256 << 20  # over four times the H200's L2
SLEEP_CYCLES = 2_000_000  # about 1 ms at H200 clocks: keeps the host ahead of the GPU
SEED = 0
DEFAULT_OUT = "models_out"
DEVICE = "cuda"  # where the inputs are drawn (the timing is CUDA's)
PEERS = ("eager", "compile")
GELU_C = math.sqrt(2.0 / math.pi)
# Relative tolerance floor per output dtype: two ulps (one rounding on each side and slack).
REL_FLOOR = {"float32": 2.0**-22, "float16": 2e-3, "bfloat16": 1.6e-2, "float64": 1e-12}

# torch and torch.nn.functional, imported by ``import_torch`` (--cpu-check runs without them).
torch: Any = None
F: Any = None


# ============================================================================ new kiln families
def _lowp_in(fd: FusionDefinition, rank: int, dt: DataType, f32_io: bool) -> Any:
    """An input of dtype ``dt``; with ``f32_io`` a float32 input rounded to ``dt`` first (the same
    math where NumPy cannot hold ``dt``)."""
    if not f32_io:
        return fams._tensor(fd, rank, dt)
    return fd.ops.cast(fams._tensor(fd, rank, DataType.Float), dt)


def _lowp_out(fd: FusionDefinition, t: Any, f32_io: bool) -> None:
    """``t`` as an output, widened to float32 with ``f32_io``."""
    fd.add_output(fd.ops.cast(t, DataType.Float) if f32_io else t)


def _lowp_np(dt: DataType, f32_io: bool) -> Any:
    """The NumPy dtype of a ``dt`` input (float32 with ``f32_io``)."""
    return np.float32 if f32_io else fams.np_dtype(dt)


def gpt2_gelu_pow(sizes: Sizes) -> Family:
    """GPT-2's MLP activation on the bias-added c_fc output, as HF's NewGELUActivation writes
    it: ``h = x + b``; ``0.5 * h * (1 + tanh(sqrt(2/pi) * (h + 0.044715 * pow(h, 3.0))))``;
    [M, N] float, b [N]."""
    with FusionDefinition() as fd:
        x = fams._tensor(fd, 2)
        b = fams._tensor(fd, 1)
        h = fd.ops.add(x, fams._bcast(fd, b, 2, [1]))
        inner = fd.ops.mul(GELU_C, fd.ops.add(h, fd.ops.mul(0.044715, fd.ops.pow(h, 3.0))))
        fd.add_output(fd.ops.mul(fd.ops.mul(0.5, h), fd.ops.add(1.0, fd.ops.tanh(inner))))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        rng = fams._rng("gpt2_gelu_pow", sizes, seed)
        return [fams._randn(rng, sizes), fams._randn(rng, (sizes[1],), scale=0.1)]

    def ref(x: np.ndarray, b: np.ndarray) -> List[np.ndarray]:
        h = x + b
        return [0.5 * h * (1.0 + np.tanh(GELU_C * (h + 0.044715 * h**3)))]
    return Family("gpt2_gelu_pow", sizes, fd, make, ref, rtol=1e-5, atol=1e-6)


def llama_swiglu(sizes: Sizes, f32_io: bool = False) -> Family:
    """LlamaMLP's gate: ``act_fn(gate_proj(x)) * up_proj(x)`` = ``F.silu(a) * b`` on bf16 [M, N],
    as eager runs it: silu in float rounded to bf16, the product in float rounded to bf16."""
    dt = DataType.BFloat16
    with FusionDefinition() as fd:
        a = _lowp_in(fd, 2, dt, f32_io)
        b = _lowp_in(fd, 2, dt, f32_io)
        af = fd.ops.cast(a, DataType.Float)
        act = fd.ops.cast(fd.ops.mul(af, fd.ops.sigmoid(af)), dt)
        y = fd.ops.mul(fd.ops.cast(act, DataType.Float), fd.ops.cast(b, DataType.Float))
        _lowp_out(fd, fd.ops.cast(y, dt), f32_io)

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        rng = fams._rng("llama_swiglu", sizes, seed)
        npd = _lowp_np(dt, f32_io)
        return [fams._randn(rng, sizes, npd, scale=2.0), fams._randn(rng, sizes, npd)]

    def ref(a: np.ndarray, b: np.ndarray) -> List[np.ndarray]:
        return [a / (1.0 + np.exp(-a)) * b]
    return Family("llama_swiglu", sizes, fd, make, ref, rtol=2e-2, atol=2e-2, dtypes=("BFloat16",))


def llama_rmsnorm_bf16(sizes: Sizes, f32_io: bool = False) -> Family:
    """LlamaRMSNorm in bfloat16: ``h = x.to(float32); variance = h.pow(2).mean(-1, keepdim=True);
    h = h * rsqrt(variance + eps); weight * h.to(bfloat16)`` (the weight multiply in bf16)."""
    _, n = sizes
    dt = DataType.BFloat16
    with FusionDefinition() as fd:
        x = _lowp_in(fd, 2, dt, f32_io)
        w = _lowp_in(fd, 1, dt, f32_io)
        h = fd.ops.cast(x, DataType.Float)
        variance = fd.ops.mul(fd.ops.sum(fd.ops.pow(h, 2), dims=[1], keepdim=True), 1.0 / n)
        h = fd.ops.mul(h, fd.ops.rsqrt(fd.ops.add(variance, fams.RMS_EPS)))
        _lowp_out(fd, fd.ops.mul(fams._bcast(fd, w, 2, [1]), fd.ops.cast(h, dt)), f32_io)

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        m, n = sizes
        rng = fams._rng("llama_rmsnorm_bf16", sizes, seed)
        npd = _lowp_np(dt, f32_io)
        return [fams._randn(rng, (m, n), npd), fams._randn(rng, (n,), npd, scale=0.5, shift=1.0)]

    def ref(x: np.ndarray, w: np.ndarray) -> List[np.ndarray]:
        return [w * (x / np.sqrt((x * x).mean(axis=1, keepdims=True) + fams.RMS_EPS))]
    return Family("llama_rmsnorm_bf16", sizes, fd, make, ref, rtol=2e-2, atol=2e-2, dtypes=("BFloat16",))


def relu_backward_bias_grad(sizes: Sizes) -> Family:
    """The backward of ``relu(x @ W + b)`` up to the matmuls: ``dx = dy * (y > 0)`` and the bias
    gradient ``db = dx.sum(0)``, from the upstream gradient dy and the ReLU output y, [M, N]."""
    m, _ = sizes
    with FusionDefinition() as fd:
        dy = fams._tensor(fd, 2)
        y = fams._tensor(fd, 2)
        dx = fd.ops.mul(dy, fd.ops.cast(fd.ops.gt(y, 0.0), DataType.Float))
        fd.add_output(dx)
        fd.add_output(fd.ops.sum(dx, dims=[0]))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        rng = fams._rng("relu_backward_bias_grad", sizes, seed)
        return [fams._randn(rng, sizes), fams._randn(rng, sizes)]

    def ref(dy: np.ndarray, y: np.ndarray) -> List[np.ndarray]:
        dx = dy * (y > 0)
        return [dx, dx.sum(axis=0)]
    # One kernel can do it: each block adds its rows' column partials, the last one finishes.
    return Family("relu_backward_bias_grad", sizes, fd, make, ref, rtol=1e-6, atol=1e-7,
                  out_tols=[None, (1e-5, 1e-4 * math.sqrt(m))])


def cross_entropy_gather(sizes: Sizes) -> Family:
    """``F.cross_entropy(logits, labels)`` as torch decomposes it (Thunder and nvFuser
    translate it the same way): ``log_softmax`` then ``nll_loss``, a gather of each row's
    label entry with ``take_along_axis``, averaged over the rows. Inputs logits [B, V]
    float and labels [B] int64 (all in range); output the 0-d loss."""
    b, _ = sizes
    with FusionDefinition() as fd:
        x = fams._tensor(fd, 2)
        labels = fams._tensor(fd, 1, DataType.Int)
        mx = fd.ops.max(x, dims=[1], keepdim=True)
        xs = fd.ops.sub(x, mx)
        logp = fd.ops.sub(xs, fd.ops.log(fd.ops.sum(fd.ops.exp(xs), dims=[1], keepdim=True)))
        picked = fd.ops.take_along_axis(logp, fd.ops.broadcast_in_dim(labels, [-1, 1], [0]), 1)
        fd.add_output(fd.ops.neg(fd.ops.mul(fd.ops.sum(picked, dims=[0, 1]), 1.0 / b)))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        b, v = sizes
        rng = fams._rng("cross_entropy_gather", sizes, seed)
        return [fams._randn(rng, (b, v), scale=2.0), rng.integers(0, v, size=b).astype(np.int64)]

    def ref(x: np.ndarray, labels: np.ndarray) -> List[np.ndarray]:
        m = x.max(axis=1, keepdims=True)
        logp = x - (np.log(np.exp(x - m).sum(axis=1, keepdims=True)) + m)
        return [np.asarray(-logp[np.arange(len(labels)), labels].mean())]

    def traffic(ins: Sequence[Any], outs: Sequence[Any]) -> int:
        return fams._nbytes(ins[0]) + fams._nbytes(ins[1]) + sum(fams._nbytes(o) for o in outs)
    return Family("cross_entropy_gather", sizes, fd, make, ref, kernels=fams._total_kernels(b), rtol=1e-5,
                  atol=1e-4, min_bytes=traffic)


def sbert_mean_pooling(sizes: Sizes) -> Family:
    """sentence-transformers' mean pooling as its code writes it: the attention mask [B, S]
    (int64 0/1) expanded to the hidden states' [B, S, H] and cast to float,
    ``sum(x * mask, 1) / clamp(mask.sum(1), min=1e-9)``; output the [B, H] sentence embedding."""
    with FusionDefinition() as fd:
        x = fams._tensor(fd, 3)
        mask = fams._tensor(fd, 2, DataType.Int)
        m = fams._bcast(fd, fd.ops.cast(mask, DataType.Float), 3, [0, 1])
        num = fd.ops.sum(fd.ops.mul(x, m), dims=[1])
        fd.add_output(fd.ops.div(num, fd.ops.clamp(fd.ops.sum(m, dims=[1]), min=1e-9)))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        b, s, h = sizes
        rng = fams._rng("sbert_mean_pooling", sizes, seed)
        x = fams._randn(rng, (b, s, h))
        if isinstance(rng, fams.ShapesOnly):
            return [x, np.zeros((b, s), np.int64)]
        lengths = rng.integers(1, s + 1, size=b)
        return [x, (np.arange(s)[None, :] < lengths[:, None]).astype(np.int64)]

    def ref(x: np.ndarray, mask: np.ndarray) -> List[np.ndarray]:
        m = mask[:, :, None]
        return [(x * m).sum(1) / np.maximum(np.broadcast_to(m, x.shape).sum(1), 1e-9)]
    return Family("sbert_mean_pooling", sizes, fd, make, ref, rtol=1e-5, atol=1e-6)


def hf_causal_lm_loss(sizes: Sizes) -> Family:
    """HF's ``ForCausalLMLoss``: logits [B, S, V] float shifted against labels [B, S] int64
    (``logits[:, :-1]`` against ``labels[:, 1:]``), cross-entropy with ignore_index -100 (the
    label's logit picked with ``take_along_axis``), the mean over the counted tokens; output
    the 0-d loss."""
    b, s, _ = sizes
    with FusionDefinition() as fd:
        x = fams._tensor(fd, 3)
        labels = fams._tensor(fd, 2, DataType.Int)
        lg = fd.ops.slice(x, [0, 0, 0], [None, fd.ops.sub(fd.ops.size(x, 1), 1), None])
        lb = fd.ops.slice(labels, [0, 1], [None, None])
        valid = fd.ops.ne(lb, -100)
        idx = fd.ops.broadcast_in_dim(fd.ops.where(valid, lb, 0), [-1, -1, 1], [0, 1])
        picked = fd.ops.squeeze(fd.ops.take_along_axis(lg, idx, 2), [2])
        vf = fd.ops.cast(valid, DataType.Float)
        nll = fd.ops.mul(fd.ops.sub(fd.ops.logsumexp(lg, dims=[2]), picked), vf)
        fd.add_output(fd.ops.div(fd.ops.sum(nll, dims=[0, 1]), fd.ops.sum(vf, dims=[0, 1])))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        b, s, v = sizes
        rng = fams._rng("hf_causal_lm_loss", sizes, seed)
        x = fams._randn(rng, (b, s, v), scale=2.0)
        if isinstance(rng, fams.ShapesOnly):
            return [x, np.zeros((b, s), np.int64)]
        labels = rng.integers(0, v, size=(b, s)).astype(np.int64)
        labels[:, s - s // 8:] = -100  # padding at the end of each sequence
        return [x, labels]

    def ref(x: np.ndarray, labels: np.ndarray) -> List[np.ndarray]:
        lg, lb = x[:, :-1], labels[:, 1:]
        valid = lb != -100
        m = lg.max(axis=2, keepdims=True)
        lse = np.log(np.exp(lg - m).sum(axis=2)) + m[..., 0]
        picked = np.take_along_axis(lg, np.where(valid, lb, 0)[..., None], 2)[..., 0]
        return [np.asarray(((lse - picked) * valid).sum() / valid.sum())]

    def traffic(ins: Sequence[Any], outs: Sequence[Any]) -> int:
        x = ins[0]
        return fams._nbytes(x) * (x.shape[1] - 1) // x.shape[1] + fams._nbytes(ins[1]) + 4
    return Family("hf_causal_lm_loss", sizes, fd, make, ref, kernels=fams._total_kernels(b * (s - 1)),
                  rtol=1e-5, atol=1e-4, min_bytes=traffic)


def layernorm_backward(sizes: Sizes) -> Family:
    """LayerNorm backward (``native_layer_norm_backward``, tests/families.py) with its fewest
    kernels: one can do it (rows in registers for dx, column partials finished by the last
    block), where kiln runs one kernel per class of reductions."""
    return dataclasses.replace(fams.layernorm_backward(sizes), kernels=1)


# ============================================================================ torch peers
# Each takes the kiln inputs (torch CUDA tensors and Python numbers, in the definition's order)
# and returns the model code as a function and its arguments. Hyper-parameters are constants
# of the function, as torch.optim's Python floats are.
Peer = Tuple[Callable[..., Any], List[Any]]


def peer_gelu(ins: Sequence[Any]) -> Peer:
    """HF NewGELUActivation (GPT-2's ``gelu_new``) on the bias-added c_fc output."""
    def gelu_new(x: Any, bias: Any) -> Any:
        h = x + bias
        return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
    return gelu_new, [ins[0], ins[1]]


def peer_swiglu(ins: Sequence[Any]) -> Peer:
    """LlamaMLP between the projections: ``act_fn(gate_proj(x)) * up_proj(x)``."""
    def swiglu(gate: Any, up: Any) -> Any:
        return F.silu(gate) * up
    return swiglu, [ins[0], ins[1]]


def peer_llama_rmsnorm(ins: Sequence[Any]) -> Peer:
    """LlamaRMSNorm.forward."""
    def llama_rms_norm(hidden_states: Any, weight: Any) -> Any:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + fams.RMS_EPS)
        return weight * hidden_states.to(input_dtype)
    return llama_rms_norm, [ins[0], ins[1]]


def peer_logsumexp(ins: Sequence[Any]) -> Peer:
    """``torch.logsumexp`` over the vocabulary."""
    def logsumexp(logits: Any) -> Any:
        return torch.logsumexp(logits, dim=-1)
    return logsumexp, [ins[0]]


def peer_bsh_silu(ins: Sequence[Any]) -> Peer:
    """Bias, [B, S, H] -> [B, H, S] materialized, SiLU."""
    def bsh_to_bhs_silu(x: Any, bias: Any) -> Any:
        return F.silu((x + bias).permute(0, 2, 1).contiguous())
    return bsh_to_bhs_silu, [ins[0], ins[1]]


def peer_bert_residual_layernorm(ins: Sequence[Any]) -> Peer:
    """BertSelfOutput after its dense matmul: the bias, ``LayerNorm(hidden_states +
    input_tensor)``; the residual sum is returned too (kiln outputs it)."""
    def bert_self_output(hidden_states: Any, input_tensor: Any, bias: Any, weight: Any, ln_bias: Any) -> Any:
        hidden_states = hidden_states + bias
        t = hidden_states + input_tensor
        return F.layer_norm(t, (t.shape[-1],), weight, ln_bias, eps=1e-12), t
    return bert_self_output, list(ins)


def peer_prenorm_residual_layernorm(ins: Sequence[Any]) -> Peer:
    """A pre-LN block entry with the residual stream kept in float32 and stored in half:
    ``residual = hidden_states.float() + residual.float()``; the new residual and the
    normalized input of the next sublayer, both half."""
    def add_and_norm(hidden_states: Any, residual: Any, weight: Any, bias: Any) -> Any:
        residual = hidden_states.float() + residual.float()
        normed = F.layer_norm(residual, (residual.shape[-1],), weight.float(), bias.float(), eps=fams.LN_EPS)
        return residual.half(), normed.half()
    return add_and_norm, list(ins)


def peer_gemma_rmsnorm(ins: Sequence[Any]) -> Peer:
    """GemmaRMSNorm.forward."""
    def _norm(x: Any) -> Any:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + fams.RMS_EPS)

    def gemma_rms_norm(x: Any, weight: Any) -> Any:
        output = _norm(x.float())
        output = output * (1.0 + weight.float())
        return output.type_as(x)
    return gemma_rms_norm, [ins[0], ins[1]]


def peer_bert_attention_softmax(ins: Sequence[Any]) -> Peer:
    """BertSelfAttention between the matmuls (eval: no dropout), the extended mask [B, 1, 1, S]."""
    def attention_probs(attention_scores: Any, attention_mask: Any) -> Any:
        attention_scores = attention_scores / math.sqrt(64)
        attention_scores = attention_scores + attention_mask
        return F.softmax(attention_scores, dim=-1)
    scores, mask = ins
    return attention_probs, [scores, mask[:, None, None, :]]


def peer_gpt2_causal_softmax(ins: Sequence[Any]) -> Peer:
    """GPT-2's eager attention between the matmuls, weights upcast to float32: the scale, the
    causal ``where`` with ``finfo.min``, softmax, back to the value dtype (half)."""
    def attn_weights(attn_weights: Any, causal_mask: Any) -> Any:
        attn_weights = attn_weights.float()
        attn_weights = attn_weights / torch.full([], 64**0.5, dtype=attn_weights.dtype,
                                                 device=attn_weights.device)
        mask_value = torch.finfo(attn_weights.dtype).min
        mask_value = torch.full([], mask_value, dtype=attn_weights.dtype, device=attn_weights.device)
        attn_weights = torch.where(causal_mask, attn_weights, mask_value)
        attn_weights = F.softmax(attn_weights, dim=-1)
        return attn_weights.type(torch.float16)
    scores, mask = ins
    return attn_weights, [scores, mask[None, None]]  # the sliced ``bias`` buffer [1, 1, S, S]


def peer_log_softmax(ins: Sequence[Any]) -> Peer:
    """``F.log_softmax`` over the vocabulary."""
    def log_softmax(logits: Any) -> Any:
        return F.log_softmax(logits, dim=-1)
    return log_softmax, [ins[0]]


def peer_cross_entropy(ins: Sequence[Any]) -> Peer:
    """The causal-LM loss: ``F.cross_entropy(logits, labels, ignore_index=-100)`` (the loss only:
    kiln's second output, the per-row logsumexp kept for the backward, is [B])."""
    def loss_fn(logits: Any, labels: Any) -> Any:
        return F.cross_entropy(logits, labels, ignore_index=-100)
    return loss_fn, [ins[0], ins[1]]


def peer_sbert_mean_pooling(ins: Sequence[Any]) -> Peer:
    """sentence_transformers.models.Pooling (mean): the mask expanded, cast, summed and clamped."""
    def mean_pooling(token_embeddings: Any, attention_mask: Any) -> Any:
        input_mask_expanded = attention_mask.unsqueeze(-1).expand(token_embeddings.size()).float()
        sum_embeddings = torch.sum(token_embeddings * input_mask_expanded, 1)
        sum_mask = torch.clamp(input_mask_expanded.sum(1), min=1e-9)
        return sum_embeddings / sum_mask
    return mean_pooling, [ins[0], ins[1]]


def peer_hf_causal_lm_loss(ins: Sequence[Any]) -> Peer:
    """transformers.loss.loss_utils.ForCausalLMLoss: upcast, shift, flatten, cross-entropy."""
    def causal_lm_loss(logits: Any, labels: Any) -> Any:
        logits = logits.float()
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        v = shift_logits.shape[-1]
        return F.cross_entropy(shift_logits.view(-1, v), shift_labels.view(-1), ignore_index=-100)
    return causal_lm_loss, [ins[0], ins[1]]


def peer_batchnorm2d(ins: Sequence[Any]) -> Peer:
    """nn.BatchNorm2d.forward in training: ``F.batch_norm`` updating the running statistics in
    place; returns y and the running statistics."""
    def batch_norm(x: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any) -> Any:
        y = F.batch_norm(x, running_mean, running_var, weight, bias, training=True, momentum=0.1,
                         eps=fams.LN_EPS)
        return y, running_mean, running_var
    return batch_norm, list(ins[:5])


def peer_group_norm(ins: Sequence[Any]) -> Peer:
    """nn.GroupNorm.forward (``F.group_norm``) with the family's group count."""
    groups = 32 if ins[0].shape[1] % 32 == 0 else 4

    def group_norm(x: Any, weight: Any, bias: Any) -> Any:
        return F.group_norm(x, groups, weight, bias, eps=fams.LN_EPS)
    return group_norm, list(ins[:3])


def peer_adamw(ins: Sequence[Any]) -> Peer:
    """``torch.optim.adamw._single_tensor_adamw`` for one parameter at step 10 (in place)."""
    a = fams.ADAM
    lr, beta1, beta2, eps, weight_decay, step = a["lr"], a["beta1"], a["beta2"], a["eps"], a["wd"], a["step"]

    def adamw_step(param: Any, grad: Any, exp_avg: Any, exp_avg_sq: Any) -> Any:
        param.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = math.sqrt(bias_correction2)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)
        return param, exp_avg, exp_avg_sq
    return adamw_step, list(ins[:4])


def peer_sgd(ins: Sequence[Any]) -> Peer:
    """``torch.optim.sgd._single_tensor_sgd`` (momentum, weight decay, dampening 0) on a float
    master parameter whose half gradient is widened first (in place)."""
    weight_decay, momentum, lr = ins[3], ins[4], ins[5]
    dampening = 0.0

    def sgd_step(param: Any, grad: Any, momentum_buffer: Any) -> Any:
        d_p = grad.float()
        d_p = d_p.add(param, alpha=weight_decay)
        momentum_buffer.mul_(momentum).add_(d_p, alpha=1 - dampening)
        param.add_(momentum_buffer, alpha=-lr)
        return param, momentum_buffer
    return sgd_step, list(ins[:3])


def peer_grad_norm_clip(ins: Sequence[Any]) -> Peer:
    """``torch.nn.utils.clip_grad_norm_`` on one gradient (foreach off, in place); returns the
    clipped gradient and the total norm."""
    max_norm = ins[1]

    def clip_grad_norm_(grad: Any) -> Any:
        norms = [torch.linalg.vector_norm(grad, 2.0)]
        total_norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        clip_coef = max_norm / (total_norm + 1e-6)
        clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
        grad.mul_(clip_coef_clamped)
        return grad, total_norm
    return clip_grad_norm_, [ins[0]]


def peer_gpt2_embedding(ins: Sequence[Any]) -> Peer:
    """GPT2Model's embeddings: ``wte(input_ids) + position_embeds`` (the position rows given)."""
    def embed(wte: Any, input_ids: Any, position_embeds: Any) -> Any:
        inputs_embeds = F.embedding(input_ids, wte)
        return inputs_embeds + position_embeds
    return embed, list(ins)


def peer_gpt2_embedding_batched(ins: Sequence[Any]) -> Peer:
    """GPT2Model's embeddings of a [B, S] batch: ``wte(input_ids) + wpe(position_ids)``."""
    def embed(wte: Any, input_ids: Any, wpe: Any, position_ids: Any) -> Any:
        return F.embedding(input_ids, wte) + F.embedding(position_ids, wpe)
    return embed, list(ins)


def peer_layernorm2d(ins: Sequence[Any]) -> Peer:
    """timm's LayerNorm2d: a LayerNorm over the channels of NCHW through two permutes."""
    def layernorm2d(x: Any, w: Any, b: Any) -> Any:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, (x.shape[-1],), w, b, 1e-6)
        return x.permute(0, 3, 1, 2)
    return layernorm2d, list(ins)


def peer_megatron(ins: Sequence[Any]) -> Peer:
    """Megatron's bias-dropout-add (inference, no dropout) with the [S, B, H] sublayer output
    brought to the batch-first residual: ``residual + (x.transpose(0, 1) + bias)``."""
    def bias_add_residual(x: Any, bias: Any, residual: Any) -> Any:
        out = x.transpose(0, 1) + bias
        return residual + out
    return bias_add_residual, list(ins)


def peer_relu_backward(ins: Sequence[Any]) -> Peer:
    """ReLU backward and the bias gradient."""
    def relu_bwd(dy: Any, y: Any) -> Any:
        dx = dy * (y > 0)
        return dx, dx.sum(0)
    return relu_bwd, list(ins)


def peer_layernorm_backward(ins: Sequence[Any]) -> Peer:
    """What ``loss.backward()`` runs for ``F.layer_norm``: ATen's ``native_layer_norm_backward``
    (mean and rstd [M, 1] as the forward saved them; the bias only gives db its shape)."""
    def layer_norm_backward(grad_out: Any, x: Any, mean: Any, rstd: Any, weight: Any, bias: Any) -> Any:
        return torch.ops.aten.native_layer_norm_backward(grad_out, x, [x.shape[-1]], mean, rstd, weight,
                                                         bias, [True, True, True])
    dy, x, mean, rstd, w = ins
    return layer_norm_backward, [dy, x, mean[:, None], rstd[:, None], w, torch.zeros_like(w)]


def peer_llama_rope(ins: Sequence[Any]) -> Peer:
    """LlamaAttention's query: ``q_proj(x).view(B, S, H, D).transpose(1, 2)`` then
    ``apply_rotary_pos_emb``. As in HF the result is a strided [B, H, S, D] view of a
    [B, S, H, D]-ordered tensor; so is kiln's (``families.llama_rope_view``: the output stored
    with ``stride_order``)."""
    def rotate_half(x: Any) -> Any:
        x1 = x[..., : x.shape[-1] // 2]
        x2 = x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    def rope_q(hidden: Any, cos: Any, sin: Any) -> Any:
        b, s = hidden.shape[:2]
        q = hidden.view(b, s, -1, cos.shape[-1]).transpose(1, 2)
        cos = cos[None].unsqueeze(1)  # [1, S, D] from the rotary embedding, unsqueeze_dim=1
        sin = sin[None].unsqueeze(1)
        return (q * cos) + (rotate_half(q) * sin)
    return rope_q, list(ins)


# ============================================================================ GPU input fix-ups
# The families' own integer and boolean inputs are kept; every float input is torch.randn.
# These fill in what random normals would get wrong or unrealistic.
def fix_padding_mask(ins: List[Any], gen: Any) -> None:
    """BERT's additive mask ``(1 - attention_mask) * -10000`` from random sequence lengths."""
    mask = ins[1]
    b, s = mask.shape
    lengths = torch.randint(1, s + 1, (b,), device=DEVICE, generator=gen)
    keep = torch.arange(s, device=DEVICE)[None, :] < lengths[:, None]
    mask.copy_((1.0 - keep.float()) * -10000.0)


def fix_attention_mask(ins: List[Any], gen: Any) -> None:
    """A 0/1 attention mask [B, S] from random sequence lengths."""
    mask = ins[1]
    b, s = mask.shape
    lengths = torch.randint(1, s + 1, (b,), device=DEVICE, generator=gen)
    mask.copy_((torch.arange(s, device=DEVICE)[None, :] < lengths[:, None]).to(mask.dtype))


def fix_lm_labels(ins: List[Any], gen: Any) -> None:
    """Random labels [B, S] over the vocabulary, the last eighth of each sequence -100."""
    logits, labels = ins[0], ins[1]
    s = labels.shape[1]
    labels.copy_(torch.randint(0, logits.shape[-1], labels.shape, device=DEVICE, generator=gen))
    labels[:, s - s // 8:] = -100


def fix_labels(ins: List[Any], gen: Any) -> None:
    """Random labels where the family's are not -100."""
    logits, labels = ins[0], ins[1]
    rand = torch.randint(0, logits.shape[1], labels.shape, device=DEVICE, generator=gen)
    labels.copy_(torch.where(labels == -100, labels, rand))


def fix_batchnorm(ins: List[Any], gen: Any) -> None:
    """A positive running variance."""
    ins[4].uniform_(0.5, 1.5, generator=gen)


def fix_adamw(ins: List[Any], gen: Any) -> None:
    """Gradients ~ 0.1, first moments ~ 0.01, second moments their non-negative squares."""
    ins[1].mul_(0.1)
    ins[2].mul_(0.01)
    ins[3].mul_(0.01).square_()


def fix_grad_norm_clip(ins: List[Any], gen: Any) -> None:
    """``max_norm`` at half the gradient's norm, so that the clip is active."""
    ins[1] = 0.5 * float(torch.linalg.vector_norm(ins[0].double()))


def fix_token_ids(ins: List[Any], gen: Any) -> None:
    """Random token ids over the whole table."""
    ins[1].copy_(torch.randint(0, ins[0].shape[0], ins[1].shape, device=DEVICE, generator=gen))


def fix_layernorm_stats(ins: List[Any], gen: Any) -> None:
    """The mean and rstd that the forward saved for x."""
    x = ins[1]
    var, mean = torch.var_mean(x, dim=1, correction=0)
    ins[2].copy_(mean)
    ins[3].copy_(torch.rsqrt(var + fams.LN_EPS))


# ============================================================================ the workloads
@dataclass(frozen=True)
class Workload:
    """One model fusion: its kiln family, its sizes and its torch peer."""

    name: str
    model: str  # where it comes from
    build: Callable[[Sizes], Family]
    sizes: Sizes  # the issue's size
    quick: Sizes  # --quick
    small: Sizes  # --cpu-check
    peer: Callable[[Sequence[Any]], Peer]
    outputs: Optional[Tuple[int, ...]] = None  # kiln outputs the peer returns, in its order (None: all)
    mutates: Tuple[int, ...] = ()  # peer arguments the peer updates in place
    fix: Optional[Callable[[List[Any], Any], None]] = None  # GPU input fix-ups
    f32_twin: Optional[Callable[[Sizes], Family]] = None  # the bf16 math with float32 I/O (--cpu-check)

    @property
    def family(self) -> str:
        """The builder's name, marked when it is one of tests/families.py."""
        name = getattr(self.build, "__name__", str(self.build))
        return f"families.{name}" if getattr(fams, name, None) is self.build else name


ROPE_BENCH = fams.spec("llama_rope").bench

WORKLOADS: List[Workload] = [
    Workload("gpt2_gelu_8192", "GPT-2 MLP (c_fc 8192)", gpt2_gelu_pow, (16384, 8192), (4096, 8192),
             (37, 129), peer_gelu),
    Workload("gpt2_gelu_3072", "GPT-2 MLP (c_fc 3072)", gpt2_gelu_pow, (16384, 3072), (4096, 3072),
             (5, 1031), peer_gelu),
    Workload("llama_swiglu_bf16", "LLaMA MLP", llama_swiglu, (16384, 11008), (4096, 11008), (37, 129),
             peer_swiglu, f32_twin=functools.partial(llama_swiglu, f32_io=True)),
    Workload("llama_rmsnorm_bf16", "LLaMA RMSNorm", llama_rmsnorm_bf16, (16384, 4096), (4096, 4096),
             (13, 97), peer_llama_rmsnorm, f32_twin=functools.partial(llama_rmsnorm_bf16, f32_io=True)),
    Workload("logsumexp_32000", "LM head logsumexp", fams.logsumexp, (16384, 32000), (4096, 32000),
             (17, 1031), peer_logsumexp),
    Workload("bsh_to_bhs_silu", "[B,S,H] -> [B,H,S] + SiLU", fams.bsh_to_bhs_silu, (16, 4096, 4096),
             (4, 4096, 4096), (2, 33, 65), peer_bsh_silu),
    Workload("bert_residual_layernorm", "BERT self-output", fams.bert_residual_layernorm, (16384, 1024),
             (4096, 1024), (13, 97), peer_bert_residual_layernorm),
    Workload("prenorm_residual_layernorm_half", "pre-LN block entry", fams.prenorm_residual_layernorm_half,
             (16384, 4096), (4096, 4096), (13, 97), peer_prenorm_residual_layernorm),
    Workload("gemma_rmsnorm_bf16", "Gemma RMSNorm", fams.rmsnorm_gemma_bf16, (16384, 3072), (4096, 3072),
             (13, 97), peer_gemma_rmsnorm),
    Workload("bert_attention_softmax", "BERT attention probs", fams.attention_softmax_padding_mask,
             (32, 16, 512), (8, 16, 512), (2, 3, 33), peer_bert_attention_softmax, fix=fix_padding_mask),
    Workload("gpt2_causal_softmax_half", "GPT-2 attention weights", fams.causal_softmax_where_half,
             (8, 16, 1024), (2, 16, 1024), (2, 2, 67), peer_gpt2_causal_softmax),
    Workload("log_softmax_32000", "LM head log-softmax", fams.log_softmax, (16384, 32000), (4096, 32000),
             (17, 1031), peer_log_softmax),
    Workload("log_softmax_128256", "LLaMA-3 log-softmax", fams.log_softmax, (8192, 128256), (2048, 128256),
             (5, 4099), peer_log_softmax),
    Workload("cross_entropy_32000", "LM loss", fams.cross_entropy, (16384, 32000), (4096, 32000),
             (17, 1031), peer_cross_entropy, outputs=(0,), fix=fix_labels),
    Workload("cross_entropy_128256", "LLaMA-3 loss", fams.cross_entropy, (8192, 128256), (2048, 128256),
             (5, 4099), peer_cross_entropy, outputs=(0,), fix=fix_labels),
    Workload("cross_entropy_gather_32000", "LM loss (gather)", cross_entropy_gather, (16384, 32000),
             (4096, 32000), (17, 1031), peer_cross_entropy, fix=fix_labels),
    Workload("cross_entropy_gather_128256", "LLaMA-3 loss (gather)", cross_entropy_gather, (8192, 128256),
             (2048, 128256), (5, 4099), peer_cross_entropy, fix=fix_labels),
    Workload("hf_causal_lm_loss", "HF ForCausalLMLoss", hf_causal_lm_loss, (8, 1024, 32000), (2, 1024, 32000),
             (2, 9, 131), peer_hf_causal_lm_loss, fix=fix_lm_labels),
    Workload("batchnorm2d_train", "ResNet BatchNorm2d", fams.batchnorm_nchw_train, (64, 256, 56, 56),
             (16, 256, 56, 56), (2, 3, 5, 7), peer_batchnorm2d, outputs=(0, 3, 4), mutates=(3, 4),
             fix=fix_batchnorm),
    Workload("group_norm", "SD UNet GroupNorm(32)", fams.group_norm_nchw, (16, 512, 64, 64), (4, 512, 64, 64),
             (2, 64, 3, 5), peer_group_norm),
    Workload("adamw", "AdamW step (64M)", fams.adamw, (16384, 4096), (4096, 4096), (7, 33), peer_adamw,
             mutates=(0, 2, 3), fix=fix_adamw),
    Workload("sgd_momentum", "SGD momentum step (64M)", fams.sgd_momentum_fp16_grad, (16384, 4096),
             (4096, 4096), (7, 33), peer_sgd, mutates=(0, 2)),
    Workload("grad_norm_clip", "clip_grad_norm_ (64M)", fams.grad_norm_clip, (16384, 4096), (4096, 4096),
             (31, 97), peer_grad_norm_clip, mutates=(0,), fix=fix_grad_norm_clip),
    Workload("gpt2_embedding", "GPT-2 embeddings", fams.embedding_plus_positions, (16384, 50257, 768),
             (4096, 50257, 768), (13, 100, 97), peer_gpt2_embedding, fix=fix_token_ids),
    Workload("gpt2_embedding_batched", "GPT-2 embeddings [B, S] (ATen)", fams.gpt2_embedding_batched,
             (16, 1024, 50257, 768), (4, 1024, 50257, 768), (2, 13, 100, 97), peer_gpt2_embedding_batched,
             fix=fix_token_ids),
    Workload("layernorm2d_timm", "ConvNeXt LayerNorm2d", fams.layernorm2d_permuted, (32, 128, 56, 56),
             (8, 128, 56, 56), (2, 8, 5, 7), peer_layernorm2d),
    Workload("megatron_sbh_to_bsh", "Megatron bias-add-residual", fams.megatron_sbh_to_bsh_bias_residual,
             (4096, 8, 4096), (1024, 8, 4096), (33, 3, 65), peer_megatron),
    Workload("relu_backward_bias_grad", "MLP backward", relu_backward_bias_grad, (16384, 4096),
             (4096, 4096), (37, 129), peer_relu_backward),
    Workload("layernorm_backward", "LayerNorm backward", layernorm_backward, (16384, 4096), (4096, 4096),
             (13, 97), peer_layernorm_backward, fix=fix_layernorm_stats),
    Workload("sbert_mean_pooling", "sentence-transformers mean pooling", sbert_mean_pooling, (64, 512, 768),
             (16, 512, 768), (3, 7, 5), peer_sbert_mean_pooling, fix=fix_attention_mask),
    Workload("llama_rope", "LLaMA RoPE (q)", fams.llama_rope_view, ROPE_BENCH, (2, *ROPE_BENCH[1:]),
             (2, 5, 3, 8), peer_llama_rope),
]


# ============================================================================ shared helpers
def error_text(e: BaseException) -> str:
    """``Type: message`` of an exception."""
    return f"{type(e).__name__}: {e}".strip()


def first_line(text: str, width: int = 160) -> str:
    """The first line of ``text``, cut to ``width`` characters."""
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= width else line[: width - 3] + "..."


def fmt(v: Optional[float], spec: str, na: str = "n/a") -> str:
    """``v`` formatted with ``spec``, or ``na``."""
    return na if v is None else format(v, spec)


def has_ml_dtypes() -> bool:
    """Whether NumPy can hold bfloat16 (through ml_dtypes)."""
    try:
        import ml_dtypes  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def bf16_as_f32() -> Iterator[None]:
    """Without ml_dtypes, let the families draw bfloat16 inputs as float32 (for shapes only:
    the GPU path draws every float input in its declared dtype)."""
    if has_ml_dtypes():
        yield
    else:
        with mock.patch.object(fams, "bf16_dtype", lambda: np.float32):
            yield


def render_table(cols: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A text table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    head = " | ".join(c.ljust(wd) for c, wd in zip(cols, widths))
    sep = "-+-".join("-" * wd for wd in widths)
    body = [" | ".join(v.ljust(wd) if i == 0 else v.rjust(wd) for i, (v, wd) in enumerate(zip(row, widths)))
            for row in rows]
    return "\n".join([head, sep, *body])


def select(names: Sequence[str]) -> List[Workload]:
    """The workloads named (comma- or space-separated; all when none); KeyError on an unknown name."""
    wanted = [n for part in names for n in part.split(",") if n]
    known = {w.name for w in WORKLOADS}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise KeyError(f"unknown workloads {unknown}; known: {sorted(known)}")
    return [w for w in WORKLOADS if not wanted or w.name in wanted]


# ============================================================================ --cpu-check
def compare_f64(fam: Family, outs: Sequence[Any], wants: Sequence[np.ndarray]) -> Dict[str, Any]:
    """Worst error of the outputs as a multiple of the family's tolerance (<= 1 passes)."""
    if len(outs) != len(wants):
        return {"check": "MISMATCH", "detail": f"{len(outs)} outputs, expected {len(wants)}", "ratio": None}
    worst = 0.0
    for i, (out, want) in enumerate(zip(outs, wants)):
        got = fams.output_f64(out)
        if got.shape != want.shape:
            return {"check": "MISMATCH", "detail": f"output {i}: shape {got.shape}, expected {want.shape}",
                    "ratio": None}
        rtol, atol = fam.tol(i)
        if got.size:
            with np.errstate(invalid="ignore", divide="ignore"):
                lim = atol + rtol * np.abs(want)
                err = np.abs(got - want)
                ratio = np.where(err == 0, 0.0, err / np.where(lim > 0, lim, np.inf))
                ratio = np.where(np.isnan(got) != np.isnan(want), np.inf, ratio)
            worst = max(worst, float(np.nanmax(ratio)))
    return {"check": "ok" if worst <= 1.0 else "MISMATCH", "detail": f"max error {worst:.3g} x tolerance",
            "ratio": worst}


def cpu_check_one(w: Workload, lowp: bool) -> Dict[str, Any]:
    """Interpret ``w`` at its small size against float64, and lower it at the issue's size."""
    row: Dict[str, Any] = {"name": w.name, "family": w.family, "small": list(w.small), "check": "ERROR",
                           "detail": "", "kernels": None, "min_kernels": None, "note": ""}
    t0 = time.perf_counter()
    build = w.build
    bf16 = "BFloat16" in w.build(w.small).dtypes
    if bf16 and not lowp:
        if w.f32_twin is None:
            row.update(check="skipped", detail="bfloat16 inputs need ml_dtypes (tests/test_families.py)")
            return row
        build, row["note"] = w.f32_twin, "bf16 math, float32 I/O (no ml_dtypes)"
    try:
        fam = build(w.small)
        inputs = fam.inputs(SEED)
        row.update(compare_f64(fam, fam.fd.execute(inputs), fam.expected(inputs)))
    except Exception as e:  # a refusal or a failure is a result: record it and go on
        row.update(check="ERROR", detail=first_line(error_text(e)))
    try:
        big = w.build(w.sizes)
        row["min_kernels"] = big.kernels
        if bf16 and not lowp:
            row["kernels_note"] = "bf16 stand-ins need ml_dtypes"
        else:
            row["kernels"] = len(big.fd.lower(big.stand_ins()).kernels)
    except Exception as e:
        row["kernels_error"] = first_line(error_text(e))
    row["wall_s"] = round(time.perf_counter() - t0, 2)
    return row


def cpu_check(workloads: Sequence[Workload]) -> int:
    """Run every workload in the CPU interpreter; 1 on a mismatch, 2 on an error, else 0."""
    lowp = has_ml_dtypes()
    print(f"kiln CPU interpreter against float64 NumPy, {len(workloads)} workloads"
          + ("" if lowp else " (no ml_dtypes: bf16 definitions checked with float32 I/O)"), flush=True)
    rows = []
    for w in workloads:
        r = cpu_check_one(w, lowp)
        rows.append(r)
        extra = f"  [{r['note']}]" if r["note"] else ""
        kern = r.get("kernels_error") or r.get("kernels_note") or ""
        print(f"{w.name:32s} {r['check']:8s} {r['detail']}{extra}"
              + (f"  kernels: {kern}" if kern else ""), flush=True)
    cols = ["workload", "family", "small sizes", "check", "kernels at issue size", "notes"]
    body = []
    for r, w in zip(rows, workloads):
        kern = "n/a" if r["kernels"] is None else f"{r['kernels']} (min {r['min_kernels']})"
        body.append([r["name"], r["family"], "x".join(map(str, w.small)), r["check"],
                     kern, r["note"] or (r["detail"] if r["check"] != "ok" else "")])
    print()
    print("check: interpreter vs float64 with the family's tolerances; kernels: automatic schedule "
          "lowered at the issue's size on the default target (132 SMs)")
    print(render_table(cols, body))
    bad = [r["name"] for r in rows if r["check"] == "MISMATCH"]
    errs = [r["name"] for r in rows if r["check"] == "ERROR" or "kernels_error" in r]
    counts = {c: sum(r["check"] == c for r in rows) for c in ("ok", "MISMATCH", "ERROR", "skipped")}
    print(f"\n{counts['ok']} passed, {counts['MISMATCH']} failed, {counts['ERROR']} errors, "
          f"{counts['skipped']} skipped")
    if bad:
        print(f"!!!!! KILN RESULT MISMATCH on: {', '.join(bad)} !!!!!")
        return 1
    if errs:
        print(f"kiln raised on: {', '.join(errs)}")
        return 2
    return 0


# ============================================================================ GPU timing
# L2 flush, the per-call event timer and the clock warm-up are benches/gpu_peers.py's, bound
# by ``import_torch`` (gpu_peers needs torch to import; --cpu-check runs without it).
reset_persisting_l2: Any = None
flush_l2: Any = None
time_gpu_us: Any = None
warm_up_clocks: Any = None


def time_host_us(fn: Callable[[], Any], calls: int) -> List[float]:
    """Wall time per call of ``calls`` back-to-back calls with the host in the loop (no sleep
    kernel; L2 flushed once before them), from a synchronized GPU to a synchronized GPU."""
    for _ in range(WARMUP):
        fn()
    flush_l2()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return [(time.perf_counter() - t0) / calls * 1e6]


Timer = Callable[[Callable[[], Any], int], List[float]]  # (fn, calls) -> microseconds


def measure_interleaved(fns: Dict[str, Optional[Callable[[], Any]]], na: Dict[str, str], rounds: int,
                        per_round: int, timer: Optional[Timer] = None) -> Dict[str, Dict[str, Any]]:
    """Median/min of each implementation's times (``timer``, default ``time_gpu_us``) over
    ``rounds`` rounds of ``per_round`` calls (the order rotating every round); one that raises
    (or is None: n/a, reason in ``na``) drops out with its error and the others go on."""
    timer = timer or time_gpu_us
    names = list(fns)
    times: Dict[str, List[float]] = {n: [] for n in names}
    errors: Dict[str, Optional[str]] = {n: None if fns[n] is not None else (na.get(n) or "n/a")
                                        for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[n]
            if fn is None or errors[n] is not None:
                continue
            try:
                times[n].extend(timer(fn, per_round))
            except Exception as e:  # a peer or kiln failing is a result, not the end of the run
                errors[n] = error_text(e)
    out: Dict[str, Dict[str, Any]] = {}
    for n in names:
        t = times[n]
        if errors[n] is not None or not t:
            out[n] = {"median_us": None, "min_us": None, "runs": 0, "times_us": [],
                      "error": errors[n] or "n/a"}
        else:
            out[n] = {"median_us": statistics.median(t), "min_us": min(t), "runs": len(t), "times_us": t,
                      "error": None}
    return out


def copy_bandwidth(runs: int) -> Dict[str, Any]:
    """Device-to-device copy of a 1 GiB fp32 tensor: bytes read + written per second."""
    src = torch.ones(COPY_BYTES // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    res = measure_interleaved({"copy": lambda: dst.copy_(src)}, {}, 1, runs)["copy"]
    res["bytes"] = 2 * COPY_BYTES
    res["gbps"] = gbps(2 * COPY_BYTES, res["median_us"])
    return res


def gbps(bytes_moved: Optional[int], median_us: Optional[float]) -> Optional[float]:
    """Effective GB/s of ``bytes_moved`` in ``median_us`` (None when either is missing)."""
    return None if median_us is None or not bytes_moved else bytes_moved / median_us / 1e3


# ============================================================================ GPU checking
def as_list(out: Any) -> List[Any]:
    """A peer's result as a list of tensors."""
    return list(out) if isinstance(out, (tuple, list)) else [out]


def peer_tol(fam: Family, i: int, dtype: str) -> Tuple[float, float]:
    """(rtol, atol) of kiln output ``i`` against torch eager: twice the family's tolerance
    against float64, relative at least two ulps of ``dtype``."""
    rtol, atol = fam.tol(i)
    return max(2.0 * rtol, REL_FLOOR.get(dtype, 0.0)), 2.0 * atol


def compare(out: Any, ref: Any, rtol: float, atol: float) -> Dict[str, Any]:
    """Check ``out`` against ``ref``: ``{"status": "ok"|"MISMATCH", "detail": ...}`` (NaN fails)."""
    if tuple(out.shape) != tuple(ref.shape):
        return {"status": "MISMATCH", "detail": f"shape {tuple(out.shape)}, expected {tuple(ref.shape)}"}
    if out.dtype != ref.dtype:
        return {"status": "MISMATCH", "detail": f"dtype {out.dtype}, expected {ref.dtype}"}
    o, r = out.double(), ref.double()
    diff = (o - r).abs()
    bad = ~(diff <= atol + rtol * r.abs())
    nbad = int(bad.sum().item())
    max_diff = float(diff.max().item()) if diff.numel() else 0.0
    if nbad:
        return {"status": "MISMATCH",
                "detail": f"{nbad}/{diff.numel()} elements off (max |diff| {max_diff:.3g}, "
                          f"rtol {rtol:g}, atol {atol:g})"}
    return {"status": "ok", "detail": f"max |diff| {max_diff:.3g}"}


def compare_outputs(fam: Family, got: Sequence[Any], refs: Sequence[Any],
                    which: Sequence[int]) -> Dict[str, Any]:
    """Compare ``got`` (outputs ``which`` of the fusion, in the peer's order) with torch eager's."""
    if len(got) != len(refs):
        return {"status": "MISMATCH", "detail": f"{len(got)} outputs, expected {len(refs)}"}
    details = []
    for j, (o, r, k) in enumerate(zip(got, refs, which)):
        rtol, atol = peer_tol(fam, k, str(r.dtype).replace("torch.", ""))
        c = compare(o, r, rtol, atol)
        if c["status"] != "ok":
            return {"status": c["status"], "detail": f"output {j}: {c['detail']}"}
        details.append(c["detail"])
    return {"status": "ok", "detail": "; ".join(details)}


# ============================================================================ GPU workloads
TORCH_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
                "Int": "int64", "Int32": "int32", "Bool": "bool"}


def gpu_inputs(w: Workload, sizes: Sizes, gen: Any) -> Tuple[Family, List[Any]]:
    """The family at ``sizes`` and its inputs on the GPU: torch.randn for float inputs (in the
    declared dtype), the family's own integer and boolean inputs, then ``w.fix``."""
    fam = w.build(sizes)
    with bf16_as_f32():
        host = fam.stand_ins()
    ins: List[Any] = []
    for a, spec in zip(host, fam.fd._core.input_specs()):
        if spec.kind != "tensor":
            ins.append(a)
            continue
        dt = getattr(torch, TORCH_DTYPES[str(spec.dtype)])
        if dt.is_floating_point:
            ins.append(torch.randn(tuple(a.shape), dtype=dt, device=DEVICE, generator=gen))
        else:
            ins.append(torch.from_numpy(np.ascontiguousarray(a).reshape(a.shape)).to(device=DEVICE, dtype=dt))
    del host
    if w.fix is not None:
        w.fix(ins, gen)
    return fam, ins


def error_row(w: Workload, sizes: Sizes, e: BaseException) -> Dict[str, Any]:
    """The result of a workload that could not be run at all."""
    err = error_text(e)
    return {"name": w.name, "model": w.model, "family": w.family, "sizes": list(sizes), "bytes_moved": None,
            "kernels": None, "min_kernels": None, "peers": {}, "best_peer": None,
            "kiln_speedup_vs_best_peer": None, "wall_s": None,
            "kiln": {"check": "ERROR", "check_detail": first_line(err), "error": err, "median_us": None}}


def run_workload(w: Workload, sizes: Sizes, rounds: int, per_round: int, copy_gbps: Optional[float],
                 l2_bytes: Optional[int], gen: Any) -> Dict[str, Any]:
    """Check, time (device and host-inclusive) and count kiln's kernels on one workload."""
    row: Dict[str, Any] = {"name": w.name, "model": w.model, "family": w.family, "sizes": list(sizes),
                           "bytes_moved": None, "kernels": None, "min_kernels": None}
    t0 = time.perf_counter()
    try:
        fam, ins = gpu_inputs(w, sizes, gen)
    except Exception as e:  # nothing to time
        return error_row(w, sizes, e)
    tensors = [a for a in ins if not isinstance(a, (int, float, bool))]
    row["input_shapes"] = [list(t.shape) for t in tensors]
    row["input_dtypes"] = [str(t.dtype).replace("torch.", "") for t in tensors]
    row["min_kernels"] = fam.kernels
    largest = max(t.numel() * t.element_size() for t in tensors)
    if l2_bytes and largest <= l2_bytes:
        print(f"warning: {w.name}: largest input {largest / 2**20:.0f} MiB fits in L2 "
              f"({l2_bytes / 2**20:.0f} MiB)")
    eager_fn, args = w.peer(ins)
    snapshot = {i: args[i].clone() for i in w.mutates}

    def fresh() -> List[Any]:
        """The peer's arguments with fresh copies of the state it updates in place."""
        return [snapshot[i].clone() if i in snapshot else a for i, a in enumerate(args)]

    # The reference: torch eager on the untouched inputs.
    try:
        refs: Optional[List[Any]] = as_list(eager_fn(*fresh()))
        ref_error = ""
    except Exception as e:  # no reference: kiln and compile go unchecked
        refs, ref_error = None, error_text(e)
    which = list(w.outputs) if w.outputs is not None else list(range(len(refs or [])))

    # kiln: kernels, one call checked, the traffic.
    kiln_fn: Optional[Callable[[], Any]] = None
    kl_check, kl_detail = "ERROR", ""
    try:
        row["kernels"] = len(fam.fd.lower(ins).kernels)
    except Exception as e:  # the count is missing; execute says whether kiln runs at all
        row["kernels_error"] = error_text(e)
    try:
        outs = fam.fd.execute(ins)
        row["bytes_moved"] = fam.bytes_moved(ins, outs)
        if refs is None:
            kl_check, kl_detail = "NO REF", f"torch eager raised: {first_line(ref_error)}"
        elif w.outputs is None and len(outs) != len(refs):
            kl_check, kl_detail = "MISMATCH", f"{len(outs)} outputs, eager returns {len(refs)}"
        else:
            c = compare_outputs(fam, [outs[k] for k in which], refs, which)
            kl_check, kl_detail = c["status"], c["detail"]
        del outs
        kiln_fn = functools.partial(fam.fd.execute, ins)
    except Exception as e:  # a kiln failure is a result: record it and go on
        kl_detail = error_text(e)

    # torch.compile: compiled and checked before timing (the state it updates is copied).
    fns: Dict[str, Optional[Callable[[], Any]]] = {
        "kiln": kiln_fn, "eager": None if refs is None else (lambda: eager_fn(*args))}
    na = {"kiln": kl_detail, "eager": ref_error}
    compile_check = "n/a"
    try:
        compiled = torch.compile(eager_fn, dynamic=False)
        cout = as_list(compiled(*fresh()))
        if refs is not None:
            compile_check = compare_outputs(fam, cout, refs, which)["status"]
        del cout
        fns["compile"] = lambda: compiled(*args)
    except Exception as e:  # torch.compile failing is the peer's result
        fns["compile"], na["compile"] = None, error_text(e)
    if row["bytes_moved"] is None and refs is not None and w.outputs is None:
        row["bytes_moved"] = fam.bytes_moved(ins, refs)
    snapshot.clear()
    del refs

    dev = measure_interleaved(fns, na, rounds, per_round)
    host = measure_interleaved(fns, na, rounds, per_round, timer=time_host_us)
    kl = dev.pop("kiln")
    ok_run = kiln_fn is not None and kl["error"] is None
    kl.update(check=kl_check if ok_run else "ERROR",
              check_detail=first_line(kl_detail if kl["error"] is None else kl["error"]))
    peers = dev
    peers["eager"]["check"] = "reference" if ref_error == "" else "ERROR"
    peers["compile"]["check"] = compile_check if peers["compile"]["error"] is None else "ERROR"
    for name, r in (("kiln", kl), *peers.items()):
        r["gbps"] = gbps(row["bytes_moved"], r["median_us"])
        r["fraction_of_copy"] = None if r["gbps"] is None or not copy_gbps else r["gbps"] / copy_gbps
        h = host[name]
        r["host_us"] = h["median_us"]
        r["host_times_us"] = h["times_us"]
        r["host_error"] = h["error"]
    timed = {p: r["median_us"] for p, r in peers.items()
             if r["median_us"] is not None and r.get("check") not in ("MISMATCH", "ERROR")}
    best = min(timed, key=lambda p: timed[p]) if timed else None
    ratio = None if best is None or not kl["median_us"] else timed[best] / kl["median_us"]
    row.update(kiln=kl, peers=peers, best_peer=best, best_peer_us=None if best is None else timed[best],
               kiln_speedup_vs_best_peer=ratio, wall_s=round(time.perf_counter() - t0, 1))
    return row


# ============================================================================ reporting
def import_torch() -> bool:
    """Import torch and torch.nn.functional into this module; False when torch is missing."""
    global torch, F, reset_persisting_l2, flush_l2, time_gpu_us, warm_up_clocks
    try:
        import torch as torch_mod  # noqa: PLC0415
        import torch.nn.functional as functional  # noqa: PLC0415
    except ImportError:
        return False
    torch, F = torch_mod, functional
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_peers  # noqa: PLC0415

    reset_persisting_l2, flush_l2 = gpu_peers.reset_persisting_l2, gpu_peers.flush_l2
    time_gpu_us, warm_up_clocks = gpu_peers.time_gpu_us, gpu_peers.warm_up_clocks
    return True


def environment(args: argparse.Namespace, rounds: int, per_round: int) -> Dict[str, Any]:
    """GPU, library versions and the run's parameters."""
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "compute_capability": f"{props.major}.{props.minor}",
        "gpu_memory_bytes": props.total_memory,
        "l2_cache_bytes": getattr(props, "L2_cache_size", None),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "kiln": getattr(kiln, "__version__", None),
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "time_utc": datetime.now(timezone.utc).isoformat(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "quick": bool(args.quick),
        "timed_runs": rounds * per_round,
        "rounds": rounds,
        "runs_per_round": per_round,
        "host_calls_per_round": per_round,
        "warmup_calls_per_round": WARMUP,
        "clock_warmup_s": CLOCK_WARMUP_S,
        "kiln_l2_evict_last": os.environ.get("KILN_L2_EVICT_LAST", "(unset: on)"),
        "timing": "median of per-call CUDA event pairs, L2 flushed before each call"
                  + (" (evict_last lines reset first)" if reset_persisting_l2() else
                     " (evict_last lines NOT reset: libcuda not loadable)")
                  + ("; host kept ahead with torch.cuda._sleep" if hasattr(torch.cuda, "_sleep") else ""),
        "host_timing": "median over rounds of wall time / calls for back-to-back calls, host in the loop",
    }


def write_png(results: List[Dict[str, Any]], copy_gbps: Optional[float], path: Path) -> str:
    """Effective GB/s per workload (device time above, host-inclusive time below); a message."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return "matplotlib is not importable: skipping the PNG"
    series = ["kiln", *PEERS]
    width = 0.8 / len(series)
    fig, axes = plt.subplots(2, 1, figsize=(16, 10), sharex=True)
    for ax, key, title in ((axes[0], "median_us", "device time (median of CUDA events)"),
                           (axes[1], "host_us", "host-inclusive time (back-to-back calls)")):
        for i, s in enumerate(series):
            vals = []
            for r in results:
                q = r["kiln"] if s == "kiln" else r["peers"].get(s, {})
                vals.append(gbps(r.get("bytes_moved"), q.get(key)) or 0.0)
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(results))]
            ax.bar(xs, vals, width, label=s)
        if copy_gbps:
            ax.axhline(copy_gbps, linestyle="--", color="black", label=f"D2D copy {copy_gbps:.0f} GB/s")
        ax.set_ylabel("effective GB/s")
        ax.set_title(f"kiln vs torch on model fusions: {title} (missing bar: error or n/a)")
        ax.legend()
    axes[1].set_xticks(range(len(results)))
    axes[1].set_xticklabels([r["name"] for r in results], rotation=40, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def table(results: List[Dict[str, Any]]) -> str:
    """The summary table, one row per workload."""
    cols = ["workload", "kernels", "kiln µs", "eager µs", "compile µs", "kiln GB/s", "% of copy",
            "kiln / best peer", "kiln host µs", "compile host µs", "check"]
    rows = []
    for r in results:
        kl, p = r["kiln"], r["peers"]
        frac, ratio = kl.get("fraction_of_copy"), r["kiln_speedup_vs_best_peer"]
        kern = "n/a" if r["kernels"] is None else f"{r['kernels']}/{r['min_kernels']}"
        rows.append([
            r["name"],
            kern,
            fmt(kl["median_us"], ".1f", "ERR" if kl["check"] == "ERROR" else "n/a"),
            fmt(p.get("eager", {}).get("median_us"), ".1f"),
            fmt(p.get("compile", {}).get("median_us"), ".1f"),
            fmt(kl.get("gbps"), ".0f"),
            fmt(None if frac is None else 100.0 * frac, ".1f"),
            "n/a" if ratio is None else f"{ratio:.3f}x ({r['best_peer']})",
            fmt(kl.get("host_us"), ".1f"),
            fmt(p.get("compile", {}).get("host_us"), ".1f"),
            kl["check"] if kl["check"] != "MISMATCH" else "!!! MISMATCH !!!",
        ])
    return render_table(cols, rows)


def progress(r: Dict[str, Any]) -> None:
    """One line per finished workload (errors and failed checks spelled out)."""
    kl = r["kiln"]
    times = "  ".join(f"{p} {fmt(q.get('median_us'), '.1f')}" for p, q in [("kiln", kl), *r["peers"].items()])
    mark = "!!!!! " if kl["check"] == "MISMATCH" else ""
    print(f"{mark}{r['name']:32s} {times}  kernels {r['kernels']}  check {kl['check']} "
          f"({kl.get('check_detail', '')})  [{r.get('wall_s')} s]", flush=True)
    for p, q in r["peers"].items():
        if q.get("error") is not None:
            print(f"    {p}: n/a: {first_line(q['error'])}", flush=True)
        if q.get("check") in ("MISMATCH", "ERROR") and q.get("error") is None:
            print(f"    {p}: its result disagrees with torch eager ({q['check']})", flush=True)


def parse_sizes(text: str) -> Tuple[int, ...]:
    """``32768x768`` as ``(32768, 768)``."""
    try:
        return tuple(int(p) for p in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"sizes look like 32768x768, got {text!r}") from None


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """Command-line options."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"{ROUNDS_QUICK * RUNS_PER_ROUND_QUICK} timed runs at about a quarter of the rows")
    ap.add_argument("--only", nargs="+", default=[], metavar="NAME",
                    help="workloads to run (default: all): " + ", ".join(w.name for w in WORKLOADS))
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default ./{DEFAULT_OUT})")
    ap.add_argument("--sizes", type=parse_sizes, default=None, metavar="AxBx...",
                    help="run the selected workloads at these sizes instead of theirs (e.g. 32768x768)")
    ap.add_argument("--cpu-check", action="store_true",
                    help="no GPU, no torch: run every kiln definition at small sizes in the CPU "
                         "interpreter against float64 NumPy")
    return ap.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """See the module docstring."""
    args = parse_args(argv)
    try:
        workloads = select(args.only)
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return 2
    if args.cpu_check:
        return cpu_check(workloads)
    if not import_torch() or not torch.cuda.is_available():
        print("no CUDA device (or no torch): this benchmark runs on the GPU only; "
              "--cpu-check validates the definitions without one")
        return 2
    quick = (ROUNDS_QUICK, RUNS_PER_ROUND_QUICK)
    rounds, per_round = quick if args.quick else (ROUNDS_FULL, RUNS_PER_ROUND_FULL)
    runs = rounds * per_round
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment(args, rounds, per_round)
    warm_up_clocks(0.1 if args.quick else CLOCK_WARMUP_S)
    copy = copy_bandwidth(runs)
    copy_gbps = copy["gbps"]
    torch.cuda.empty_cache()  # give the copy's 2 GiB back before the workloads allocate
    print(f"device-to-device copy: {fmt(copy_gbps, '.0f')} GB/s ({env['gpu']})", flush=True)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(SEED)
    results = []
    for w in workloads:
        sizes = args.sizes or (w.quick if args.quick else w.sizes)
        print(f"running {w.name} {'x'.join(map(str, sizes))} ...", flush=True)
        try:
            results.append(run_workload(w, sizes, rounds, per_round, copy_gbps, env["l2_cache_bytes"], gen))
        except Exception as e:  # out of memory, say: the other workloads still run
            results.append(error_row(w, sizes, e))
        progress(results[-1])
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    (out_dir / "models.json").write_text(json.dumps(
        {"environment": env, "copy": copy, "workloads": results}, indent=2) + "\n")
    print(f"wrote {out_dir / 'models.json'}")
    print(write_png(results, copy_gbps, out_dir / "models.png"))
    mismatched = [r["name"] for r in results if r["kiln"]["check"] == "MISMATCH"]
    errored = [r["name"] for r in results if r["kiln"]["check"] in ("ERROR", "NO REF")]
    if errored:
        print(f"kiln raised (or torch eager did) on: {', '.join(errored)} (error text in the JSON)")
    if mismatched:
        print(f"!!!!! KILN RESULT MISMATCH on: {', '.join(mismatched)} !!!!!")
    print(f"\ncopy {fmt(copy_gbps, '.0f')} GB/s; kiln / best peer = best peer µs / kiln µs (>= 1.000x: kiln "
          f"as fast or faster); µs: median of {runs} event-timed calls in {rounds} interleaved rounds; "
          f"host µs: back-to-back calls with the host in the loop; kernels: kiln's / fewest possible")
    print(table(results))
    if mismatched:
        return 1
    return 2 if errored else 0


if __name__ == "__main__":
    sys.exit(main())
