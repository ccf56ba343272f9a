"""Operations XLA runs per call of a compiled program, read from its optimized HLO text."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}
"""Instructions that launch no work of their own."""


@dataclass
class Loop:
    """A ``while`` in the program: its trip count when XLA knows it, and its body's operations."""

    body: str
    trips: int | None
    operations: int
    loops: list[Loop] = field(default_factory=list)


def _computations(text: str) -> dict[str, list[str]]:
    computations = {}
    for block in re.split(r"\n\n+", text):
        lines = block.strip().split("\n")
        head = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)\s", lines[0])
        if head:
            computations[head.group(1) if not lines[0].startswith("ENTRY") else "ENTRY"] = lines[1:]
    return computations


def _opcode(line: str) -> str | None:
    match = re.match(r"\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(.*)$", line)
    if not match:
        return None
    rest = match.group(1)
    if rest.startswith("("):  # a tuple type: skip to its closing parenthesis
        depth, end = 0, 0
        while end == 0 or depth:
            depth += (rest[end] == "(") - (rest[end] == ")")
            end += 1
        rest = rest[end:].lstrip()
    else:
        rest = rest.split(" ", 1)[1] if " " in rest else ""
    opcode = re.match(r"([a-z\-]+)\(", rest)
    return opcode.group(1) if opcode else None


def count_operations(hlo_text: str) -> tuple[int, list[Loop]]:
    """Top-level operations (a fusion counts once) outside loops, and the loops inside.

    Conditionals count the operations of all their branches.
    """
    computations = _computations(hlo_text)

    def count(name: str) -> tuple[int, list[Loop]]:
        operations, loops = 0, []
        for line in computations[name]:
            opcode = _opcode(line)
            if opcode is None or opcode in _FREE:
                continue
            operations += 1
            if opcode == "while":
                body = re.search(r"body=%?([\w.\-]+)", line)
                trips = re.search(r'"n":"(\d+)"', line)
                assert body is not None
                inner, nested = count(body.group(1))
                loops.append(
                    Loop(body.group(1), int(trips.group(1)) if trips else None, inner, nested)
                )
            elif opcode in ("call", "conditional"):
                for callee in re.findall(r"%([\w.\-]+)", line.split("(", 2)[-1]):
                    if callee in computations and callee != name:
                        inner, nested = count(callee)
                        operations, loops = operations + inner, loops + nested
        return operations, loops

    return count("ENTRY")


def operations_per_call(hlo_text: str) -> dict[str, int]:
    """``fixed``: operations per call outside loops whose trip count depends on the data
    (loops of known length unrolled into it); ``per_trip``: per trip of each such loop."""
    operations, loops = count_operations(hlo_text)
    fixed, per_trip = operations, {}
    for loop in loops:
        if loop.trips is None:
            per_trip[loop.body] = loop.operations
        else:
            fixed += loop.trips * loop.operations
    return {"fixed": fixed, **{f"per_trip_{i}": n for i, n in enumerate(per_trip.values())}}
