"""Every instruction kind is known everywhere a kind must be known.

``fxrt.exec.instructions.KINDS`` is the one list; its docstring names the sites. Each test below
checks one site against it, so adding a kind without its case in one of them fails here."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from fxrt.exec import instructions as ins
from fxrt.exec import native
from fxrt.exec.program import Program, program_to_text
from fxrt.ir.graph import Ref

ROOT = Path(__file__).resolve().parent.parent
NAMES = ins.KIND_NAMES
aten = torch.ops.aten


def test_one_class_per_kind_and_the_shared_fields_in_one_base():
    assert len(set(NAMES)) == len(NAMES) == len(ins.KINDS)
    six = ("node", "target", "args", "kwargs", "outputs", "multi")
    for kind in ins.KINDS:
        if kind is ins.Free:
            continue
        assert issubclass(kind, ins.Step), kind
        assert {f.name for f in dataclasses.fields(kind)} >= set(six)
    step_fields = tuple(f.name for f in dataclasses.fields(ins.Step))
    assert step_fields == six
    # No kind declares the six again: they live in the base only.
    for kind in ins.KINDS:
        own = vars(kind).get("__annotations__", {})
        assert not set(own) & set(six), (kind.KIND, sorted(set(own) & set(six)))


def test_the_compiled_loop_knows_every_kind_in_the_same_order():
    loop = (ROOT / "fxrt/_speedups/loop.h").read_text()
    code = (ROOT / "fxrt/_speedups/code.h").read_text()
    enum = re.search(r"enum Kind : uint8_t \{([^}]*)\}", code)
    assert enum, "Instr::Kind not found in code.h"
    assert tuple(k.strip() for k in enum.group(1).split(",")) == NAMES
    for name in NAMES:
        assert f"case Instr::{name}:" in loop, f"loop.h has no case for {name}"
    pyx = (ROOT / "fxrt/_speedups/_loop.pyx").read_text()
    for name in NAMES:
        assert f"def add_{name.lower()}(" in pyx, f"_loop.pyx has no add_{name.lower()}"


def test_the_binder_has_an_entry_per_kind():
    assert set(native._BIND) == set(NAMES)


def _one_of_each() -> Program:
    a, b = Ref(0), Ref(1)
    code = []
    for kind in ins.KINDS:
        if kind is ins.Free:
            code.append(ins.Free((1,)))
        elif issubclass(kind, ins.Stream):
            code.append(kind(0, aten.add.Tensor, (), {}, (2,), False, 0))
        else:
            code.append(kind(0, aten.add.Tensor, (a, b), {}, (1,), False))
    return Program(
        code=tuple(code),
        n_regs=3,
        inputs=(0,),
        constants=(),
        output=a,
        nodes=(ins.NodeInfo("add", "aten::add.Tensor", None),),
        reg_names=("x", "y", "e"),
        peak_bytes=0,
    )


def test_the_listing_names_every_kind():
    lines = program_to_text(_one_of_each()).splitlines()
    listed = [line.split()[1] for line in lines if re.match(r"\s+\d+\s", line)]
    assert listed == list(NAMES)


def test_the_package_encoding_holds_or_refuses_every_kind():
    from fxrt.deploy.program_data import cpp_runnable, encode_program
    from fxrt.serialize import SerializationError

    for kind in ins.KINDS:
        program = _one_of_each()
        one = next(i for i in program.code if type(i) is kind)
        only = Program(**{**program.__dict__, "code": (one,)})
        if kind is ins.Kernel:
            with pytest.raises(SerializationError, match="C kernel cannot be stored"):
                encode_program(only)
            continue
        if kind is ins.SymStep:
            one = ins.SymStep(0, one.target, one.args, {}, one.outputs, op="add")
            only = Program(**{**program.__dict__, "code": (one,)})
        encoded = encode_program(only)
        assert [c["kind"] for c in encoded["code"]] == [kind.KIND]
        refused = cpp_runnable(encoded)
        assert (refused is not None) == (kind.KIND in ("PYCALL", "STREAM", "RECORD", "WAIT"))


def test_the_cpp_loader_runs_or_refuses_every_stored_kind_by_name():
    model = (ROOT / "csrc/src/program.cpp").read_text()
    for name in NAMES:
        if name == "KERNEL":  # never stored: the encoding refuses it (above)
            continue
        assert f'kind == "{name}"' in model, f"csrc/src/program.cpp does not handle {name}"
