"""Public API: backend registration, options, get_compiler with AOTAutograd, errors."""

from __future__ import annotations

import pytest
import torch
from conftest import compile_and_run, skip_unless_executor
from torch.fx.experimental.proxy_tensor import make_fx

import fxrt


def test_backend_is_registered_by_entry_point():
    assert "fxrt" in torch._dynamo.list_backends()
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("fxrt") is fxrt.backend


def test_backend_callable_is_accepted_directly():
    torch._dynamo.reset()
    f = torch.compile(lambda x: x.cos() + 1, backend=fxrt.backend)
    x = torch.randn(5)
    torch.testing.assert_close(f(x), x.cos() + 1)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune"])
def test_modes_are_accepted(mode):
    torch._dynamo.reset()
    f = torch.compile(lambda x: x * 2, backend="fxrt", mode=mode)
    torch.testing.assert_close(f(torch.ones(3)), torch.full((3,), 2.0))


def test_unknown_option_lists_valid_keys():
    torch._dynamo.reset()
    f = torch.compile(lambda x: x * 2, backend="fxrt", options={"no_such_knob": 1})
    with pytest.raises(
        Exception,
        match=r"unknown option\(s\) 'no_such_knob'; valid options: .*"
        r"pure_python",
    ):
        f(torch.ones(3))


def test_option_type_is_checked():
    with pytest.raises(ValueError, match="'pure_python' must be a bool"):
        fxrt.CompilerConfig.from_options(None, {"pure_python": "yes"})


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="unknown mode 'fastest'"):
        fxrt.CompilerConfig.from_options("fastest", None)


def test_env_vars_set_defaults_and_options_override(monkeypatch):
    monkeypatch.setenv("FXRT_PURE_PYTHON", "1")
    assert fxrt.CompilerConfig().pure_python is True
    assert fxrt.CompilerConfig.from_options(None, {"pure_python": False}).pure_python is False
    monkeypatch.setenv("FXRT_PURE_PYTHON", "maybe")
    with pytest.raises(ValueError, match="FXRT_PURE_PYTHON='maybe'"):
        fxrt.CompilerConfig()


def test_get_compiler_as_aot_fw_compiler(executor):
    skip_unless_executor(executor)
    from torch._functorch.aot_autograd import aot_module_simplified

    config = fxrt.CompilerConfig(pure_python=executor == "python")
    seen = []

    def fw(gm, example_inputs):
        cg = fxrt.get_compiler(config)(gm, example_inputs)
        seen.append(cg)
        return cg

    def dynamo_backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=fw)

    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    x = torch.randn(2, 4)
    with torch.no_grad():
        out = torch.compile(model, backend=dynamo_backend)(x)
        torch.testing.assert_close(out, model(x))
    assert len(seen) == 1 and isinstance(seen[0], fxrt.CompiledGraph)
    assert seen[0].executor == executor


def test_compiled_graph_exposes_ir_program_and_executor():
    x = torch.randn(2, 3)
    cg = fxrt.compile_graph(make_fx(lambda x: x.exp().sum())(x), [x])
    assert "aten::exp" in cg.graph_text()
    assert "CALL" in str(cg.program) and "FREE" in str(cg.program)
    assert cg.executor in ("python", "cpp")
    assert "executor=" in repr(cg)


def test_runtime_error_names_node_op_shapes_and_source_line(executor):
    def f(x, idx):
        y = x.relu()
        return y[idx] * 2  # an out-of-range index fails inside the graph

    x, idx = torch.randn(4, 3), torch.tensor([0, 9])
    with pytest.raises(fxrt.ExecutionError) as info:
        compile_and_run(f, (x, idx), executor)
    msg = str(info.value)
    assert "node 'index'" in msg and "aten::index.Tensor" in msg
    assert "float32[4, 3]" in msg and "int64[2]" in msg
    assert "test_api.py" in msg and "return y[idx] * 2" in msg
    assert isinstance(info.value.__cause__, IndexError)


def test_a_missing_compiled_loop_fails_the_session_unless_chosen():
    # conftest's session check: without the extension, the compiled-loop tests would only skip.
    from conftest import build_ext_skipped, compiled_loop_problem

    built = {"executor": "cpp", "reason": "built", "native_available": True, "pure_python": False}
    missing = {
        "executor": "python",
        "reason": "extension not built",
        "native_available": False,
        "pure_python": False,
    }
    assert compiled_loop_problem(built, skipped_on_purpose=False) is None
    assert "not available: extension not built" in compiled_loop_problem(missing, False)
    assert compiled_loop_problem(missing, skipped_on_purpose=True) is None
    chosen = {**built, "executor": "python", "pure_python": True}  # FXRT_PURE_PYTHON=1
    assert compiled_loop_problem(chosen, skipped_on_purpose=False) is None
    # This session passed the check: the loop is there, or FXRT_BUILD_EXT=0 says why not.
    assert build_ext_skipped() or compiled_loop_problem(fxrt.runtime_info(), False) is None
