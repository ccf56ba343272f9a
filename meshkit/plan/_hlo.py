"""What a compiled program does per step, read from its optimized HLO text.

XLA's own ``cost_analysis()`` counts the body of a ``while`` loop once, whatever its
trip count, so a model whose layers run under ``nn.scan`` would look one layer deep
(XLA:CPU's and the TPU compiler's alike).
This module reads the program itself: its computations, how often each one runs
(loop trip counts multiply), the FLOPs of its matrix products and convolutions, and
every collective with its replica groups.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Sequence

import numpy as np

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
    "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_CALLEES = re.compile(
    r"\b(calls|body|condition|to_apply|branch_computations|called_computations)="
    r"(\{[^}]*\}|%[\w.\-]+)"
)

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
"""The collective operations counted, by their HLO names."""


def array_bytes(shape_text: str) -> int:
    """Bytes of the arrays in an HLO shape (``f32[8,16]{1,0}``, or a tuple of them)."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return int(total)


def _dims(shape_text: str) -> list[int]:
    match = _ARRAY.search(shape_text)
    return [int(d) for d in match.group(2).split(",") if d] if match else []


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: its name, result shape text, opcode and the rest of its line."""

    name: str
    shape: str
    opcode: str
    rest: str


def _split_shape(text: str) -> tuple[str, str]:
    """``'f32[2]{0} add(%a, %b), ...'`` -> (``'f32[2]{0}'``, ``'add(%a, %b), ...'``)."""
    if text.startswith("("):  # a tuple shape: up to its closing parenthesis
        depth = 0
        for end, char in enumerate(text):
            depth += (char == "(") - (char == ")")
            if depth == 0:
                return text[: end + 1], text[end + 1 :].lstrip()
    shape, _, rest = text.partition(" ")
    return shape, rest


def _instructions(lines: Sequence[str]) -> Iterator[Instruction]:
    """The instructions of a computation, its ROOT last."""
    root = None
    for line in lines:
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        shape, rest = _split_shape(match.group(2))
        opcode = re.match(r"([a-z][\w\-]*)\(", rest)
        if opcode:
            instruction = Instruction(match.group(1), shape, opcode.group(1), rest)
            if line.lstrip().startswith("ROOT"):
                root = instruction
            else:
                yield instruction
    if root is not None:
        yield root


def _operands(instruction: Instruction) -> list[str]:
    return re.findall(r"%([\w.\-]+)", instruction.rest.split(")", 1)[0])


def _scattered_bytes(
    instruction: Instruction, users: dict[str, list[Instruction]], group_size: int
) -> int:
    """Bytes of an all-reduce's result of which every user keeps at most a 1/n slice.

    XLA:CPU writes a reduce-scatter as an all-reduce whose users each read one slice
    (a dynamic slice, often fused into the optimizer update); GPU and TPU compilers
    turn that pair into one reduce-scatter, which moves half the bytes. The elements
    of a combined (tuple) all-reduce are judged one by one, through their
    ``get-tuple-element`` users.
    """
    arrays = [f"{dtype}[{dims}]" for dtype, dims in _ARRAY.findall(instruction.shape)]
    if len(arrays) == 1:
        element_users = {0: users.get(instruction.name, [])}
    else:
        element_users = {}
        for user in users.get(instruction.name, []):
            index = re.search(r"index=(\d+)", user.rest)
            if user.opcode == "get-tuple-element" and index:
                element_users.setdefault(int(index.group(1)), []).extend(users.get(user.name, []))
    scattered = 0
    for index, found in element_users.items():
        size = array_bytes(arrays[index])
        if found and all(array_bytes(user.shape) * group_size <= size * 1.01 for user in found):
            scattered += size
    return scattered


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the program, as it runs in one step.

    Attributes:
      kind: ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all`` or
        ``collective-permute``.
      payload_bytes: the data the collective is about, per device: the full array an
        all-gather produces, the full array a reduce-scatter reduces, the array an
        all-reduce, all-to-all or permute takes.
      group_size: devices per replica group.
      across_slices: whether a group spans more than one slice (the slower network).
      count: how many times it runs per step (loop trip counts multiplied in).
      name: the instruction's name in the HLO, to find it there.
    """

    kind: str
    payload_bytes: int
    group_size: int
    across_slices: bool
    count: int
    name: str

    @property
    def traffic_bytes(self) -> float:
        """Bytes each device sends per run with a ring algorithm (bandwidth-optimal)."""
        n = self.group_size
        if n <= 1:
            return 0.0
        if self.kind == "all-reduce":
            return 2 * self.payload_bytes * (n - 1) / n
        if self.kind == "collective-permute":
            return float(self.payload_bytes)
        return self.payload_bytes * (n - 1) / n


@dataclasses.dataclass(frozen=True)
class ProgramCounts:
    """Per-step totals of a compiled program, loops unrolled by their trip counts.

    Attributes:
      dot_flops: FLOPs of every ``dot`` and ``convolution``, each counted as often as it runs.
      dot_flops_once: the same with every loop body counted once, as XLA's
        ``cost_analysis()`` counts it.
      kernel_flops: FLOPs of the attention kernels' custom calls (``ATTENTION_KERNELS``),
        each counted as often as it runs; XLA's ``cost_analysis()`` leaves them out.
      dot_bytes: bytes the products and convolutions read and write (operands and
        results), as often as they run: the memory traffic a compiler that fuses all
        elementwise work into them cannot avoid.
      collectives: every collective instruction, with how often it runs.
    """

    dot_flops: float
    dot_flops_once: float
    kernel_flops: float
    dot_bytes: float
    collectives: tuple[Collective, ...]


def _computations(text: str) -> tuple[dict[str, list[Instruction]], str]:
    computations: dict[str, list[Instruction]] = {}
    entry, name, lines = "", None, []
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            name, lines = header.group(2), []
            entry = name if header.group(1) else entry
        elif line.startswith("}") and name is not None:
            computations[name] = list(_instructions(lines))
            name = None
        elif name is not None:
            lines.append(line)
    return computations, entry


def _callees(instruction: Instruction) -> list[tuple[str, str]]:
    calls = []
    for attribute, value in _CALLEES.findall(instruction.rest):
        for callee in re.findall(r"%([\w.\-]+)", value):
            calls.append((attribute, callee))
    return calls


def _trip_count(instruction: Instruction, computations: dict[str, list[Instruction]]) -> int:
    """A ``while`` loop's trip count: XLA's ``known_trip_count`` annotation (XLA:CPU and
    XLA:GPU write it), else the bound of its condition (the TPU compiler writes none).
    Loops without either count once."""
    match = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', instruction.rest)
    if match:
        return int(match.group(1))
    condition = dict(_callees(instruction)).get("condition")
    bound = _condition_bound(computations.get(condition or "", []), computations)
    return bound if bound is not None else 1


def _condition_bound(
    condition: list[Instruction], computations: dict[str, list[Instruction]]
) -> int | None:
    """``n`` in a loop condition ``ROOT compare(counter, constant(n)), direction=LT``
    (or a fusion wrapping that compare, as XLA:CPU writes it): the trip count of a loop
    whose counter starts at 0 and steps by 1, as every ``lax.scan`` and ``fori_loop``
    from 0 (and so ``nn.scan``) does."""
    if not condition:
        return None
    root = condition[-1]
    compare = root
    if root.opcode == "fusion":  # the compare inside, on the fusion's operands in order
        called = dict(_callees(root)).get("calls")
        inner = computations.get(called or "", [])
        compare = inner[-1] if inner else root
        if compare.opcode != "compare" or not _on_parameters(compare, inner):
            return None
    if compare.opcode != "compare" or "direction=LT" not in compare.rest:
        return None
    constants = {
        i.name: i.rest for i in condition if i.opcode == "constant" and i.shape.startswith("s32")
    }
    operands = _operands(root)
    if len(operands) != 2 or operands[1] not in constants:
        return None
    value = re.match(r"constant\((-?\d+)\)", constants[operands[1]])
    return int(value.group(1)) if value and int(value.group(1)) > 0 else None


def _on_parameters(compare: Instruction, computation: list[Instruction]) -> bool:
    """Whether ``compare`` takes its computation's parameters 0 and 1, in that order."""
    number = {
        i.name: re.match(r"parameter\((\d+)\)", i.rest)
        for i in computation
        if i.opcode == "parameter"
    }
    order = [number[name] for name in _operands(compare) if name in number]
    return [int(m.group(1)) for m in order if m] == [0, 1]


def _run_counts(
    computations: dict[str, list[Instruction]], entry: str, *, with_trips: bool
) -> dict[str, int]:
    """How many times each computation runs per call of ``entry``."""
    counts: dict[str, int] = {}

    def visit(name: str, times: int) -> None:
        counts[name] = counts.get(name, 0) + times
        for instruction in computations.get(name, ()):
            looped = instruction.opcode == "while" and with_trips
            trips = _trip_count(instruction, computations) if looped else 1
            for attribute, callee in _callees(instruction):
                if attribute == "to_apply" and instruction.opcode != "call":
                    continue  # a reduction's scalar function, not a computation run per step
                visit(callee, times * (trips if attribute in ("body", "condition") else 1))

    visit(entry, 1)
    return counts


def _from_the_model(instruction: Instruction) -> bool:
    """Whether a product or convolution is the program's own work. The TPU compiler
    writes products as convolutions, and also some data movement (a broadcast or a
    dynamic update, as a dilated convolution): a ``convolution`` counts when its source
    (``op_name``) was a product or a convolution. Instructions without metadata count."""
    if instruction.opcode != "convolution":
        return True
    source = re.search(r'op_name="([^"]*)"', instruction.rest)
    if source is None:
        return True
    operation = source.group(1).rsplit("/", 1)[-1]
    return any(kind in operation for kind in ("dot", "conv", "einsum", "matmul"))


ATTENTION_KERNELS = {"flash_attention": 2, "flash_mha_bwd_dkv": 2, "flash_mha_bwd_dq": 2}
"""The Pallas flash attention kernels of JAX's TPU library, by the name each gives its
custom call, and the ``[batch, heads, length, head_dim]`` products each stands for.

XLA's cost analysis cannot see into a custom call, so the planner counts these from
their operands' shapes, as XLA's own attention would run them: the forward kernel
``q k^T`` and ``p v``, the two backward kernels the four products of the gradient
(``dp``, ``dq``; ``dk``, ``dv``). That is the convention of the model FLOPs and of the
published runs the compute efficiency is calibrated on; the kernels' own recomputation
of ``q k^T`` in the backward pass, and the blocks a causal kernel skips, are left out
of the count like that.
"""


def _kernel_flops(instruction: Instruction, shapes: dict[str, str]) -> float:
    """FLOPs of an attention kernel's custom call (``ATTENTION_KERNELS``), else 0."""
    if instruction.opcode != "custom-call":
        return 0.0
    products = next(
        (n for name, n in ATTENTION_KERNELS.items() if instruction.name.startswith(name)), 0
    )
    operands = _operands(instruction)
    if not products or len(operands) < 2:
        return 0.0
    q, k = _dims(shapes.get(operands[0], "")), _dims(shapes.get(operands[1], ""))
    if len(q) != 4 or len(k) != 4:
        return 0.0
    return products * 2.0 * math.prod(q) * k[2]


def _dot_flops(instruction: Instruction, shapes: dict[str, str]) -> float:
    operands = _operands(instruction)
    if len(operands) < 2:
        return 0.0
    out = math.prod(_dims(instruction.shape))
    lhs, rhs = _dims(shapes.get(operands[0], "")), _dims(shapes.get(operands[1], ""))
    if instruction.opcode == "dot":
        contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", instruction.rest)
        dims = [int(d) for d in contracting.group(1).split(",") if d] if contracting else []
        return 2.0 * out * math.prod(lhs[d] for d in dims if d < len(lhs))
    return _convolution_flops(instruction, lhs, rhs)


def _convolution_flops(instruction: Instruction, lhs: list[int], rhs: list[int]) -> float:
    """2 x output batch x output features x input features per group x the (output
    position, kernel tap) pairs that land on a real input element, per spatial dimension.

    Taps on padding or on the holes of a dilated input multiply zeros and are not
    counted: the TPU compiler writes batched products (attention's) as convolutions
    whose batch and head dimensions are dilated spatial windows hitting one element
    each, which a count of every tap would put 24x too high.
    """
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", instruction.rest)
    out = _dims(instruction.shape)
    if not labels or not rhs or not lhs:
        return 0.0
    lhs_labels, rhs_labels, out_labels = labels.groups()
    if not {"o", "i"} <= set(rhs_labels) or "b" not in out_labels:
        return 0.0
    window = _window(instruction.rest)
    pairs = 1
    for k, label in enumerate(sorted(c for c in out_labels if c.isdigit())):
        lo = window["pad"][k][0] if "pad" in window else 0
        pairs *= _valid_taps(
            size=lhs[lhs_labels.index(label)],
            window=rhs[rhs_labels.index(label)],
            outputs=out[out_labels.index(label)],
            stride=window["stride"][k][0] if "stride" in window else 1,
            low_padding=lo,
            lhs_dilation=window["lhs_dilate"][k][0] if "lhs_dilate" in window else 1,
            rhs_dilation=window["rhs_dilate"][k][0] if "rhs_dilate" in window else 1,
        )
    batch = out[out_labels.index("b")]
    return 2.0 * batch * rhs[rhs_labels.index("o")] * rhs[rhs_labels.index("i")] * pairs


def _window(rest: str) -> dict[str, list[list[int]]]:
    """``window={size=2x12 stride=1x11 pad=1_1x11_11}`` -> ``{"stride": [[1], [11]],
    "pad": [[1, 1], [11, 11]], ...}``, one entry per spatial dimension."""
    match = re.search(r"window=\{([^}]*)\}", rest)
    if not match:
        return {}
    fields = {}
    for item in match.group(1).split():
        key, _, value = item.partition("=")
        fields[key] = [[int(n) for n in part.split("_")] for part in value.split("x")]
    return fields


def _valid_taps(
    *,
    size: int,
    window: int,
    outputs: int,
    stride: int,
    low_padding: int,
    lhs_dilation: int,
    rhs_dilation: int,
) -> int:
    """(output position, tap) pairs of one spatial dimension that read a real input."""
    x = (
        np.arange(outputs)[:, None] * stride
        + np.arange(window)[None, :] * rhs_dilation
        - low_padding
    )
    dilated = (size - 1) * lhs_dilation + 1
    return int(np.count_nonzero((x >= 0) & (x < dilated) & (x % lhs_dilation == 0)))


def _groups(instruction: Instruction, num_devices: int) -> list[list[int]]:
    """The replica groups of a collective, as lists of device ids."""
    rest = instruction.rest
    if instruction.opcode.startswith("collective-permute"):
        pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", rest)
        found = re.findall(r"\{(\d+),(\d+)\}", pairs.group(0)) if pairs else []
        return [[int(a), int(b)] for a, b in found if a != b]
    mesh = re.search(
        r"replica_groups=mesh\[([^\]]*)\]"
        r"(?:,\s*device_ids=\(\[([0-9,]+)\](?:T\(([0-9,]+)\))?\))?\s*\{([^}]*)\}",
        rest,
    )
    if mesh:
        axes = re.findall(r"'(\w+)'=(\d+)", mesh.group(1))
        names, sizes = [n for n, _ in axes], [int(s) for _, s in axes]
        chosen = [names.index(n) for n in re.findall(r"'(\w+)'", mesh.group(4))]
        ids = np.arange(math.prod(sizes))
        if mesh.group(2):  # the mesh's positions hold these device ids (XLA:GPU writes them)
            ids = ids.reshape([int(d) for d in mesh.group(2).split(",")])
            if mesh.group(3):
                ids = ids.transpose([int(p) for p in mesh.group(3).split(",")])
        ids = ids.reshape(sizes)
        others = [axis for axis in range(len(sizes)) if axis not in chosen]
        size = math.prod(sizes[axis] for axis in chosen)
        return ids.transpose(others + chosen).reshape(-1, size).tolist()
    iota = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", rest)
    if iota:
        shape = [int(d) for d in iota.group(1).split(",")]
        dims = [int(d) for d in iota.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(p) for p in iota.group(3).split(",")])
        return ids.reshape(-1, shape[-1]).tolist()
    explicit = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", rest)
    if explicit and explicit.group(1):
        return [
            [int(d) for d in g.split(",") if d]
            for g in re.findall(r"\{([0-9,]*)\}", explicit.group(1))
        ]
    return [list(range(num_devices))]  # replica_groups={}: every device in one group


def _payload(instruction: Instruction, kind: str, group_size: int) -> int:
    arrays = _ARRAY.findall(instruction.shape)
    if instruction.opcode in ("all-gather-start", "reduce-scatter-start"):
        arrays = arrays[len(arrays) // 2 :]  # ((operands...), (outputs...)): the outputs
    elif instruction.opcode == "collective-permute-start":  # (operand, output, contexts)
        arrays = arrays[1:2]
    size = sum(array_bytes(f"{dtype}[{dims}]") for dtype, dims in arrays)
    scatter = kind == "reduce-scatter" and instruction.opcode.startswith("reduce-scatter")
    return size * group_size if scatter else size


def program_counts(hlo_text: str, slice_of_device: Sequence[int]) -> ProgramCounts:
    """FLOPs of products and every collective of a compiled program's HLO text, per step.

    Args:
      hlo_text: ``compiled.as_text()`` of an SPMD-partitioned program (one device's view).
      slice_of_device: the slice of each device id of the program (its position in the
        device assignment); a group with devices of two slices is ``across_slices``.
    """
    computations, entry = _computations(hlo_text)
    runs = _run_counts(computations, entry, with_trips=True)
    runs_once = _run_counts(computations, entry, with_trips=False)
    flops = flops_once = kernels = traffic = 0.0
    collectives = []
    for name, instructions in computations.items():
        shapes = {instruction.name: instruction.shape for instruction in instructions}
        users: dict[str, list[Instruction]] = {}
        for instruction in instructions:
            for operand in _operands(instruction):
                users.setdefault(operand, []).append(instruction)
        for instruction in instructions:
            kernels += _kernel_flops(instruction, shapes) * runs.get(name, 0)
            if instruction.opcode in ("dot", "convolution") and _from_the_model(instruction):
                cost = _dot_flops(instruction, shapes)
                flops += cost * runs.get(name, 0)
                flops_once += cost * runs_once.get(name, 0)
                touched = array_bytes(instruction.shape) + sum(
                    array_bytes(shapes.get(operand, "")) for operand in _operands(instruction)
                )
                traffic += touched * runs.get(name, 0)
            kind = instruction.opcode.removesuffix("-start")
            if kind in COLLECTIVES and runs.get(name, 0):
                groups = _groups(instruction, len(slice_of_device))
                size = max((len(group) for group in groups), default=1)
                if kind == "collective-permute":
                    size = 2 if groups else 1
                across = any(
                    len({slice_of_device[d] for d in group if d < len(slice_of_device)}) > 1
                    for group in groups
                )
                payload = _payload(instruction, kind, size)
                parts = {kind: payload}
                if kind == "all-reduce" and size > 1:
                    scattered = _scattered_bytes(instruction, users, size)
                    parts = {"reduce-scatter": scattered, "all-reduce": payload - scattered}
                for part, part_bytes in parts.items():
                    if part_bytes or len(parts) == 1:
                        collectives.append(
                            Collective(part, part_bytes, size, across, runs[name], instruction.name)
                        )
    return ProgramCounts(flops, flops_once, kernels, traffic, tuple(collectives))
