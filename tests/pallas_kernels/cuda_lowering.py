"""Helpers for the CUDA cross-lowering tests: export for CUDA on any host, find the Triton calls.

`export_for_cuda(fn, *args)` runs `jax.export.export(fn, platforms=["cuda"])` on abstract
arguments (`jax.ShapeDtypeStruct`s, with shardings on a `cuda_mesh(C)` where the function is
sharded), inside `use_abstract_mesh` of an `AbstractMesh` whose abstract device is an NVIDIA
H200: jax >= 0.11 reads the GPU model for the Triton lowering from that abstract device and,
without one and without a GPU, raises "No supported GPU devices found, please specify an
abstract GPU device"; jax 0.10.2 ignores it (no GPU: compute capability 9.0, the H200's).
The Pallas-Triton lowering emits each kernel as a `stablehlo.custom_call @__gpu$xla.gpu.triton`
whose `mhlo.backend_config` holds the kernel's Triton IR (MLIR bytecode, `ir`), its launch grid
and `num_warps` / `num_stages`. Export refuses custom calls without a stability guarantee, so the
Triton one is allowed explicitly (`TRITON_OK`); nothing here compiles, nothing needs a GPU.
Errors are never caught: a lowering error fails the calling test with jax's message.
"""

from __future__ import annotations

import collections
import dataclasses

from jax import export
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib import triton
from jax._src.lib.mlir import ir

from vertumnus_jax.config import ModelConfig

TRITON_TARGET = "__gpu$xla.gpu.triton"
TRITON_OK = (export.DisabledSafetyCheck.custom_call(TRITON_TARGET),)

# The GPU the tests lower for (compute capability 9.0), and its per-block shared memory limit
# (H100 / H200: 227 KB of the SM's 228 KB are addressable by one thread block).
H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
SMEM_PER_BLOCK = 227 * 1024


def cuda_mesh(c: int = 1, axis: str = "cp") -> AbstractMesh:
    """A C-device `AbstractMesh` of H200s: shard a function on it, export it with `mesh=`."""
    return AbstractMesh((c,), (axis,), abstract_device=H200)


# The supported models. Qwen3-32B is not a named ModelConfig; these are the shapes of
# Qwen/Qwen3-32B's config.json.
MODELS = ("qwen3-0.6b", "qwen3-8b", "qwen3-32b", "qwen3-30b-a3b")
_QWEN3_32B = dict(name="qwen3-32b", vocab_size=151936, hidden_size=5120, num_layers=64,
                  num_q_heads=64, num_kv_heads=8, head_dim=128, intermediate_size=25600,
                  dtype="bfloat16")


def model_config(name: str, **overrides) -> ModelConfig:
    """`ModelConfig.named(name, **overrides)`, plus "qwen3-32b"."""
    if name == "qwen3-32b":
        return ModelConfig(**{**_QWEN3_32B, **overrides})
    return ModelConfig.named(name, **overrides)


@dataclasses.dataclass(frozen=True)
class TritonCall:
    """One Triton kernel call of a lowered module.

    Attributes:
      name: the kernel's name (`pallas_call(name=...)`).
      grid: `(grid_x, grid_y, grid_z)` launch grid.
      num_warps, num_stages: the compiler parameters passed to Triton.
      operand_types: the custom call's operand types as MLIR text (`tensor<1x128x8x128xbf16>`).
      ir: the kernel's Triton IR (`tt` / `scf` / `arith` dialects) as MLIR text.
      dots: `(lhs, rhs, result)` types of every `tt.dot` in the kernel, as MLIR text.
    """

    name: str
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int
    operand_types: tuple[str, ...]
    ir: str
    dots: tuple[tuple[str, str, str], ...]


def export_for_cuda(fn, *args, mesh: AbstractMesh | None = None) -> export.Exported:
    """`jax.export.export(fn, platforms=["cuda"])(*args)` with the Triton custom call allowed,
    under `use_abstract_mesh(mesh)`: the `cuda_mesh` the arguments are sharded on, default a
    one-device `cuda_mesh` (for unsharded functions)."""
    mesh = cuda_mesh(1, "cuda") if mesh is None else mesh
    assert mesh.abstract_device == H200, f"export on a cuda_mesh, got {mesh}"
    with use_abstract_mesh(mesh):
        return export.export(fn, platforms=["cuda"], disabled_checks=TRITON_OK)(*args)


_CONTEXT = []  # one MLIR context for every parsed module, made on first use


def _context() -> ir.Context:
    if not _CONTEXT:
        context = jax_mlir.make_ir_context()  # StableHLO, Shardy, func, ...
        triton.dialect.register_dialect(context)  # and `tt`, to read the kernels
        _CONTEXT.append(context)
    return _CONTEXT[0]


def _walk(op):
    op = op.operation if hasattr(op, "operation") else op
    yield op
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                yield from _walk(child)


def _int(attr) -> int:
    return int(ir.IntegerAttr(attr).value)


def as_module(lowered) -> ir.Module:
    """The StableHLO module of a `jax.export.Exported` or a `jax.stages.Lowered`, parsed once
    (pass the result to the functions below to avoid re-parsing); an `ir.Module` as is."""
    if isinstance(lowered, ir.Module):
        return lowered
    text = (lowered.mlir_module() if isinstance(lowered, export.Exported)
            else lowered.as_text())
    with _context():
        return ir.Module.parse(text)


def op_counts(lowered) -> collections.Counter:
    """How often each operation (e.g. "stablehlo.all_gather") occurs in the StableHLO module
    of `lowered`, nested regions and functions included (not inside Triton kernels)."""
    module = as_module(lowered)
    with _context():
        return collections.Counter(op.name for op in _walk(module.operation))


def _main(module: ir.Module):
    mains = [op for op in _walk(module.operation) if op.name == "func.func"
             and ir.StringAttr(op.attributes["sym_name"]).value == "main"]
    assert len(mains) == 1, f"expected one entry function @main, found {len(mains)}"
    return mains[0]


def donated_arg_types(lowered) -> list[str]:
    """Types of the entry function's arguments marked donated (`tf.aliasing_output` or
    `jax.buffer_donor`), in argument order; [] when no argument has attributes. A donor is not
    checked to fit an output: assert `result_types` too."""
    module = as_module(lowered)
    with _context():
        main = _main(module)
        if "arg_attrs" not in main.attributes:  # no argument attributes: nothing donated
            return []
        attrs = [ir.DictAttr(a) for a in ir.ArrayAttr(main.attributes["arg_attrs"])]
        args = main.regions[0].blocks[0].arguments
        return [str(arg.type) for arg, a in zip(args, attrs)
                if "tf.aliasing_output" in a or "jax.buffer_donor" in a]


def result_types(lowered) -> list[str]:
    """Types of the entry function's results as MLIR text (global shapes), in order."""
    module = as_module(lowered)
    with _context():
        return [str(t) for t in ir.FunctionType(
            ir.TypeAttr(_main(module).attributes["function_type"]).value).results]


def triton_calls(lowered) -> list[TritonCall]:
    """The Triton kernel calls of `lowered` (see `as_module`), each kernel's Triton IR parsed
    back from its bytecode."""
    module = as_module(lowered)
    with _context():
        calls = []
        for op in _walk(module.operation):
            if op.name != "stablehlo.custom_call" or \
                    ir.StringAttr(op.attributes["call_target_name"]).value != TRITON_TARGET:
                continue
            config = ir.DictAttr(op.attributes["mhlo.backend_config"])
            kernel = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
            dots = tuple((str(d.operands[0].type), str(d.operands[1].type), str(d.results[0].type))
                         for d in _walk(kernel.operation) if d.name == "tt.dot")
            calls.append(TritonCall(
                name=ir.StringAttr(config["name"]).value,
                grid=tuple(_int(config[f"grid_{a}"]) for a in "xyz"),
                num_warps=_int(config["num_warps"]),
                num_stages=_int(config["num_stages"]),
                operand_types=tuple(str(x.type) for x in op.operands),
                ir=str(kernel),
                dots=dots))
        return calls


def triton_launches(lowered) -> int:
    """How many Triton kernel launches one run of `lowered`'s @main makes, following
    `func.call`s from @main (a jitted function called once per layer is lowered once and
    called per layer). A call in a loop body counts once."""
    module = as_module(lowered)
    with _context():
        funcs = {ir.StringAttr(op.attributes["sym_name"]).value: op
                 for op in _walk(module.operation) if op.name == "func.func"}

        def launches(func) -> int:
            n = 0
            for op in _walk(func):
                if op.name == "stablehlo.custom_call" and ir.StringAttr(
                        op.attributes["call_target_name"]).value == TRITON_TARGET:
                    n += 1
                elif op.name == "func.call":
                    n += launches(funcs[ir.FlatSymbolRefAttr(op.attributes["callee"]).value])
            return n

        return launches(_main(module))


def smem_bytes(block_q: int, block_k: int, head_dim: int, num_stages: int,
               itemsize: int = 2) -> int:
    """Shared memory the flash kernel's tiles take: the Q tile plus `num_stages` pipelined
    K and V tiles."""
    return (block_q * head_dim + num_stages * 2 * block_k * head_dim) * itemsize


def flash_dots(block_q: int, block_k: int, head_dim: int, dtype: str = "bf16"):
    """The two `tt.dot` signatures of the flash-attention kernel's key loop at these tiles:
    `S = Q K^T` and `O += P V`, inputs in `dtype`, accumulators f32."""
    return {
        (f"tensor<{block_q}x{head_dim}x{dtype}>", f"tensor<{head_dim}x{block_k}x{dtype}>",
         f"tensor<{block_q}x{block_k}xf32>"),
        (f"tensor<{block_q}x{block_k}x{dtype}>", f"tensor<{block_k}x{head_dim}x{dtype}>",
         f"tensor<{block_q}x{head_dim}xf32>"),
    }
